"""A spot check rerun in a child process under the claimant's CPU kernels (issue 42).

ATen picks its CPU kernels (DEFAULT, AVX2, AVX512) once per process, from the CPU or from
``ATEN_CPU_CAPABILITY``, and MKL/oneDNN pick their code path once, from the CPU or from the variables
of :data:`training.fingerprint.BLAS_DISPATCH_ENV` (``MKL_CBWR``, ...); a contribution trained under another
choice on this CPU model is reproduced bit for bit only under that one
(:func:`training.claimant_kernels.kernels_to_emulate`). :func:`verify_under_kernels` runs
:func:`training.reexec.verify_contribution` in a child started with the claimant's settings and returns
its :class:`~training.reexec.SpotCheck`; the rule it was judged by comes from the child's own
fingerprint, so a child that did not get the settings is judged as another platform, never passed as
an exact one.

The child reads its arguments as a pickle on stdin and writes the result as a pickle on stdout:
both ends are this module (the parent pickles what it read and checked; nothing a peer sent is
unpickled).

    python -m training.rerun_child      # stdin: pickled kwargs; stdout: pickled SpotCheck
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

from training.claimant_kernels import describe_kernels, emulated_environment
from training.errors import ReexecError

#: How long one emulated rerun may take before the parent gives it up.
CHILD_TIMEOUT_S = 900.0


def child_env(settings: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with ``settings`` applied
    (:func:`training.claimant_kernels.kernels_to_emulate`) and this checkout on the path."""
    env = emulated_environment(settings)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def verify_under_kernels(settings: dict[str, str | None], *, timeout: float = CHILD_TIMEOUT_S, **kwargs):
    """:func:`training.reexec.verify_contribution` (``**kwargs``: its arguments, by name) in a child under
    ``settings`` (:func:`training.claimant_kernels.kernels_to_emulate`). Raises :class:`ReexecError` if the
    child fails or overruns."""
    under = describe_kernels(settings)
    try:
        done = subprocess.run([sys.executable, "-m", "training.rerun_child"], input=pickle.dumps(kwargs),
                              env=child_env(settings), capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ReexecError(f"the rerun under {under} did not finish within {timeout:.0f}s") from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise ReexecError(f"the rerun under {under} failed (exit {done.returncode}): {tail[0]}")
    try:
        return pickle.loads(done.stdout)
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise ReexecError(f"the rerun under {under} wrote no result: {exc}") from None


def main() -> int:
    from training.reexec import verify_contribution

    kwargs = pickle.loads(sys.stdin.buffer.read())
    args = [kwargs.pop(name) for name in ("state_parts", "claims", "corpus", "model_cfg", "training_cfg",
                                          "diloco_cfg", "compression_cfg")]
    check = verify_contribution(*args, **kwargs)
    sys.stdout.buffer.write(pickle.dumps(check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
