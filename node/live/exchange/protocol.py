"""How a round's contributions travel: the exchange protocol, and the pool of fetched contributions.

:class:`Exchange` is one protocol with one module per kind, named by
``diloco.exchange`` (the registry: :data:`node.live.exchange.registry.EXCHANGES`): the
full exchange (:mod:`node.live.exchange.full`: every holder fetches every closed
contribution and aggregates it) and the sliced exchange (:mod:`node.live.exchange.sliced`:
aggregators of one slice each, partials in). The node never asks which kind it holds.

Each exchange owns a :class:`ContributionPool`: fetching the contributions a
node aggregates, background, verified, deduplicated.

A fetch starts as soon as an announce for a held stage arrives, so round t's
contributions travel while round t+1 trains (the one-step-delay overlap of
arXiv 2506.21263). Every fetched envelope is checked against its announcement
(signature, run, round, stage, replica, sender) and its payload must decode
for the stage (``check_payload``) before it counts as *here*; only then is it
served onward to peers. A contribution that fails is *rejected*: the reason is
logged once, the signed envelope kept under ``evidence/`` as proof, and the
round goes on without it.

A *lazy* pool (the sliced exchange, docs/PROTOCOL.md "Sliced exchange") fetches
announced contributions only for the rounds and stages this node may close
(:meth:`ContributionPool.want`): there a holder needs none of the closed
envelopes, only the partials, so fetching every member's envelope would be the
one per-member cost left in its traffic.

Only a contribution's sender announces it on the DHT, and in the background: a fetcher asks
the sender, then the close's coordinator, then every live peer (all of them fetched it), so
the DHT is for auditors and for peers that arrive later. Every holder re-announcing every
copy it fetched cost each node (R - 1) DHT announcements a round, each a lookup with a
stream to up to 20 peers, each held on a fetch thread for up to 30 s: at 16 nodes on 2 cores
that starved the blob fetches themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from queue import Queue

from node import protocol as msg
from node.errors import NodeError
from node.exchangekinds import EXCHANGE_TRAITS
from node.live.state.base import NodeBase
from node.live.exchange.pool import ContributionPool
from node.live.peers.membership import Membership
from node.live.state.roundstate import StageInputs
from p2p.host import P2PHost

logger = logging.getLogger(__name__)


class InputsWithheld(NodeError):
    """What a close names never came within every candidate's turn (the sliced exchange's partials):
    the holders refuse that close and take the next coordinator's (docs/PROTOCOL.md, "Sliced exchange")."""


