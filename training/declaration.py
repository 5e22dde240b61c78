"""A member's platform declaration: the 32 bytes ``joinRun(runId, platform)`` puts in ``MemberJoined`` (issue
42).

A declaration does two jobs (docs/DILOCOX.md section 11, "The platform rule"):

* it fixes the platform every contribution of the member must claim (:func:`declared_platform_problem`), so a
  cheater cannot claim, in the round it cheats, a platform its verifiers lack;
* it tells routing (``node.live.checks.routing``) which verifiers can judge the member's claims bit-exactly:
  on the same platform, or on the same CPU model and torch build under the claimant's instruction set by
  emulation (:func:`training.claimant_kernels.capability_to_emulate`). The chain holds 32 bytes, not the
  fingerprint, so that second job needs a structure the bytes keep (:func:`can_judge`).

**Version 2** (:func:`platform_declaration`, what a node declares since routing by emulation)::

    bytes 0..30   sha256(b"dlx-platform/v2\\x00" || canonical JSON of the fingerprint's *family*)[:31]
    byte  31      (native << 4) | trained

The family is the fingerprint without its ``capability`` where that is an ATen x86 level a CPU of the same
model can emulate (``DEFAULT``, ``AVX2``, ``AVX512``: codes 1, 2, 3); ``trained`` is the level the member
trains under (and its contributions claim), ``native`` the highest its CPU has (``native_cpu_capability``:
what it can rerun a claim under). Any other platform (a GPU, a CPU capability outside the levels) keeps its
capability in the family and has both codes :data:`EXACT_ONLY` (15): only an equal declaration judges it
exactly. Canonical JSON: sorted keys, no spaces, ASCII, as version 1.

**Version 1** (:func:`platform_hash`, declared by nodes before version 2): sha256 of b"dlx-platform/v1\\x00"
and the whole fingerprint's canonical JSON. Still read: a claim is the declared one if the declaration is
either form of its fingerprint, and routing treats a version-1 declaration as matching only an equal one (its
last byte may parse as codes, but its other 31 bytes are then no family any version-2 declaration has). The
zero hash (:data:`NO_PLATFORM`) declares none.

This module takes a fingerprint as an argument and imports nothing of torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: this module imports nothing of torch
    from training.fingerprint import PlatformFingerprint

#: The declaration of a member that declared no platform when it joined (``joinRun``'s zero hash).
NO_PLATFORM = bytes(32)
_V1_DOMAIN = b"dlx-platform/v1\x00"
_V2_DOMAIN = b"dlx-platform/v2\x00"

#: Version-2 codes of the ATen x86 CPU capabilities, in the order a CPU that has one runs every lower one
#: (training.claimant_kernels.CPU_CAPABILITY_LEVELS plus one).
CAPABILITY_CODES = {"DEFAULT": 1, "AVX2": 2, "AVX512": 3}
#: The code of a platform only an equal declaration judges exactly (a GPU, another CPU capability).
EXACT_ONLY = 0xF
_CODE_NAMES = {code: name for name, code in CAPABILITY_CODES.items()} | {EXACT_ONLY: "exact only"}


def _canonical(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def platform_hash(platform: PlatformFingerprint) -> bytes:
    """The version-1 declaration of ``platform``: sha256 of a domain tag and the fingerprint's canonical JSON.

    What nodes declared before version 2 (:func:`platform_declaration`); still accepted as a declaration of
    ``platform`` (:func:`declared_platform_problem`, a node's own seat in ``NodeChain.ensure_member``)."""
    return hashlib.sha256(_V1_DOMAIN + _canonical(platform.document())).digest()


def _emulatable(platform: PlatformFingerprint) -> bool:
    # A compiled CPU platform is exact only: inductor's kernels are not shown to follow ATEN_CPU_CAPABILITY
    # bit for bit (docs/DILOCOX.md section 11, "Compiled inner steps").
    return platform.device_type == "cpu" and not platform.compiled and platform.capability in CAPABILITY_CODES


def family_hash(platform: PlatformFingerprint) -> bytes:
    """The 31 bytes of a version-2 declaration that name what must be equal for a bit-exact rerun besides the
    instruction set: the fingerprint without ``capability`` where that is an emulatable level, else all of it.
    """
    document = platform.document()
    if _emulatable(platform):
        del document["capability"]
    return hashlib.sha256(_V2_DOMAIN + _canonical(document)).digest()[:31]


def platform_declaration(platform: PlatformFingerprint, native: str | None = None) -> bytes:
    """The version-2 declaration of a member that trains on ``platform`` (module docstring).

    ``native``: the highest ATen capability of the member's CPU
    (``training.claimant_kernels.native_cpu_capability``); None or a level below ``platform``'s:
    ``platform``'s own. Ignored for a platform that is not emulatable.
    """
    family = family_hash(platform)
    if not _emulatable(platform):
        return family + bytes([EXACT_ONLY << 4 | EXACT_ONLY])
    trained = CAPABILITY_CODES[platform.capability]
    top = max(trained, CAPABILITY_CODES.get(native, 0) if native is not None else 0)
    return family + bytes([top << 4 | trained])


@dataclass(frozen=True)
class Declaration:
    """A declaration read as version 2: the family hash, the trained and the native capability codes."""

    family: bytes  # 31 bytes
    trained: int  # 1..3, or EXACT_ONLY
    native: int  # trained..3, or EXACT_ONLY with trained EXACT_ONLY

    @property
    def emulatable(self) -> bool:
        return self.trained != EXACT_ONLY

    def describe(self) -> str:
        if not self.emulatable:
            return f"platform {self.family.hex()[:16]} (exact only)"
        return (f"platform {self.family.hex()[:16]} under {_CODE_NAMES[self.trained]} "
                f"(CPU up to {_CODE_NAMES[self.native]})")


def read_declaration(declared: bytes) -> Declaration | None:
    """``declared`` read as version 2, or None where its last byte is no valid pair of codes (a version-1
    hash, mostly; the zero hash). A version-1 hash whose last byte happens to be valid (7 of 256) reads as a
    family no version-2 declaration has, which matches nothing but itself (module docstring)."""
    if len(declared) != 32 or declared == NO_PLATFORM:
        return None
    native, trained = declared[31] >> 4, declared[31] & 0xF
    exact_only = native == trained == EXACT_ONLY
    if not exact_only and not (trained in _CODE_NAMES and native in _CODE_NAMES and EXACT_ONLY not in
                               (trained, native) and native >= trained):
        return None
    return Declaration(bytes(declared[:31]), trained, native)


def declares(declared: bytes, platform: PlatformFingerprint) -> bool:
    """Whether ``declared`` (version 1 or 2) is a declaration of a member training on ``platform``."""
    if len(declared) != 32 or declared == NO_PLATFORM:
        return False
    if declared == platform_hash(platform):
        return True
    read = read_declaration(declared)
    if read is None or read.family != family_hash(platform):
        return False
    return read.trained == (CAPABILITY_CODES[platform.capability] if _emulatable(platform) else EXACT_ONLY)


def can_judge(verifier: bytes, claimant: bytes) -> bool:
    """Whether a verifier that declared ``verifier`` reruns, bit-exactly, the claims of a member that declared
    ``claimant``: the same declaration (any version), or two version-2 declarations of one family where the
    claimant's instruction set is one the verifier's CPU has (it reruns under the claimant's kernels:
    ``training.claimant_kernels.capability_to_emulate``). A member that declared none is judged by nobody this
    way."""
    if claimant == NO_PLATFORM or len(claimant) != 32:
        return False
    if verifier == claimant:
        return True
    ours, theirs = read_declaration(verifier), read_declaration(claimant)
    if ours is None or theirs is None or ours.family != theirs.family:
        return False
    return ours.emulatable and theirs.emulatable and theirs.trained <= ours.native


def declared_platform_problem(claimed: PlatformFingerprint | None, declared: bytes | None) -> str | None:
    """Why a contribution's claimed platform is not the one its member declared when it joined, or None if it
    is.

    ``declared`` is the member's ``joinRun`` declaration (:func:`platform_declaration` of the fingerprint it
    trains on, or a version-1 :func:`platform_hash`; :data:`NO_PLATFORM` if it declared none), read from the
    chain's ``MemberJoined`` event of the seat in force; None: no declaration could be read (nothing to hold
    the claim to). A member that declared none holds no platform any claim could match: a claimant cannot
    pick, in the round it cheats, a platform its verifiers lack (docs/DILOCOX.md section 11); a member that
    moves to other hardware leaves and joins again. The native capability a declaration states is no part of
    the claim.
    """
    if declared is None:
        return None
    if len(declared) != 32:
        return f"its member's declared platform is {len(declared)} bytes, not a 32-byte hash"
    if declared == NO_PLATFORM:
        what = "no platform" if claimed is None else claimed.describe()
        return f"claims {what}, but its member declared no platform when it joined"
    if claimed is None:
        return f"claims no platform, but its member declared platform {declared.hex()[:16]} when it joined"
    if not declares(declared, claimed):
        read = read_declaration(declared)
        what = (f" (the same CPU model and build under {_CODE_NAMES[read.trained]})"
                if read is not None and read.family == family_hash(claimed) else "")
        return (f"claims {claimed.describe()} (platform {platform_declaration(claimed).hex()[:16]}), but its "
                f"member declared platform {declared.hex()[:16]}{what} when it joined")
    return None
