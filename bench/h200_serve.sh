#!/usr/bin/env bash
# One device-tool call: the real server (Granian) on the GPU with random:llama-3.2-1b in bf16 and the
# embedded model's tokenizer, driven by bench/serve.py at 1, 16 and 64 streaming users (each level
# starts all its users at once) and by Locust's step ramp up to 64 users. The device image lacks the server's packages: carry them as wheels in .whl (see the
# README's benchmark section). Logs and JSON land in $OUT; the table prints last.
set -u
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
export MINILLM_DEVICE=${MINILLM_DEVICE:-auto}
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
MODEL=${MODEL:-random:llama-3.2-1b}
NAME=${NAME:-llama-3.2-1b-random}
SPECS=${SPECS:-"1:16 16:96 64:256"}  # users:requests for bench/serve.py
LOCUST_S=${LOCUST_S:-90}  # Locust: 16 more users every 15 s up to 64, then held
URL=http://127.0.0.1:8000
mkdir -p "$OUT"
[ -n "${SKIP_WHEELS:-}" ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
$PY -m app.cli serve --model $MODEL --tokenizer .whl/tokenizer --served-model-name $NAME --port 8000 \
  --max-num-seqs 128 > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 240); do curl -sf $URL/ready >/dev/null && break; sleep 0.5; done
curl -sf $URL/ready >/dev/null || { echo "server not ready"; tail -30 "$OUT/server.log"; exit 1; }
echo "server ready after ${SECONDS}s"
$PY bench/serve.py --url $URL --model $NAME --users 1 --requests 4 --max-tokens 16 > /dev/null  # warm
SERVE_JSON=()
for spec in $SPECS; do
  set -- ${spec/:/ }
  SERVE_JSON+=("$OUT/serve-$1.json")
  timeout 150 $PY bench/serve.py --url $URL --model $NAME --users $1 --requests $2 --max-tokens 128 \
    --json "$OUT/serve-$1.json" > "$OUT/serve-$1.log" 2>&1
  echo "serve.py users=$1 rc=$?"
done
timeout $((LOCUST_S + 45)) $PY -m locust -f loadtest/locustfile.py --headless --host $URL -u 64 -r 16 --step-users 16 \
  --step-time 15 -t ${LOCUST_S}s --max-tokens 128 --csv "$OUT/locust" --html "$OUT/locust.html" > "$OUT/locust.log" 2>&1
echo "locust rc=$?"
curl -s $URL/metrics > "$OUT/metrics.txt"
kill -TERM $SERVER; wait $SERVER
echo "server exit rc=$?"
$PY bench/serve_results.py --model $MODEL --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo CPU)" \
  --commit "${MINILLM_COMMIT:-unknown}" --serve "${SERVE_JSON[@]}" \
  --locust "$OUT/locust" --locust-users 64 --out "$OUT/h200-serve.json"
