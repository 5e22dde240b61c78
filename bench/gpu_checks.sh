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
#   (5) with SCALE=1 (issue 75, docs/SCALE.md "What a GPU must confirm"): bench/bench_gpu.py's (a) at llama-1b
#       (the model's inner step assumes the MFU measured at llama-124m: this measures it at 1.1B, bf16, batch 8),
#       then, when anvil is on PATH, bench/bench_scale_system.py at llama-124m on the GPU machine's RAM (4 nodes
#       of about 6 GB did not fit the 24 GB CPU machine) -> $OUT/gpu_1b.json, $OUT/scale_system_gpu.json.
#       ONLY_SCALE=1: the machine and this, nothing else.
# Usage on the device machine, from the repository root, with $OUT set (the device tool):
#   bash bench/gpu_checks.sh
# A missing pure-Python dependency (base58, for node.config) travels as a wheel in .whl/.
set -u
export PYTHONUNBUFFERED=1
# Into python3's own environment (not --target): bench_reexec_isa's children set their own PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -5 ||
        echo "the carried wheels did not all install"
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

# The whole system needs anvil and a tokenizer's data, neither on the device machine: carry them in .dev/
# (git-ignored; the lead's session puts there `xz -c anvil > .dev/anvil.xz` and a `dlx-node data prepare`
# directory as .dev/bpe32k) with the node's Python dependencies as cp312 wheels in .whl/ (docs/SCALE.md).
if [ -f .dev/anvil.xz ] && [ -z "${DLX_ANVIL:-}" ]; then
    python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.dev/anvil.xz'), open('/tmp/anvil', 'wb'))" &&
        chmod +x /tmp/anvil && export DLX_ANVIL=/tmp/anvil
fi
SCALE_DATA=${SCALE_DATA:-$( [ -d .dev/bpe32k ] && echo .dev/bpe32k )}

if [ -n "${GPU_TESTS:-}" ]; then
    # the suite's GPU tests named (e.g. tests/test_training_pipeline.py), without the suite's conftest and
    # options (xdist, the end-to-end tiers): -m gpu alone
    echo "== GPU tests: ${GPU_TESTS}"
    timeout "${GPU_TESTS_SECONDS:-180}" python3 -m pytest -o addopts="" --noconftest -p no:cacheprovider -q -s \
        -m gpu ${GPU_TESTS} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi

if [ -n "${SCALE:-}${ONLY_SCALE:-}" ]; then
    echo "== scale (issue 75): llama-1b tokens/s and MFU"
    [ "${SCALE_1B:-1}" = 0 ] || timeout "${SCALE_SECONDS:-240}" python3 bench/bench_gpu.py --throughput-only --no-compile --preset-gpu llama-1b \
        --batch 8 --steps 10 --warmup 3 --out "$OUT/gpu_1b.json" >"$OUT/gpu_1b.log" 2>&1
    echo "llama-1b rc=$?"; grep -E "^\(a\)|MFU|Error|error" "$OUT/gpu_1b.log" | tail -8
    if command -v anvil >/dev/null 2>&1 || [ -n "${DLX_ANVIL:-}" ]; then
        echo "== scale (issue 75): the whole system at ${SYSTEM_PRESET:-llama-124m}, nodes on ${SYSTEM_DEVICE:-cuda}"
        python3 -c "import node.commands.demo, node.live.node, libp2p, web3" 2>&1 | tail -3
        # the demo gets SYSTEM_SECONDS less a minute to print its summary; the pull, the gas and the
        # analysis (a run cut short is analysed as one that broke off) take the rest
        seconds=${SYSTEM_SECONDS:-420}
        timeout "$seconds" python3 bench/bench_scale_system.py --preset "${SYSTEM_PRESET:-llama-124m}" \
            --vocab-size 32000 --block-size 128 --batch-size "${SYSTEM_BATCH:-8}" --rounds "${SYSTEM_ROUNDS:-3}" \
            --inner-steps "${SYSTEM_INNER:-20}" --set training.device="${SYSTEM_DEVICE:-cuda}" \
            --timeout $((seconds - 60)) $( [ -z "${SYSTEM_AUDIT:-}" ] && echo --skip-audit ) \
            ${SCALE_DATA:+--data "$SCALE_DATA"} --label "${SYSTEM_LABEL:-llama-124m-gpu}" \
            --workdir /tmp/scale-gpu --out "$OUT/scale_system_gpu.json" >"$OUT/scale_system_gpu.log" 2>&1
        echo "scale_system rc=$?"; tail -30 "$OUT/scale_system_gpu.log"
        # the runs' small records (demo output, samples, timings, profiles, node logs) to analyse elsewhere
        (cd /tmp && find scale-gpu scale-gpu.demo.out -maxdepth 3 -type f -size -8M \
            \( -name '*.out' -o -name '*.jsonl' -o -name '*.json' -o -name '*.log' -o -name '*.toml' \) \
            -print0 | tar czf "$OUT/scale_system_gpu_records.tgz" --null -T - 2>/dev/null)
    else
        echo "scale_system: no anvil on this machine (set DLX_ANVIL or carry .dev/anvil.xz): skipped"
    fi
    [ -n "${ONLY_SCALE:-}" ] && exit 0
fi

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
