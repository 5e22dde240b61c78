#!/usr/bin/env bash
# An aarch64 Python 3.11 with torch 2.13.0 (PyPI's aarch64 wheel) and numpy, run on an x86-64 Debian bookworm
# machine under qemu-user, for measuring re-execution and the bit-exact paths on ARM (issue 42):
#
#   sudo ./scripts/setup-arm-emulation.sh [PREFIX]        # default PREFIX /opt/arm-venv
#   PREFIX/bin/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())"
#   PYTHONPATH=. .venv/bin/python bench/bench_reexec_isa.py --presets llama-tiny --arm-python PREFIX/bin/python ...
#   python tests/isa_probe.py RUN.pkl 1 under PREFIX/bin/python (docs/DILOCOX.md section 11, "ARM")
#
# What it installs, all outside the repository:
# * qemu-user-static (Debian's qemu 7.2), the only package installed on the host system;
# * PREFIX/root: Debian bookworm's arm64 python3.11 and the libraries it and torch load, unpacked from the .deb
#   files (`apt-get download`, `dpkg-deb -x`), not installed: the host's dpkg state and /usr/bin/python3 are
#   untouched (installing python3:arm64 would replace the host's python3);
# * PREFIX/site: torch==2.13.0, numpy and the few packages the replay imports, for manylinux aarch64, cp311, from PyPI through the host's pip
#   (`pip install --target --platform`). PyPI's aarch64 torch is a CUDA build (NVPL BLAS, Arm Compute Library,
#   the CUDA 13 libraries it links); it runs on a CPU without a GPU, but its import loads the CUDA libraries, so
#   their aarch64 wheels come along (~3 GB);
# * PREFIX/bin/python: a shell wrapper that runs the aarch64 interpreter under qemu-aarch64-static with
#   QEMU_LD_PREFIX=PREFIX/root, PREFIX/site on the path, and the emulated CPU `max` with 256-bit SVE
#   (QEMU_CPU, overridable: `QEMU_CPU=max,sve=off` for a NEON-only CPU).
#
# qemu-user translates each aarch64 instruction; its floating point (softfloat) gives the IEEE-754 result of
# every instruction bit for bit, FMA included, so what torch computes here is what an ARM CPU with the same
# features computes with the same kernels. Timings under emulation mean nothing (10-100x slower, and no model
# of the ARM core's caches or vector units). No binfmt_misc registration is needed or made.
set -euo pipefail

PREFIX=${1:-/opt/arm-venv}
HOST_PIP=${HOST_PIP:-$(dirname "$0")/../.venv/bin/pip}
[ -x "$HOST_PIP" ] || HOST_PIP=$(command -v pip3)
TORCH=${TORCH:-torch==2.13.0}
NUMPY=${NUMPY:-numpy==2.4.6}

apt-get install -y qemu-user-static
dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
apt-get update -q

debs=$(mktemp -d)
packages="gcc-12-base libacl1 libbz2-1.0 libc6 libcom-err2 libcrypt1 libdb5.3 libexpat1 libffi8 libgcc-s1 libgomp1
  libgssapi-krb5-2 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 liblzma5 libmd0 libncursesw6 libnsl2
  libpcre2-8-0 libpython3.11-minimal libpython3.11-stdlib libreadline8 libselinux1 libsqlite3-0 libssl3 libstdc++6
  libtinfo6 libtirpc3 libuuid1 libzstd1 python3.11-minimal python3.11 zlib1g"
(cd "$debs" && apt-get download $(for p in $packages; do echo "$p:arm64"; done))
mkdir -p "$PREFIX/root" "$PREFIX/site" "$PREFIX/bin"
for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$PREFIX/root"; done
rm -rf "$debs"

