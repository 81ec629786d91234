"""grafana/minillm.json: every PromQL expression parses with a real PromQL parser (promql-parser,
bindings to the Rust parser used by GreptimeDB), every metric it names is in a real server's
/metrics, every query is filtered by the $model variable, and the dashboard's JSON is well formed."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.app.conftest import MODEL_NAME, start_server

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "minillm.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana fills these in before Prometheus sees the query; any valid duration parses the same.
GRAFANA_DURATIONS = re.compile(r"\$\{?__(rate_interval|interval|range)\}?")
LABEL_VALUES = re.compile(r"^label_values\((.+), *model\)$")
RANGE_FUNCTIONS = {"rate", "irate", "increase"}
SERIES_SUFFIXES = ("_total", "_bucket", "_sum", "_count")  # counters' and histograms' samples


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title/refId, expr) for every target of every panel, rows' nested panels included."""
    found = []
    for panel in panels(dashboard):
        for t in panel.get("targets", []):
            found.append((f"{panel['title']}/{t.get('refId')}", t.get("expr", "")))
    return found


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def parse(expr: str) -> promql_parser.Expr:
    return promql_parser.parse(GRAFANA_DURATIONS.sub("5m", expr))


def nodes(expr: promql_parser.Expr) -> list:
    found: list = []
    promql_parser.walk(expr, lambda node: found.append(node))
    return found


def selectors(expr: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    return [n for n in nodes(expr) if isinstance(n, promql_parser.VectorSelector)]


def variable(dashboard: dict, name: str) -> dict:
    [var] = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    return var


QUERIES = queries(load())


@pytest.fixture(scope="module")
def scraped(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """{sample name: its family's type} for this model's samples in a real /metrics, after requests
    that give every histogram a series (a stream for inter-token latency) and a non-2xx status."""
    server = start_server(default_model_dir, tmp_path_factory.mktemp("grafana") / "server.log",
                          "--speculative-method", "ngram")  # so that its counters are served too
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                r.read()
            assert client.post("/v1/completions", json=body).status_code == 200
            assert client.get("/v1/nope").status_code == 404
            text = client.get("/metrics").text
    finally:
        server.stop()
    return {s.name: family.type for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("model") == MODEL_NAME}


def test_dashboard_structure() -> None:
    d = load()
    assert d["uid"] == "minillm" and d["title"] and d["schemaVersion"] >= 36
    ds = variable(d, "datasource")
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    model = variable(d, "model")
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    assert LABEL_VALUES.match(model["definition"]) and model["query"]["query"] == model["definition"]
    assert model["multi"] and model["includeAll"] and model["allValue"] == ".*"

    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels(d):
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["h"] > 0 and 0 < g["x"] + g["w"] <= 24, p["title"]
        covered = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & covered, f"{p['title']} overlaps another panel"
        cells |= covered
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == DATASOURCE, (p["title"], t["refId"])
        if p["type"] == "heatmap":  # buckets as they are, not re-bucketed by Grafana
            assert p["options"]["calculate"] is False and all(t["format"] == "heatmap" for t in p["targets"])


@pytest.mark.parametrize(("where", "expr"), QUERIES, ids=[w for w, _ in QUERIES])
def test_expression_parses_and_filters_by_model(where: str, expr: str) -> None:
    tree = parse(expr)  # raises ValueError on a syntax error or an unknown function
    sels = selectors(tree)
    assert sels, f"{where}: no metric selected"
    for s in sels:
        assert s.name and s.name.startswith("minillm_"), f"{where}: {s.name}"
        model = [m for m in s.matchers.matchers if m.name == "model"]
        assert [(m.op, m.value) for m in model] == [(promql_parser.MatchOp.Re, "$model")], \
            f'{where}: {s.name} is not filtered by model=~"$model"'


@pytest.mark.parametrize(("where", "expr"), QUERIES, ids=[w for w, _ in QUERIES])
def test_functions_fit_the_metric_types(where: str, expr: str) -> None:
    """Rates over counters and histogram series only; quantiles over _bucket summed by le."""
    for node in nodes(parse(expr)):
        if not isinstance(node, promql_parser.Call):
            continue
        inner = [n for arg in node.args for n in nodes(arg)]
        names = [n.name for n in inner if isinstance(n, promql_parser.VectorSelector)]
        if node.func.name in RANGE_FUNCTIONS:
            assert all(n.endswith(SERIES_SUFFIXES) for n in names), f"{where}: {names}"
        if node.func.name == "histogram_quantile":
            assert names and all(n.endswith("_bucket") for n in names), f"{where}: {names}"
            aggs = [n for n in inner if isinstance(n, promql_parser.AggregateExpr)]
            assert aggs and all("le" in a.modifier.labels for a in aggs), f"{where}: not summed by le"


def test_every_metric_is_in_a_real_scrape(scraped: dict[str, str]) -> None:
    used = {s.name for _, expr in QUERIES for s in selectors(parse(expr))}
    model_metric = LABEL_VALUES.match(variable(load(), "model")["definition"])[1]
    used |= {s.name for s in selectors(promql_parser.parse(model_metric))}
    missing = sorted(used - scraped.keys())
    assert not missing, f"not in /metrics: {missing}; exposed: {sorted(scraped)}"
    for name in used:  # the suffix promises the type: rates over counters and histograms only
        kinds = ("counter", "histogram") if name.endswith(SERIES_SUFFIXES) else ("gauge",)
        assert scraped[name] in kinds, f"{name} is a {scraped[name]}"
