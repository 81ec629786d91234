#!/usr/bin/env bash
# One device-tool call: what grammar-constrained decoding (xgrammar) costs, bench/structured.py.
# Carry .whl (the xgrammar and apache-tvm-ffi cp312 wheels; the GPU machine has neither) and .tok
# (the embedded SmolLM2 model's tokenizer files; the machine lacks its package):
#   MINILLM_COMMIT=<commit> bash bench/h200_structured.sh
# Optional: TESTS (default tests/engine/test_structured_output.py, run when present; '' for none),
# TOKENIZER (default .tok), BENCH_ARGS. Logs and the JSON land in $OUT; the table prints last.
set -u
# The device machine's copy of the tree may carry a stale .git: the results must name the commit.
: "${MINILLM_COMMIT:?set MINILLM_COMMIT to the commit under test}"
OUT=${OUT:-/tmp/out}
TOKENIZER=${TOKENIZER:-.tok}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
# Into a directory of their own on PYTHONPATH: the machine's python is left as it is.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
export MINILLM_COMMIT PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
python3 -c "import importlib.metadata as m, xgrammar, tvm_ffi
print('xgrammar', m.version('xgrammar'), 'apache-tvm-ffi', m.version('apache-tvm-ffi'))" \
  || { echo "xgrammar does not import (a dependency missing from .whl?)"; exit 1; }
TESTS=${TESTS-tests/engine/test_structured_output.py}
PRESENT=$(for t in $TESTS; do [ -e "${t%%::*}" ] && echo "$t"; done)
if [ -n "$PRESENT" ]; then
  timeout 120 python3 -m pytest -q -x $PRESENT -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests: rc=$? $(tail -1 "$OUT/tests.log")"
else
  echo "tests: none present (${TESTS:-none asked})"
fi
timeout 420 python3 bench/structured.py --tokenizer "$TOKENIZER" --out "$OUT/structured.json" ${BENCH_ARGS:-} \
  > "$OUT/structured.log" 2>&1
rc=$?
echo "bench/structured.py: rc=$rc"
[ $rc -ne 0 ] && grep -E "Traceback|Error|FAILED|\[skip\]" "$OUT/structured.log" | tail -20
sed -n '/masks over .* ids;/,$p' "$OUT/structured.log"
