"""Configuration of the chain connection (no web3 import here)."""

from __future__ import annotations

from dataclasses import dataclass

from ledger.errors import LedgerConfigError

BACKENDS = ("anvil", "pyevm", "rpc")


@dataclass
class LedgerConfig:
    backend: str = "anvil"  # anvil: a managed local anvil; pyevm: in-process; rpc: rpc_url
    rpc_url: str = ""
    anvil_state_file: str = ""  # persist the managed anvil's chain across restarts
    keystore: str = ""  # encrypted keystore JSON; empty with dev_account >= 0 on local chains
    password_file: str = ""
    dev_account: int = -1  # index of a well-known dev key, local chains only
    registry_address: str = ""
    ledger_address: str = ""
    run_id: int = 0
    chain_id: int = 0  # the run's chain; a node refuses an rpc_url serving another (0: not checked)
    confirmations: int = 0  # blocks (its own included) before a sent transaction counts as final; 0/1: mined
    max_fee_gwei: float = 0.0  # cap on maxFeePerGas in gwei (0: no cap)
    priority_fee_gwei: float = -1.0  # the tip in gwei (-1: ask the node, eth_maxPriorityFeePerGas)
    replace_after: float = 20.0  # seconds an unmined transaction waits before it is replaced with higher fees
    request_timeout: float = 10.0
    retry_seconds: float = 30.0  # keep retrying an unreachable RPC this long before ChainUnavailable
    startup_wait: float = 600.0  # a starting node waits this long for an unreachable RPC (0: fail at once)
    receipt_timeout: float = 60.0  # seconds to wait for a sent transaction to be mined
    from_block: int = 0  # first block to scan for events (the deployment block; 0 = genesis)
    log_page_blocks: int = 10_000  # blocks per eth_getLogs request (public RPCs cap the range)
    anvil_state_interval: int = 1  # seconds between state dumps of a managed anvil with a state file
    # the run's step program file (node/stepprogram.py), checked against the chain: what this node answers a
    # contribution case on its own work with (issue 78); empty: such a case is logged as not answerable
    step_program: str = ""
    # open a contribution case where this node's accusation was not convicted (node/live/fraud/opener.py); off
    # until a claim's end is bound (docs/FRAUD_PROOF.md "An honest node that opens a case itself")
    open_cases: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise LedgerConfigError(f"ledger.backend={self.backend!r}: must be one of {list(BACKENDS)}")
        if self.backend == "rpc" and not self.rpc_url:
            raise LedgerConfigError("ledger.backend='rpc' needs ledger.rpc_url, e.g. http://127.0.0.1:8545")
        if self.rpc_url and not self.rpc_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise LedgerConfigError(
                f"ledger.rpc_url={self.rpc_url!r}: must start with http://, https://, ws:// or wss://")
        if self.keystore and self.dev_account >= 0:
            raise LedgerConfigError("ledger.keystore and ledger.dev_account are both set: keep only one")
        for name in ("registry_address", "ledger_address"):
            value = getattr(self, name)
            if value and not (value.startswith("0x") and len(value) == 42):
                raise LedgerConfigError(f"ledger.{name}={value!r}: must be a 0x-prefixed 20-byte hex address")
        if self.run_id < 0:
            raise LedgerConfigError(f"ledger.run_id={self.run_id}: must be >= 0")
        if self.request_timeout <= 0:
            raise LedgerConfigError(f"ledger.request_timeout={self.request_timeout}: must be > 0 seconds")
        if self.retry_seconds < 0:
            raise LedgerConfigError(f"ledger.retry_seconds={self.retry_seconds}: must be >= 0 (0: no retry)")
        if self.chain_id < 0:
            raise LedgerConfigError(f"ledger.chain_id={self.chain_id}: must be >= 0 (0: not checked)")
        if self.startup_wait < 0:
            raise LedgerConfigError(
                f"ledger.startup_wait={self.startup_wait}: must be >= 0 seconds (0: no wait)")
        if self.receipt_timeout <= 0:
            raise LedgerConfigError(f"ledger.receipt_timeout={self.receipt_timeout}: must be > 0 seconds")
        if self.from_block < 0:
            raise LedgerConfigError(
                f"ledger.from_block={self.from_block}: must be >= 0 (the deployment block)")
        if self.log_page_blocks < 1:
            raise LedgerConfigError(f"ledger.log_page_blocks={self.log_page_blocks}: must be >= 1")
        if self.confirmations < 0:
            raise LedgerConfigError(f"ledger.confirmations={self.confirmations}: must be >= 0 blocks")
        if self.max_fee_gwei < 0:
            raise LedgerConfigError(f"ledger.max_fee_gwei={self.max_fee_gwei}: must be >= 0 (0: no cap)")
        if self.priority_fee_gwei < 0 and self.priority_fee_gwei != -1:
            raise LedgerConfigError(
                f"ledger.priority_fee_gwei={self.priority_fee_gwei}: must be >= 0, or -1 (ask "
                "the node)")
        if self.replace_after <= 0:
            raise LedgerConfigError(f"ledger.replace_after={self.replace_after}: must be > 0 seconds")
        if self.anvil_state_interval < 1:
            raise LedgerConfigError(
                f"ledger.anvil_state_interval={self.anvil_state_interval}: must be >= 1 second")


def fee_policy(config: LedgerConfig):
    """The :class:`ledger.fees.FeePolicy` of a configuration (web3 is imported only here)."""
    from ledger.fees import FeePolicy

    return FeePolicy(
        max_fee_cap=int(config.max_fee_gwei * 10**9),
        priority_fee=None if config.priority_fee_gwei < 0 else int(config.priority_fee_gwei * 10**9),
        replace_after=config.replace_after,
        confirmations=config.confirmations,
    )
