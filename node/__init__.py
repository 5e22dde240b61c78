"""Node orchestration and the ``dlx-node`` command line.

Wires ``training/`` (the DiLoCoX engine), ``p2p/`` (libp2p networking) and
``ledger/`` (the EVM record) together; those three never import each other.
Nothing is imported here so that ``dlx-node --help`` stays fast.
"""