class Exchange:
    """One kind of exchange of a round's contributions (see module docstring).

    Built before this node is placed (the gossip inbox and the coordinator need its pool);
    the worker it decodes and aggregates with is the station's once placed. A kind says,
    by its class attributes, what the rest of the node must know of it.
    """

    #: The kind's facts the offline tools read too (node/exchangekinds.py): whether the pool fetches
    #: announced contributions only for the rounds and stages this node may close, whether a holder holds
    #: every closed envelope of the stages it aggregates (what the archive seals).
    traits = EXCHANGE_TRAITS["full"]
    lazy_pool = traits.lazy_pool
    holds_all_envelopes = traits.holds_all_envelopes
    #: Its contributions can be re-executed by the spot checks (docs/PROTOCOL.md, "Spot checks").
    reexecutable = True
    #: A coordinator closes only with contributions whose inputs it holds besides the envelope
    #: (:meth:`close_inputs_held`): the sliced exchange's bundles, served on to the aggregators.
    holds_inputs_to_close = False

    def __init__(self, base: NodeBase, *, messenger, host: P2PHost, membership: Membership,
                 charges: Queue | None = None, binder=None) -> None:
        """``charges``: where the accusations it raises go (the spot checker opens them); ``binder``: a
        version-3 run's :class:`node.live.fraud.contribution_binding.ContributionBinder` (every fetched
        contribution must carry its sender's binding), else None."""
        book, run_id, p2p, incoming, stop = base.book, base.run_id, base.cfg.p2p, base.incoming_dir, base.stop
        evidence_dir = base.evidence_dir
        self.station = base.station
        self.binder = binder
        self.book = base.book
        #: Accusations this exchange raises, (round, accused peer, replica, build(account) -> Evidence),
        #: opened on chain by the spot checker (node.live.checks.verifier.SpotChecker.charge).
        self.charges = charges
        self.messenger = messenger  # node.live.peers.messenger.Messenger
        self.host = host
        self.archive = base.archive
        self.run_id = run_id
        self.max_blob_bytes = p2p.max_blob_bytes
        self.turn_timeout = p2p.transfer_timeout
        self.incoming = incoming
        self.evidence_dir = evidence_dir
        self.stop = stop
        #: The parts of this run's contributions (node.live.exchange.parts) where the kind moves them so.
        self.parts = None
        self.pool = ContributionPool(host, book, run_id, incoming, p2p.max_blob_bytes, p2p.transfer_timeout,
                                     p2p.blob_concurrency, check_payload=self.check_payload,
                                     envelope_fetch=self._fetch_in_parts,
                                     evidence_dir=evidence_dir, lazy=self.lazy_pool,
                                     fallback_providers=membership.live_providers,
                                     inputs_held=self.close_inputs_held if self.holds_inputs_to_close
                                     else None,
                                     stop=stop)

    def check_payload(self, stage: int, outer_round: int, payload: bytes, sender: str | None = None) -> None:
        """Raise (a ValueError or ProtocolError) unless a fetched contribution's payload fits the stage and,
        in a version-3 run, carries the binding of ``sender`` (its peer id; ContributionUnbound)."""
        body = msg.decode_contribution_body(payload)
        self.check_blob(stage, outer_round, body.blob)
        if self.binder is not None:
            peer = self.book.live_peers(float("inf")).get(sender) if sender else None
            self.binder.check(outer_round, stage, body, self.station.worker().stage_shapes(stage),
                              peer.hello.account if peer is not None else None)

    def sign_contribution(self, outer_round: int, stage: int, body: bytes, blob: bytes) -> bytes:
        """The signed envelope of this node's contribution ``body`` (its codec blob ``blob``): version 2 where
        the run moves contributions in parts, else version 1."""
        if self.parts is not None:
            return self.parts.sign(outer_round, stage, body, blob)
        return self.messenger.sign(outer_round, msg.CONTRIBUTION, body, stage)

    def announced(self, outer_round: int, stage: int, digest: bytes, envelope: bytes) -> None:
        """This node's contribution ``envelope`` is about to be announced: a parts run announces its parts
        first, so that a holder knows them when the announce starts its fetch."""
        if self.parts is not None:
            self.parts.announce(outer_round, stage, digest, envelope)

    def _fetch_in_parts(self, outer_round: int, stage: int, a, providers: list[str],
                        fallback: list[str]) -> bytes | None:
        if self.parts is None:
            return None
        return self.parts.fetch(outer_round, stage, a, providers, fallback)

    def gossip_handlers(self) -> dict[str, Callable]:
        """Run-topic message kinds this exchange handles (kind -> handler(envelope, message, bytes))."""
        return {}

    # -- what a kind implements ------------------------------------------------------
    def check_blob(self, stage: int, outer_round: int, blob: bytes) -> None:
        """Raise unless ``blob`` (a contribution body's) fits the stage's plan or codec."""
        raise NotImplementedError

    def contribution_blob(self, outer_round: int, stage: int, blob: bytes) -> bytes:
        """What this node's contribution envelope of (round, stage) carries, given the encoded ``blob``."""
        raise NotImplementedError

    def gather(self, outer_round: int, stage: int, close: msg.Close, waited: dict[str, float],
               prepare: bool) -> StageInputs:
        """What the apply of the close needs, fetched (and with ``prepare``, aggregated) now; adds to
        ``waited``."""
        raise NotImplementedError

    def apply(self, outer_round: int, stage: int, inputs: StageInputs):
        """(the stage's RoundResult after the outer step, the closed envelopes this node holds or None each).

        Raises :class:`InputsWithheld` when what the close names never came (the caller refuses the close
        and takes the next coordinator's)."""
        raise NotImplementedError

    def evidence_judges(self, close_standing: Callable) -> dict[str, Callable]:
        """Evidence kinds (``Evidence.verdict``) this exchange judges: verdict -> judge(evidence, accused
        peer) -> (guilty, or None where it cannot judge; why). ``close_standing``: the round coordinator's
        rule whether a close stands
        (:meth:`node.live.exchange.coordination.RoundCoordinator.close_standing`)."""
        return {}

    def rerun_inputs(self):
        """What a re-execution spot check reads besides the full exchange's
        (:class:`node.live.checks.verifier.SpotChecker`): an object with ``claims(round, envelopes)`` and
        ``previous(round)``; None: the contributions' own payloads and round t-1's closed contributions (the
        full exchange)."""
        return None

    def close_inputs_held(self, outer_round: int, stage: int, digest: bytes, envelope: bytes) -> bool:
        """Whether this node, as coordinator, holds every input of the checked envelope ``digest`` besides
        the envelope (used only where :attr:`holds_inputs_to_close`)."""
        return True

    # -- lifecycle -------------------------------------------------------------------
    def forget_before(self, outer_round: int) -> None:
        self.pool.forget_before(outer_round)
        if self.parts is not None:
            self.parts.forget_before(outer_round)

    def close(self) -> None:
        self.pool.close()
