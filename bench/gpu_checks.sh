#!/usr/bin/env bash
# The GPU checks of one lent device session (issue 42), in one call that fits a 15-minute lease:
#   (1) the machine: GPU, CPU model and instruction sets, torch;
#   (2) bench/bench_gpu.py without the chain run: llama-124m tokens/s and MFU (bf16, fp32, bf16 compiled) and
#       the node's share of a round;
#       (--sweep-batches, $SWEEP: more batch sizes; a fused-AdamW variant);
#   (3) bench/bench_reexec_isa.py on that machine's CPU (every ATen capability it has: AVX-512 where present);
#   (4) with CALIBRATE=1: bench/bench_gpu.py --calibrate (CPU <-> GPU rerun distances, the CPU calibration's
#       tiny preset). The first session with a GPU ran it (bench/results/gpu_calibration.json).
#   (0) first, a minute or two: bench/bench_exact_triton.py (issue 64): the reproducible mode's kernels as
#       Triton kernels on the GPU against the CPU, bit for bit (kernels, forward and backward passes, two inner
#       steps under kernel versions 2 and 3), torch's square roots, and the mode's cost there ->
#       $OUT/exact_triton.json (bench/results/exact_triton.json keeps an H200's run). ONLY_EXACT=1: the
#       machine and this, nothing else.
# Usage on the device machine, from the repository root, with $OUT set (the device tool):
#   bash bench/gpu_checks.sh
# A missing pure-Python dependency (base58, for node.config) travels as a wheel in .whl/.
set -u
export PYTHONUNBUFFERED=1
# Into python3's own environment (not --target): bench_reexec_isa's children set their own PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD"
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed -E 's/(Flags:).*/\1 '"$(grep -o -E 'avx512[a-z_0-9]*|avx2|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"'/'
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.backends.cpu.get_cpu_capability())"
} 2>&1 | tee "$OUT/machine.txt"

echo "== exact_triton: the reproducible mode on the GPU against the CPU, bit for bit"
timeout "${EXACT_SECONDS:-180}" python3 bench/bench_exact_triton.py --out "$OUT/exact_triton.json" \
    >"$OUT/exact_triton.log" 2>&1
echo "exact_triton rc=$?"; tail -12 "$OUT/exact_triton.log"
[ -n "${ONLY_EXACT:-}" ] && exit 0

echo "== bench_gpu (a) (b)"
timeout "${GPU_SECONDS:-300}" python3 bench/bench_gpu.py --skip-chain --sweep-batches "${SWEEP:-32,64}" \
    --out "$OUT/gpu.json" >"$OUT/gpu.log" 2>&1
echo "bench_gpu rc=$?"; grep -E "^\(a\)|^\(b\)|Error|error" "$OUT/gpu.log" | tail -20

echo "== reexec_isa on this CPU"
CUDA_VISIBLE_DEVICES="" timeout "${ISA_SECONDS:-200}" python3 bench/bench_reexec_isa.py --presets llama-tiny \
    --rounds 1 --inner-steps 5 --rerun-threads 1,2 --out "$OUT/reexec_isa_device.json" >"$OUT/isa.log" 2>&1
echo "reexec_isa rc=$?"
tail -25 "$OUT/isa.log"
if [ -n "${CALIBRATE:-}" ]; then
    timeout 200 python3 bench/bench_gpu.py --calibrate --preset tiny --inner-steps 10 --seeds 3 --rounds 3 \
        --batch-size 8 --warmup-steps 5 --min-compress-numel 512 --out "$OUT/gpu_calibration.json" >"$OUT/cal.log" 2>&1
    echo "calibrate rc=$?"; grep -E "other_device_max|cheat_min" "$OUT/cal.log"
fi
