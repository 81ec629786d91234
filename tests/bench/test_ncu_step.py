"""bench/ncu_step.py's reading of Nsight Compute's CSV: kernels in launch order, their metrics in
common units, and the table's sums by kind."""
from __future__ import annotations

from bench.ncu_step import by_kind, kernels, table

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type",'
          '"Rule Description","Estimated Speedup Type","Estimated Speedup"')


def row(kid: int, name: str, grid: str, section: str, metric: str, unit: str, value: str) -> str:
    return (f'"{kid}","498","python3.12","127.0.0.1","{name}","1","7","(128, 1, 1)","{grid}","0","9.0",'
            f'"{section}","{metric}","{unit}","{value}","","","","",""')


LINES = [
    "==PROF== Connected to process 498",  # ncu's and the program's own lines are not the CSV's
    HEADER,
    row(0, "_float_rows_kernel", "(96, 3, 1)", "GPU Speed Of Light Throughput", "Duration", "usecond", "11.04"),
    row(0, "_float_rows_kernel", "(96, 3, 1)", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "34.25"),
    row(0, "_float_rows_kernel", "(96, 3, 1)", "Launch Statistics", "Registers Per Thread", "register/thread", "64"),
    row(0, "_float_rows_kernel", "(96, 3, 1)", "Occupancy", "", "", "a rule's text, no metric"),
    row(1, "_decode_split_kernel", "(8, 8, 5)", "GPU Speed Of Light Throughput", "Duration", "nsecond", "6,370"),
    row(2, "_float_rows_kernel", "(96, 3, 1)", "GPU Speed Of Light Throughput", "Duration", "usecond", "12.96"),
    row(2, "_float_rows_kernel", "(96, 3, 1)", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "30.25"),
    "done random:llama-3.2-1b 8",
]


def test_kernels_come_in_launch_order_with_their_metrics_in_microseconds() -> None:
    found = kernels(LINES)
    assert [k["kernel"] for k in found] == ["_float_rows_kernel", "_decode_split_kernel", "_float_rows_kernel"]
    assert found[0]["duration_us"] == 11.04 and found[0]["dram_pct"] == 34.25 and found[0]["registers"] == 64
    assert found[1]["duration_us"] == 6.37  # nanoseconds with a thousands separator
    assert found[1]["grid"] == "(8, 8, 5)" and "dram_pct" not in found[1]


def test_the_table_sums_each_kind_most_time_first() -> None:
    found = kernels(LINES)
    kinds = by_kind(found)
    assert [(calls, round(total, 2)) for _, calls, total in kinds] == [(2, 24.0), (1, 6.37)]
    text = table(found)
    assert text.splitlines()[0] == "3 kernels, 30.4 us one after another"
    assert "| _float_rows_kernel | (96, 3, 1) | 2 | 12.00 | 24.0 | 64 | 32.2 | 0.0 |" in text
