"""The pseudo-gradient codec's encoders (DiLoCoX's adaptive compression, arXiv 2506.21263).

One encoder protocol (:mod:`training.codec.base`), one module per encoder kind
(:mod:`~training.codec.v1` ... :mod:`~training.codec.v4`, the stateful ones on
:mod:`~training.codec.reselect` with their :mod:`~training.codec.memo`), a
registry by version (:mod:`training.codec.registry`) and what they share:
the candidate codings (:mod:`~training.codec.coding`), the factorizations
(:mod:`~training.codec.factorize`), the bandwidth allocation
(:mod:`~training.codec.allocation`) and the stats
(:mod:`~training.codec.stats`). The wire format and the exact decoder are
:mod:`training.codec_wire`; the stage's error-feedback compressor and the
front-door functions are :mod:`training.compression`.

This package imports nothing on its own: each module is imported by name.
"""