# The host's pip config may pin local indexes or constraints for x86; these installs ask PyPI alone. torch goes in
# without its dependencies: its pins (cuda-toolkit 13.0.3's nvidia-cuda-cupti 13.0.85, nvidia-nccl-cu13 2.29.7)
# have no aarch64 wheel on PyPI today. The libraries its import loads follow, each at the newest release of the
# major version whose soname torch links (libcudart.so.13, libcublas.so.13, libcufft.so.12, ...): a CPU run calls
# none of them, but the dynamic loader needs them (libtorch_python.so links libtorch_cuda.so). triton and
# cuda-bindings are left out (torch.compile and the CUDA Python bindings only). pip's --platform does not widen a
# manylinux tag to older glibc levels, hence every level from 2_17 to the sysroot's 2_36.
pip_arm() {
  PIP_CONFIG_FILE=/dev/null "$HOST_PIP" install --target "$PREFIX/site" --only-binary=:all: \
    $(for v in $(seq 36 -1 17); do echo "--platform manylinux_2_${v}_aarch64"; done) --platform manylinux2014_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 "$@"
}
pip_arm "nvidia-cuda-runtime>=13,<14" "nvidia-cublas>=13,<14" "nvidia-cufft>=12,<13" "nvidia-cufile>=1.15,<2" \
  "nvidia-curand>=10,<11" "nvidia-cusparse>=12,<13" "nvidia-cuda-nvrtc>=13,<14" "nvidia-cuda-cupti>=13,<14" \
  "nvidia-nvjitlink>=13,<14" nvidia-cudnn-cu13==9.20.0.48 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.32.3 \
  nvidia-nvshmem-cu13==3.4.5 "$NUMPY" filelock typing-extensions sympy networkx jinja2 fsspec
# what training/, the config and the audit's replay import besides torch (node.config reads p2p's addresses; the
# replay's chunked roots, ledger.chunkproof, ABI-encode and keccak), at the versions of the x86 .venv
pip_arm --no-deps base58==2.1.1 msgpack==1.2.4 tqdm==4.70.1 annotated-types==0.8.0 cytoolz==1.2.0 eth-hash==0.8.0 \
  eth-typing==6.0.0 eth-utils==6.0.0 eth_abi==6.0.0 parsimonious==0.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  regex==2026.11.19 toolz==1.2.0 typing-inspection==0.4.5 pycryptodome==3.24.1
pip_arm --no-deps "$TORCH"

# qemu-user passes /proc/cpuinfo through from the host (an x86 one): torch's cpuinfo library finds no ARM
# processor in it and torch's import dies of a NULL dereference. qemu opens a path under QEMU_LD_PREFIX first where
# one exists, so the sysroot holds an ARM /proc/cpuinfo: an Arm Neoverse V1 (implementer 0x41, part 0xd40, r0p0; 256-bit
# SVE, as QEMU_CPU below emulates), one entry per host CPU. torch takes the instruction set from the auxiliary
# vector (AT_HWCAP), which qemu fills from the emulated CPU; this file gives only the core's name.
mkdir -p "$PREFIX/root/proc"
for i in $(seq 0 $(( $(nproc) - 1 ))); do
  printf 'processor\t: %d\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd40\nCPU revision\t: 0\n\n' "$i"
done > "$PREFIX/root/proc/cpuinfo"
# and its MIDR_EL1 where oneDNN's xbyak_aarch64 reads it (without it, a harmless "Can't open MIDR_EL1 sysfs entry")
for i in $(seq 0 $(( $(nproc) - 1 ))); do
  mkdir -p "$PREFIX/root/sys/devices/system/cpu/cpu$i/regs/identification"
  echo 0x00000000410fd400 > "$PREFIX/root/sys/devices/system/cpu/cpu$i/regs/identification/midr_el1"
done

cat > "$PREFIX/bin/python" <<EOF
#!/bin/sh
# aarch64 python3.11 under qemu-user (scripts/setup-arm-emulation.sh)
export QEMU_LD_PREFIX=$PREFIX/root
export QEMU_CPU="\${QEMU_CPU:-max,sve-default-vector-length=32}"
export PYTHONPATH="\${PYTHONPATH:+\$PYTHONPATH:}$PREFIX/site"
exec qemu-aarch64-static -0 "\$0" $PREFIX/root/usr/bin/python3.11 "\$@"
EOF
chmod +x "$PREFIX/bin/python"
"$PREFIX/bin/python" -c "import platform, torch; print(platform.machine(), torch.__version__, torch.backends.cpu.get_cpu_capability())"
