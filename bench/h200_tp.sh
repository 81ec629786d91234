#!/usr/bin/env bash
# One device-tool call on nvidia-h200-x2: the GPU tests (tensor parallelism first; the single-GPU
# engine shares its step path), then bench/tensor_parallel.py, and a short single-GPU decode run
# to check that one GPU did not slow down. Logs and JSON land in $OUT; the tables print last.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
head -3 "$OUT/topo.txt"
timeout "${TESTS_S:-360}" python3 -m pytest -q -x tests/gpu/test_tensor_parallel_cuda.py ${TESTS:-tests/gpu} \
  -p no:cacheprovider -s > "$OUT/tests.log" 2>&1
echo "tests/gpu: rc=$? $(tail -1 "$OUT/tests.log")"
grep -E "identical" "$OUT/tests.log"
timeout 480 python3 bench/tensor_parallel.py --out "$OUT/tp.json" ${TP_ARGS:-} > "$OUT/tp.log" 2>&1
echo "bench/tensor_parallel.py: rc=$?"
if [ -z "${SKIP_ONE_GPU:-}" ]; then
  timeout 240 python3 bench/gpu.py --models llama-3.2-1b --batches 1,8 --skip-transformers --quantized "" \
    --ttft-prompts 2048 --out "$OUT/one-gpu.json" > "$OUT/one-gpu.log" 2>&1
  echo "bench/gpu.py (one GPU): rc=$?"
  sed -n '/^| /,$p' "$OUT/one-gpu.log"
fi
sed -n '/^| /,$p' "$OUT/tp.log"
