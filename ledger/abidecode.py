"""What decoding untrusted ABI bytes (revert data, a proof's factors, another account's calldata) can raise.

eth_abi 5's ``decode`` raises its :class:`eth_abi.exceptions.DecodingError` subclasses for short data,
non-zero padding and pointers out of range; ``ValueError`` (``UnicodeDecodeError`` for a string that is not
UTF-8, and web3's ``Web3ValueError`` for calldata matching no function), ``OverflowError`` for a length or
offset too large to index, ``TypeError`` for a value of the wrong shape. A fuzz run over random and
adversarially structured bytes for every type list the ledger decodes raised only these. A handler that
catches :data:`ABI_DECODE_ERRORS` refuses the bytes with a clear error; anything else is a bug and
propagates.
"""

from __future__ import annotations

from eth_abi.exceptions import DecodingError

#: The exceptions decoding untrusted ABI bytes can raise (see the module docstring).
ABI_DECODE_ERRORS: tuple[type[Exception], ...] = (DecodingError, ValueError, TypeError, OverflowError)
