"""Chain backends: in-process py-evm and any JSON-RPC URL (a managed local anvil: :mod:`ledger.anvil`).

* :func:`connect_pyevm` - an in-process py-evm chain (eth-tester); fast for unit tests and single-process
  runs, but its log lookup slows quadratically with chain length, so long histories belong on anvil.
* :func:`connect_rpc` - any HTTP(S) JSON-RPC endpoint; raises :class:`ChainUnavailable` if unreachable.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import requests
from web3 import EthereumTesterProvider, HTTPProvider, Web3
from web3.exceptions import BadResponseFormat, ProviderConnectionError

from ledger.errors import ChainUnavailable, ChainWaitStopped, LedgerConfigError

logger = logging.getLogger(__name__)

#: Chain id of anvil's default dev chain.
ANVIL_CHAIN_ID = 31337
#: Chain id of eth-tester's in-process py-evm chain.
PYEVM_CHAIN_ID = 131277322940537
#: Chains whose keys are public knowledge: dev keys are only ever accepted on these.
LOCAL_CHAIN_IDS = frozenset({ANVIL_CHAIN_ID, PYEVM_CHAIN_ID})


T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep retrying an RPC call whose endpoint is down (exponential backoff)."""

    total_seconds: float = 30.0
    initial_delay: float = 0.25
    max_delay: float = 4.0

    def __post_init__(self) -> None:
        if self.total_seconds < 0 or self.initial_delay <= 0 or self.max_delay < self.initial_delay:
            raise ValueError(f"RetryPolicy{self}: need total_seconds >= 0 and 0 < initial_delay <= max_delay")


