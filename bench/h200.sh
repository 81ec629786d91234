#!/usr/bin/env bash
# One device-tool call: GPU tests, where a decode step's time goes, then the benchmark of record.
# Logs and the JSON land in $OUT; the summary table and the comparison with the last record print last.
# The benchmark of record alone takes 8-9 minutes: run it as its own call (SKIP_TESTS=1 SKIP_PROFILE=1).
set -u
# The device machine's copy of the tree may carry a stale .git: the results must name the commit.
: "${MINILLM_COMMIT:?set MINILLM_COMMIT to the commit under test}"
export MINILLM_COMMIT PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
# The engine imports xgrammar, which the device image lacks: carry its wheels in .whl (bench/README.md,
# "The device scripts", says how to make them).
if ls .whl/xgrammar-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || exit 1
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TESTS_TIMEOUT_S:-570}" python3 -m pytest -q -x ${TESTS:-tests/gpu} -p no:cacheprovider -s > "$OUT/tests.log" 2>&1
  echo "tests/gpu: rc=$? $(tail -1 "$OUT/tests.log")"
  grep -E "identical|not a benchmark" "$OUT/tests.log"
fi
if [ -n "${ONE_ROW:-}" ]; then  # the INT4 one-row kernels' tilings (bench/quant_kernels.py --int4-one-row)
  timeout 120 python3 bench/quant_kernels.py --int4-one-row ${INT4_TILINGS:+--int4-tilings "$INT4_TILINGS"} \
    > "$OUT/one_row.log" 2>&1
  grep -E "^\|" "$OUT/one_row.log"
fi
if [ -n "${GRAPH_AB:-}" ]; then  # bench/graph_ab.py once per line of arguments: throwaway A/Bs of module constants
  i=0
  while IFS= read -r ab_args; do
    [ -z "$ab_args" ] && continue
    i=$((i + 1))
    timeout 240 python3 bench/graph_ab.py $ab_args --out "$OUT/graph_ab_$i.json" > "$OUT/graph_ab_$i.log" 2>&1
    echo "graph_ab $i ($ab_args): rc=$?"
    sed -n '/^| /,$p' "$OUT/graph_ab_$i.log"
  done <<< "$GRAPH_AB"
fi
if [ -z "${SKIP_PROFILE:-}" ]; then
  if [ -n "${PROFILE_BASE:-}" ]; then  # another tree's profile first (a before/after on one machine)
    (cd "$PROFILE_BASE" && timeout 150 python3 bench/profile_step.py --batches 1 8 64 > "$OUT/profile-base.log" 2>&1)
    echo "$PROFILE_BASE:"; grep -E "^batch" "$OUT/profile-base.log"; echo "this tree:"
  fi
  timeout 150 python3 bench/profile_step.py --batches 1 8 64 --host-profile > "$OUT/profile.log" 2>&1
  grep -E "^batch" "$OUT/profile.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout 575 python3 bench/gpu.py --out "$OUT/h200.json" --budget-s "${BUDGET_S:-520}" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench: rc=$?"
  sed -n '/^| /,$p' "$OUT/bench.log" | tail -90
fi
