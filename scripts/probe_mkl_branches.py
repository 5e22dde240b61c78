"""Which MKL code paths give other bits on this CPU (docs/DILOCOX.md section 11, "The math libraries' code
path is part of the platform").

Runs one float32 matrix product (256x512 by 512x384, 1 thread, 50 times) in a fresh process per
``MKL_CBWR`` branch and prints, per branch, the sha256 of the product's bytes and the mean time of one
product. Equal hashes: the same code path; the times are this machine's under its current load.

    python scripts/probe_mkl_branches.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

BRANCHES = ["(unset)", "AUTO", "COMPATIBLE", "SSE2", "SSE4_2", "AVX2", "AVX2,STRICT", "AVX512"]
CHILD = """
import hashlib, json, time, torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
a, b = torch.randn(256, 512, generator=g), torch.randn(512, 384, generator=g)
c = a @ b
start = time.perf_counter()
for _ in range(50):
    c = a @ b
print(json.dumps({"sha256": hashlib.sha256(c.numpy().tobytes()).hexdigest()[:16],
                  "ms": round((time.perf_counter() - start) / 50 * 1e3, 3),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def main() -> int:
    rows = []
    for branch in BRANCHES:
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
        if branch != "(unset)":
            env["MKL_CBWR"] = branch
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            rows.append({"MKL_CBWR": branch, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        rows.append({"MKL_CBWR": branch, **json.loads(done.stdout.strip().splitlines()[-1])})
    print(json.dumps({"cpu": _cpu(), "rows": rows}, indent=1))
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                        "")
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
