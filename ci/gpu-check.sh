#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (fetch the wheels first: ci/gpu-wheels.sh).
# Results land in $OUT (the device tool brings them back), or in bench-results/gpu:
#   env.txt             nvidia-smi and `rlink info` (UCX transports seen, what auto would pick)
#   gpu-tests.txt       pytest tests/gpu: CUDA steps into cuda:0 batches per plane, publishing
#                       CUDA parameters (NCCL where each rank has a GPU of its own)
#   gpu-throughput.*    bench/throughput.py --device cuda:0 (CUDA steps -> batches on the GPU)
#   fanout.txt          bench/fanout.py: publish vs a plain broadcast of the same bytes
# Every step has its own time limit, so one that hangs still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl failed" | tee "$OUT/env.txt"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())";
  timeout 60 python3 -m rlink_ucx info; } > "$OUT/env.txt" 2>&1
timeout 300 python3 -m pytest tests/gpu -v -p no:cacheprovider > "$OUT/gpu-tests.txt" 2>&1
echo "pytest exit status $?" >> "$OUT/gpu-tests.txt"
timeout 240 python3 bench/throughput.py --device cuda:0 --sizes 64K,1M,16M --reps 3 --steps 50000 \
  --json "$OUT/gpu-throughput.json" > "$OUT/gpu-throughput.txt" 2>&1
echo "exit status $?" >> "$OUT/gpu-throughput.txt"
timeout 120 python3 bench/fanout.py --reps 3 > "$OUT/fanout.txt" 2>&1
echo "exit status $?" >> "$OUT/fanout.txt"
tail -n 3 "$OUT"/*.txt
