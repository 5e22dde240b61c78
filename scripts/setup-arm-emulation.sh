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
# * PREFIX/site: torch==2.13.0 and numpy for manylinux aarch64, cp311, from PyPI through the host's pip
#   (`pip install --target --platform`). PyPI's aarch64 torch is a CUDA build (NVPL BLAS, Arm Compute Library,
#   the CUDA 13 libraries it links); it runs on a CPU without a GPU, so the CUDA wheels come along (~3 GB);
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

# The host's pip config may pin local indexes or constraints for x86; these installs ask PyPI alone. torch 2.13.0
# pins nvidia-nccl-cu13==2.29.7, which PyPI no longer serves for aarch64: torch goes in without its dependencies,
# which follow with the NCCL PyPI has (the same libnccl.so.2; a CPU run never calls it). triton is left out
# (imported only by torch.compile).
pip_arm() {
  PIP_CONFIG_FILE=/dev/null "$HOST_PIP" install --target "$PREFIX/site" --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64 --platform manylinux_2_24_aarch64 \
    --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 "$@"
}
pip_arm "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3" \
  nvidia-cudnn-cu13==9.20.0.48 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.32.3 nvidia-nvshmem-cu13==3.4.5 \
  "cuda-bindings>=13.0.3,<14" "$NUMPY" filelock typing-extensions sympy networkx jinja2 fsspec setuptools
pip_arm --no-deps "$TORCH"

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
