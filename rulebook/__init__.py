"""Pure rules that more than one package must compute to the same bits (issue 61, "One version of the math").

Plain Python on floats and ints: no torch, no numpy, and no import of another project package, so that
training/, ledger/ (and through them node/) may all import it without crossing the layering
(tests/test_layering.py). Each rule is written once here; a contract that recomputes one
(contracts/src/NormRule.sol) is checked against it by the tests.

This package imports nothing on its own: each module is imported by name.
"""
