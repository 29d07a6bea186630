#!/usr/bin/env bash
# The cuda backend's check on a real NVIDIA GPU (sized for one H200, under 10 minutes; timeouts sum to 570 s, most of it for the per-op benchmark, which compiles every kernel variant first):
#   1. the whole conformance suite on the GPU, without the Triton interpreter;
#   2. benchmarks/ops.py over the R x k x V grid, beside FlashInfer where it imports.
#   3. the scheduler's device paths (memory hook, plan, pinned transfer).
#   4. draft trees: the target's tree verify and the EAGLE head's chain / tree drafting against one
#      decode (benchmarks/trees.py, random weights of SmolLM2-135M's shapes: that machine has no model files).
# Results land in benchmarks/results/ (or $OUT when set): gpu-conformance.txt, ops-gpu.md, gpu-env.txt,
# gpu-scheduler.txt, trees-gpu.md.
# Needs torch, triton, pytest, pluggy, numpy (the H200 image has them); installs spec-hal itself.
# First, off the device: scripts/compile_check.py under the image's Triton (3.6 on the H200 image).
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${OUT:-benchmarks/results}
mkdir -p "$RES"
unset TRITON_INTERPRET HAL_BACKEND
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=${PYTHON:-python3}

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$RES/gpu-env.txt" 2>&1
# Entry points need an install; without one, HAL_PLUGINS registers the same plugins.
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export HAL_PLUGINS=backends.cpu,backends.cuda
$PY -m hal info | tee -a "$RES/gpu-env.txt"

# Compiling every kernel variant is CPU work: serially the suite passed 30% in 260 s on the H200's
# 16 cores, with 8 xdist workers all of it in 109 s.
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 200 $PY -m hal conformance --backend cuda -rf $XDIST 2>&1 | tee "$RES/gpu-conformance.txt"
conf=${PIPESTATUS[0]}
echo "conformance exit code: $conf" | tee -a "$RES/gpu-conformance.txt"
# the long tail (2e9 token evaluations per op: seconds on a GPU, hours under the interpreter)
timeout 60 $PY -m hal conformance --backend cuda --slow -k test_long_tail -rf 2>&1 | tee "$RES/gpu-long-tail.txt"

# 3. the scheduler's device paths: memory planning against the real device, a pinned non-blocking transfer
timeout 30 $PY - <<'PY' 2>&1 | tee "$RES/gpu-scheduler.txt"
import torch
from hal.devices import transfer
from hal.distributed.placement import resolve_side
from hal.engine.memory import ModelMemory, plan_memory
side = resolve_side("cuda:0", "target")
print("free/total bytes:", side.backend.spec.memory(0), "collective:", side.backend.spec.collective)
smol = ModelMemory("smollm2-135m", 651306240, 30, 3, 64, 576, 1536, 49152)
print(plan_memory(smol, side, smol, side, max_seqs=128, max_context=8192).report())
x = torch.randn(1024, 49152)
assert torch.equal(transfer(x, side.device).cpu(), x)
print("transfer ok")
PY

timeout 60 $PY benchmarks/trees.py --backend cuda --random --nodes 3,7,15,30 --reps 7 --threads 16 \
    --out "$RES/trees-gpu.md" > /dev/null 2>"$RES/trees-gpu.err"
echo "trees benchmark exit code: $?" | tee -a "$RES/gpu-env.txt"

timeout 220 $PY benchmarks/ops.py --full --no-hf --reps 10 --out "$RES/ops-gpu.md" > /dev/null 2>"$RES/ops-gpu.err"
echo "benchmark exit code: $?" | tee -a "$RES/gpu-env.txt"
exit "$conf"
