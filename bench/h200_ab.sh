#!/usr/bin/env bash
# One device-tool call for a change under way: GPU tests, bench/profile_step.py on both trees (kernels
# and µs a step), then bench/ab.py's interleaved partial runs. Not a record. The base tree travels as
# an ignored folder (git archive BASE | tar -x -C .base; carry .base and .whl).
# SKIP_AB=1 stops after the profiles.
#   BASE_COMMIT=4f178e9 MINILLM_COMMIT=<head> TESTS="tests/gpu/..." AB_ARGS="..." bash bench/h200_ab.sh
set -u
: "${BASE_COMMIT:?}" "${MINILLM_COMMIT:?}"
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  PYTHONPATH=.:/tmp/site timeout "${TESTS_S:-200}" python3 -m pytest -q $TESTS -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests: rc=$? $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
fi
for side in base head; do
  tree=.; [ $side = base ] && tree=.base
  (cd $tree && PYTHONPATH=.:/tmp/site timeout 120 python3 bench/profile_step.py --batches ${PROFILE_BATCHES:-1 64} \
     --steps 30 ${PROFILE_ARGS:-}) > "$OUT/profile-$side.log" 2>&1
  echo "profile $side: $(grep -E '^batch' "$OUT/profile-$side.log" | tr '\n' ' ')"
done
[ -n "${SKIP_AB:-}" ] && exit 0
PYTHONPATH=/tmp/site timeout "${AB_S:-330}" python3 bench/ab.py --base .base --base-commit "$BASE_COMMIT" --head . \
  --head-commit "$MINILLM_COMMIT" --rounds "${ROUNDS:-2}" --out "$OUT/ab.json" -- ${AB_ARGS:-} > "$OUT/ab-summary.log" 2>&1
echo "ab: rc=$? (bench/gpu.py's output: $OUT/ab.log)"
sed -n '/^| /,$p' "$OUT/ab-summary.log" | tail -40
