#!/usr/bin/env bash
# What a lent GPU machine needs to run the whole node (bench/gpu_checks.sh SCALE=1: `dlx-node demo` under
# bench_scale_system.py), built here into two git-ignored folders that a device call carries:
#   .whl/  the node's Python dependencies that the device image lacks, as cp312 manylinux wheels (its python3
#          is 3.12 with torch, numpy, transformers and aiohttp already there);
#   .dev/  anvil, xz-compressed (the tree and the carried folders must stay under 64 MiB together), and a
#          prepared dataset (dlx-node data prepare) as .dev/bpe32k.
# Usage (from the repository root, after scripts/setup.sh):
#   scripts/prepare_device_carry.sh [prepared-dataset-dir]
# then, with the device tool: carry [".whl", ".dev"], command `SCALE=1 ONLY_SCALE=1 bash bench/gpu_checks.sh`.
# Seen working 2026-11-29 on an H200 machine (Python 3.12.3, torch 2.11): 73 wheels, 31 MB; anvil 12.5 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-}
for path in /.whl/ /.dev/; do
    grep -qx "$path" .git/info/exclude 2>/dev/null || echo "$path" >>.git/info/exclude
done
rm -rf .whl .dev && mkdir -p .whl .dev

# The device image's packages (KINDS.md in the device tool's library, read 2026-11-17): not carried.
image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click filelock frozenlist fsspec grpcio h11 hf-xet httpcore httpx huggingface-hub hypothesis
idna iniconfig jinja2 llvmlite markdown-it-py markupsafe mdurl mpmath msgpack multidict networkx numba numpy
packaging pip pluggy prometheus-client propcache protobuf psutil pygments pytest pytest-timeout pytest-xdist pyyaml regex
requests rich safetensors setuptools shellingham six sortedcontainers sympy tokenizers toolz torch tqdm
transformers triton typer typing-extensions typing-inspect urllib3 wheel wrapt xxhash yarl zipp"
# Never carried: the linter, type stubs, this project itself.
skip="ruff types-protobuf types-requests mypy-protobuf dlx-node"
norm() { echo "$1" | tr '[:upper:]_.' '[:lower:]--'; }
wanted=$(.venv/bin/python -m pip freeze 2>/dev/null | grep -E '^[A-Za-z0-9][^ ]*==' | while IFS='=' read -r name _ version; do
    n=$(norm "$name")
    case " $(echo $image $skip) " in *" $n "*) continue ;; esac
    echo "$name==${version%%+*}"
done)
# protobuf and typing_extensions are in the image but older than libp2p's generated code and pydantic need.
wanted="$wanted protobuf==$(.venv/bin/python -c 'import google.protobuf as p; print(p.__version__)')
typing_extensions==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("typing_extensions"))')"
platforms=""
for n in 5 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
platforms="$platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
for requirement in $wanted; do
    if .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $platforms -d .whl "$requirement" >/dev/null 2>&1; then
        continue
    fi
    case "$requirement" in
        fastecdsa==*)  # libp2p pins 2.3.2, which has no cp312 wheel; 3.0.1 keeps the API libp2p uses
            .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
                --implementation cp $platforms -d .whl fastecdsa==3.0.1 ;;
        *)  # a pure-Python sdist: its wheel built here runs there
            .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl "$requirement" ;;
    esac
done
anvil=contracts/node_modules/@foundry-rs/anvil-linux-amd64/bin/anvil
[ -x "$anvil" ] || { echo "no $anvil: run scripts/setup.sh first" >&2; exit 1; }
xz -T2 -6 -c "$anvil" >.dev/anvil.xz
if [ -n "$data" ]; then cp -r "$data" .dev/bpe32k; fi
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1); .dev $(du -sh .dev | cut -f1);" \
    "tracked tree $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1) (64 MiB in all)"
