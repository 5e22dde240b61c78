"""The node's view of the chain: one small adapter over :mod:`ledger`.

Everything the runtime asks of the ledger goes through here, so the round
protocol reads in its own terms (``last_round`` is -1 before the first commit,
bindings are cached, registration happens once).
"""

from __future__ import annotations

import logging
import threading

from ledger.account import load_account
from ledger.chain import AnvilProcess, connect_rpc
from ledger.client import LedgerClient, binding_message
from ledger.errors import LedgerError
from ledger.records import CheckpointRecord, RoundCommit
from node.config import NodeConfig
from node.errors import ConfigError, NotRegistered

logger = logging.getLogger(__name__)


class NodeChain:
    def __init__(self, client: LedgerClient, anvil: AnvilProcess | None = None) -> None:
        self.client = client
        self._anvil = anvil
        self._bindings: dict[tuple[bytes, bytes], bool] = {}
        self._lock = threading.Lock()  # web3 HTTP sessions and nonces are not shared across threads safely

    @classmethod
    def connect(cls, cfg: NodeConfig) -> NodeChain:
        lc = cfg.ledger
        if not (lc.registry_address and lc.ledger_address):
            raise ConfigError("ledger.registry_address and ledger.ledger_address must be set to the run's "
                              "deployment (see deployment.json written by 'dlx-node demo')")
        anvil = None
        if lc.backend == "rpc":
            w3 = connect_rpc(lc.rpc_url, timeout=lc.request_timeout, wait=lc.request_timeout)
        elif lc.backend == "anvil":
            anvil = AnvilProcess(state_file=cfg.path(lc.anvil_state_file) if lc.anvil_state_file else None)
            w3 = connect_rpc(anvil.start(), timeout=lc.request_timeout, wait=lc.request_timeout)
        else:
            raise ConfigError("ledger.backend='pyevm' is in-process only: a node process needs "
                              "ledger.backend='rpc' (or 'anvil') to share the chain with its peers")
        account = load_account(lc, w3.eth.chain_id)
        client = LedgerClient.from_config(w3, account, lc)
        return cls(client, anvil)

    @property
    def account_bytes(self) -> bytes:
        return bytes.fromhex(self.client.address[2:])

    def close(self) -> None:
        if self._anvil is not None:
            self._anvil.stop()

    def check_run(self, run_id: int, config_hash: bytes) -> None:
        with self._lock:
            info = self.client.run_info(run_id)
        if info.config_hash != config_hash:
            raise ConfigError(
                f"run {run_id} on chain has configHash {info.config_hash.hex()}, but this node's settings hash "
                f"to {config_hash.hex()}: use exactly the run's [model], [training], [diloco], [compression] "
                "and pipeline.num_stages settings and the same training text"
            )

    def ensure_registered(self, identity) -> None:
        """Register this node's ed25519 key with its account, once."""
        with self._lock:
            key = self.client.key_of(self.client.address)
            if key == identity.public_key_bytes:
                return
            if key is not None:
                raise NotRegistered(f"account {self.client.address} is registered with another node key; "
                                    "use that key's identity file or another account")
            message = binding_message(self.client.chain_id, self.client.registry_address, self.client.address)
            try:
                self.client.register(identity.public_key_bytes, identity.sign(message))
            except LedgerError as exc:
                raise NotRegistered(f"account {self.client.address} is not registered and registering failed: "
                                    f"{exc}") from exc
        logger.info("registered account %s with peer id %s", self.client.address, identity.peer_id)

    def is_bound(self, account: bytes, public_key: bytes) -> bool:
        """Whether the registry binds ``account`` to ``public_key`` (cached once true)."""
        cache_key = (account, public_key)
        if self._bindings.get(cache_key):
            return True
        try:
            with self._lock:
                bound = self.client.key_of("0x" + account.hex()) == public_key
        except LedgerError as exc:
            logger.debug("binding check failed: %s", exc)
            return False
        self._bindings[cache_key] = bound
        return bound

    def last_round(self, run_id: int) -> int:
        with self._lock:
            last = self.client.last_round(run_id)
        return -1 if last is None else last

    def commit_of(self, run_id: int, round_index: int) -> RoundCommit | None:
        with self._lock:
            return self.client.commit_of(run_id, round_index)

    def latest_checkpoint(self, run_id: int) -> CheckpointRecord | None:
        with self._lock:
            return self.client.latest_checkpoint(run_id)

    def commit_round(self, commit: RoundCommit) -> str:
        with self._lock:
            return self.client.commit_round(commit)

    def publish_checkpoint(self, run_id: int, round_index: int, content_hash: bytes, uri: str) -> str:
        with self._lock:
            return self.client.publish_checkpoint(run_id, round_index, content_hash, uri)

    def dispute(self, run_id: int, round_index: int, weights_root: bytes, contributions_root: bytes) -> str:
        with self._lock:
            return self.client.dispute(run_id, round_index, weights_root, contributions_root)