NO_RETRY = RetryPolicy(total_seconds=0.0)
#: The default policy: keep retrying an unreachable endpoint for 30 s.
DEFAULT_RETRY = RetryPolicy()


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the RPC endpoint could not be reached (as opposed to a rejected request)."""
    return isinstance(
        exc,
        (
            requests.exceptions.ConnectionError,
            requests.exceptions.Timeout,
            ProviderConnectionError,
            ConnectionError,
            TimeoutError,
        ),
    )


#: While the RPC endpoint stays unreachable, the process says so at most this often (every thread's
#: retries share one outage: a node polling the chain from several threads logs one line, not one per try).
OUTAGE_REPORT_EVERY_S = 30.0


class OutageLog:
    """Process-wide, rate-limited report of an RPC outage: its start, every OUTAGE_REPORT_EVERY_S, its end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self._reported = 0.0
        self._failures = 0

    def failed(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            if self.down_since is None:
                self.down_since, self._reported, self._failures = now, now, 1
                logger.warning("%s: chain RPC unreachable (%s); retrying with backoff", what,
                               short_reason(exc))
            elif now - self._reported >= OUTAGE_REPORT_EVERY_S:
                self._reported = now
                logger.warning("chain RPC still unreachable after %.0fs (%d failed requests); retrying",
                               now - self.down_since, self._failures)

    def answered(self) -> None:
        if self.down_since is None:  # the common case: no lock taken on a healthy chain
            return
        with self._lock:
            if self.down_since is not None:
                logger.info("chain RPC reachable again after %.0fs", time.monotonic() - self.down_since)
                self.down_since = None


OUTAGE = OutageLog()


def short_reason(exc: BaseException) -> str:
    """The cause of a connection failure in a few words ("[Errno 111] Connection refused", "timed out"), not
    requests' and urllib3's nested reprs (a 300-character line)."""
    text = str(exc)
    errno = re.search(r"\[Errno -?\d+\] [^'\"()\]]+", text)
    if errno:
        return errno.group(0).strip().rstrip(":")
    if "timed out" in text.lower():
        return "timed out"
    return f"{exc.__class__.__name__}: {text}"[:160]


def call_with_retries(call: Callable[[], T], policy: RetryPolicy, what: str,
                      stop: threading.Event | None = None, outage: OutageLog | None = None) -> T:
    """Run ``call``; retry with backoff while the endpoint is unreachable, then raise ChainUnavailable.

    Only connection failures are retried: a revert or a rejected transaction is raised at once.
    An outage is logged once when it starts, then at most every ``OUTAGE_REPORT_EVERY_S``
    for the whole process, and once when the endpoint answers again (:data:`OUTAGE`).
    ``stop`` cuts the wait short: once it is set, :class:`ChainWaitStopped` is raised. ``outage``: the log
    this call reports to (default the process's, :data:`OUTAGE`; a test passes its own, so that other
    threads of the test process, answered by other chains, do not end its outage).
    """
    outage = OUTAGE if outage is None else outage
    deadline = time.monotonic() + policy.total_seconds
    delay = policy.initial_delay
    attempt = 0
    while True:
        attempt += 1
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - classified: what is not a connection error is re-raised
            if not is_connection_error(exc):
                outage.answered()  # a revert or a refusal is an answer: the endpoint is up
                raise
            outage.failed(what, exc)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChainUnavailable(
                    f"{what}: chain RPC unreachable after {attempt} attempt(s) "
                    f"over {policy.total_seconds:.1f}s: {short_reason(exc)}"
                ) from exc
            logger.debug("%s: chain RPC unreachable (%s), retrying in %.2fs", what, exc.__class__.__name__,
                         delay)
            if stop is None:
                time.sleep(min(delay, remaining))
            elif stop.wait(min(delay, remaining)):
                raise ChainWaitStopped(f"{what}: stopped while waiting for the chain RPC") from exc
            delay = min(delay * 2, policy.max_delay)
        else:
            outage.answered()
            return result


def connect_pyevm() -> Web3:
    """A fresh in-process py-evm chain (chain id 131277322940537) with ten funded dev accounts; its gas
    estimates are :func:`estimate_gas_from_use`'s."""
    provider = EthereumTesterProvider()
    chain = provider.ethereum_tester.backend.chain
    # The class too: a chain rebuilt from a snapshot is a new instance of it.
    type(chain).gas_estimator = staticmethod(estimate_gas_from_use)
    chain.gas_estimator = estimate_gas_from_use
    return Web3(provider)


def _fails_with(state, transaction, gas: int, gas_price: int | None = None):
    """Run ``transaction`` with a ``gas`` limit on ``state`` and undo it: (its error or None, gas left)."""
    from eth.vm.spoof import SpoofTransaction

    overrides = {"gas": gas} if gas_price is None else {"gas": gas, "gas_price": gas_price}
    snapshot = state.snapshot()
    try:
        computation = state.apply_transaction(SpoofTransaction(transaction, **overrides))
        return (computation.error if computation.is_error else None), computation.get_gas_remaining()
    finally:
        state.revert(snapshot)


def estimate_gas_from_use(state, transaction, tolerance: int = 21_000) -> int:
    """py-evm's gas estimate (``eth.estimators.gas.binary_gas_search_intrinsic_tolerance``: the least gas
    limit found to run without error, within ``tolerance``), searched from the gas the transaction spends
    at the block's limit instead of from the whole range [intrinsic gas, block limit].

    No limit below what the run spends can succeed, so ``spent - 1 + tolerance`` is tried first: it is
    within the tolerance of the least, and it runs unless a call needs more than 63 x ``tolerance`` gas
    (the 63/64 rule of EIP-150: what a call may forward stays under 64/63 of what it spends). Otherwise the
    search goes on in [spent, spent * 64/63 + tolerance] (doubled above until a limit succeeds). Two runs
    of the transaction for most (about 12 in py-evm's own search); a proof of the fraud proof costs one
    run each (seconds on py-evm)."""
    error, left = _fails_with(state, transaction, state.gas_limit, gas_price=0)
    if error is not None:
        raise error
    spent = state.gas_limit - left
    if spent <= transaction.intrinsic_gas:  # a plain transfer: as py-evm's own search answers
        return transaction.intrinsic_gas
    low = max(transaction.intrinsic_gas, spent) - 1
    first = min(state.gas_limit, low + tolerance)
    if _fails_with(state, transaction, first)[0] is None:
        return first
    low = first
    high = min(state.gas_limit, max(spent * 64 // 63 + tolerance, first + 1))
    while _fails_with(state, transaction, high)[0] is not None:
        low, high = high, min(state.gas_limit, 2 * high)
        if low == state.gas_limit:
            return state.gas_limit
    while high - low > tolerance:
        middle = (low + high) // 2
        if _fails_with(state, transaction, middle)[0] is None:
            high = middle
        else:
            low = middle
    return high


def connect_rpc(url: str, timeout: float = 10.0, wait: float = 0.0,
                stop: threading.Event | None = None) -> Web3:
    """Connect to the HTTP(S) JSON-RPC endpoint ``url``.

    Args:
        url: ``http://`` or ``https://`` URL.
        timeout: Per-request timeout in seconds.
        wait: Keep retrying for this many seconds if the endpoint is down (0: probe once); the
            wait is logged like any outage (:data:`OUTAGE`: when it starts, every 30 s, when it ends).
        stop: Set by the caller to give up waiting (raises :class:`ChainWaitStopped`).

    Raises:
        LedgerConfigError: ``url`` is not an http(s) URL with a host.
        ChainUnavailable: The endpoint does not answer ``eth_chainId`` within ``wait`` seconds.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:  # a usage error, not an outage
        raise LedgerConfigError(f"rpc url {url!r}: not an http:// or https:// URL with a host, e.g. "
                                "http://127.0.0.1:8545")
    provider = HTTPProvider(url, request_kwargs={"timeout": timeout}, exception_retry_configuration=None)
    w3 = Web3(provider)
    what = f"connect {url} (waiting up to {wait:.0f}s)" if wait else f"connect {url}"
    try:
        chain_id = call_with_retries(lambda: w3.eth.chain_id, RetryPolicy(total_seconds=wait), what, stop)
    except ChainWaitStopped:
        raise
    except (requests.exceptions.HTTPError, BadResponseFormat, ValueError) as exc:
        # Something answers there, but not JSON-RPC (a web server, a wrong port): a usage error, not an outage
        raise LedgerConfigError(
            f"rpc url {url}: it answers, but not as an Ethereum JSON-RPC endpoint ({short_reason(exc)}): "
            "check the host and port (anvil's default is http://127.0.0.1:8545)") from exc
    except ChainUnavailable as exc:  # say plainly where nothing answered and what to check
        port = parts.port or (443 if parts.scheme == "https" else 80)
        raise ChainUnavailable(
            f"chain RPC {url} unreachable: nothing answers at host {parts.hostname}, port {port} "
            f"({short_reason(exc.__cause__ or exc)}; tried for {wait:.0f}s): check that the chain's node "
            "runs there and that --rpc or [ledger] rpc_url names it") from exc.__cause__
    logger.info("connected to %s (chain id %d)", url, chain_id)
    return w3
