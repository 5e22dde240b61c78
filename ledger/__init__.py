"""The on-chain record of a training run and its Python client (knows nothing of torch or libp2p).

Modules: ``chain`` (py-evm / JSON-RPC / managed anvil backends), ``account`` (keystore or dev key),
``client`` (``LedgerClient``), ``binding`` (``binding_message``, the registry binding), ``history`` (the
client's event-log reads), ``records`` (dataclasses), ``runparams`` (a run's parameters), ``attest`` (EIP-712
signatures over round records and verdicts), ``merkle`` (contributions root), ``hashchain`` (the commit hash
chain), ``checks`` (the chain checks of an audit, one result per item), ``bytecode`` (deployed code against
the artifacts), ``events``, ``tx``, ``fees``, ``errors``, ``abidecode`` (what decoding untrusted ABI
bytes raises). This package module imports nothing heavy, so ``ledger.config`` stays cheap to load.
"""
