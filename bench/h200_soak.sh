#!/usr/bin/env bash
# loadtest/soak.py against the real server (Granian) on the GPU: random:llama-3.2-1b in bf16 with the
# embedded model's tokenizer in .tok/. Carry the server's packages and xgrammar's as cp312 wheels in
# .whl/ (pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ...).
# One call is capped at 10 minutes, server start included, so:
#   PHASE=all (default): start, soak DURATION_S (default 240) and stop, in one call;
#   PHASE=start, then PHASE=collect at once (a machine idle 30 s is given back): the server and the
#     soak run in sessions of their own, which outlive the first call; the second waits for the soak
#     to end, stops the server and brings the report back. For the 10-minute run: DURATION_S=600.
#     Make the two calls back to back from one caller, and no other call in between: one call that
#     took the warm machine between them also ran its benchmark beside the soak's server, and the
#     soak was lost when the machine went back. The first call does not return before its timeout (the
#     device tool waits for the processes it started), so give it timeout_s 300; the server and the
#     soak outlive that. Budget about 12 device minutes.
# Logs and soak.json land in $OUT; the soak's summary prints last.
set -u
OUT=${OUT:-/tmp/out}
RUN=/tmp/minillm-soak  # kept between the two calls of PHASE=start/collect
URL=http://127.0.0.1:8000
PHASE=${PHASE:-all}
DURATION_S=${DURATION_S:-240}
mkdir -p "$OUT" "$RUN"
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1

start() {
  nvidia-smi --query-gpu=name --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$RUN/pip.log" 2>&1 \
    || { tail "$RUN/pip.log"; exit 1; }
  setsid python3 -m app.cli serve --model "${MODEL:-random:llama-3.2-1b}" --tokenizer .tok --port 8000 \
    --max-num-seqs 128 > "$RUN/server.log" 2>&1 < /dev/null &
  echo $! > "$RUN/server.pid"
  for _ in $(seq 300); do curl -sf $URL/ready >/dev/null && break; sleep 0.5; done
  curl -sf $URL/ready >/dev/null || { echo "server not ready"; tail -30 "$RUN/server.log"; exit 1; }
  echo "server ready after ${SECONDS}s"
  setsid python3 loadtest/soak.py --url $URL --duration "${DURATION_S}s" --concurrency "${CONCURRENCY:-32}" \
    --max-tokens 128 --seed "${SEED:-1}" --out "$RUN/soak.json" > "$RUN/soak.log" 2>&1 < /dev/null &
  echo $! > "$RUN/soak.pid"
}

collect() {
  while kill -0 "$(cat "$RUN/soak.pid")" 2>/dev/null; do sleep 1; done
  curl -s $URL/metrics > "$RUN/metrics.txt"
  kill -TERM "$(cat "$RUN/server.pid")"
  for _ in $(seq 60); do kill -0 "$(cat "$RUN/server.pid")" 2>/dev/null || break; sleep 0.5; done
  cp "$RUN"/*.log "$RUN"/*.json "$RUN"/metrics.txt "$OUT/" 2>/dev/null
  sed -n '/^soak of/,$p' "$RUN/soak.log"
}

case $PHASE in
  all) start; collect ;;
  start) start; sleep "${WAIT_S:-$(( DURATION_S < 450 ? DURATION_S : 450 ))}"; tail -3 "$RUN/soak.log" ;;
  collect) collect ;;
  *) echo "PHASE is all, start or collect"; exit 2 ;;
esac
