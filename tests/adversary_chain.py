"""tests/adversary.py's attacks of the heartbeat, the finisher and the committer: an absurd hello, doctored
checkpoint shards and momentum, and a coalition's takeover of the quorum. Each function returns the part
classes of its attack (keyword arguments of node.live.assembly.Kinds)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

logger = logging.getLogger("adversary")


# ---------------------------------------------------------------------- the heartbeat and the finisher
def absurd_hello():
    from node.live.peers.heartbeat import Heartbeat

    class AbsurdHeartbeat(Heartbeat):
        def hello(self):
            return dataclasses.replace(super().hello(), training_round=10**12)

    return {"heartbeat": AbsurdHeartbeat}


def doctored_shard():
    from node.live.exchange.pool import serve_blob
    from node.live.round.finisher import RoundFinisher
    from node.store.checkpoint import Checkpoint, write_checkpoint

    class DoctoringFinisher(RoundFinisher):
        def write_shard(self, outer_round, stage, weights_hash):
            weights, momentum = self.worker.global_state(stage)
            doctored = {name: tensor + 0.01 for name, tensor in weights.items()}
            model_config = {**self.layout.model_config, "n_head": 8}
            shard = Checkpoint(self.run_id, outer_round, model_config, self.config_hash,
                               {stage: weights_hash}, doctored, momentum)
            path = self.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"
            digest = write_checkpoint(path, shard)
            serve_blob(self.host, path.read_bytes())
            logger.warning("adversary: doctored shard %s of round %d stage %d", digest.hex()[:12],
                           outer_round, stage)
            return digest

    return {"finisher": DoctoringFinisher}


def other_momentum():
    from node.live.exchange.pool import serve_blob
    from node.live.round.finisher import RoundFinisher
    from node.store.checkpoint import Checkpoint, write_checkpoint

    class OtherMomentumFinisher(RoundFinisher):
        def write_shard(self, outer_round, stage, weights_hash):
            weights, momentum = self.worker.global_state(stage)
            other = {name: tensor + 0.01 for name, tensor in momentum.items()}
            shard = Checkpoint(self.run_id, outer_round, dict(self.layout.model_config), self.config_hash,
                               {stage: weights_hash}, weights, other)
            path = self.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"
            digest = write_checkpoint(path, shard)
            serve_blob(self.host, path.read_bytes())
            logger.warning("adversary: shard %s of round %d stage %d serves other momentum",
                           digest.hex()[:12], outer_round, stage)
            return digest

    return {"finisher": OtherMomentumFinisher}


def takeover():
    """A coalition member (issue 41, attack 1): it wins every commit race with the fewest honest signatures
    the quorum needs, then tries to eject the honest members it left out, to commit a back door with its
    partners' signatures (shared through ``DLX_COALITION_DIR``) and to slash an honest member by a verdict of
    its own.
    ``DLX_COALITION``: the coalition's addresses, comma-separated."""
    import hashlib
    import os

    from ledger import errors
    from ledger.attest import recover_digest_signer
    from ledger.records import RoundRecord, Verdict
    from node.live.record.committer import Committer

    coalition = {a.strip().lower() for a in os.environ["DLX_COALITION"].split(",")}
    shared = Path(os.environ["DLX_COALITION_DIR"])

    def partners_signatures(name: str, own: bytes) -> list[bytes]:
        (shared / f"{name}-{own.hex()[:16]}.sig").write_bytes(own)
        return [p.read_bytes() for p in sorted(shared.glob(f"{name}-*.sig"))]

    class TakeoverCommitter(Committer):
        def _submit(self, outer_round, mine, found, quorum):
            node = self.node
            client = node.chain.client
            record, signatures = found
            digest = client.record_digest(record)
            ours = [s for s in signatures if recover_digest_signer(digest, s).lower() in coalition]
            honest = [s for s in signatures if recover_digest_signer(digest, s).lower() not in coalition]
            chosen = ours + honest[:max(0, quorum - len(ours))]
            if node.chain.commit_of(node.run_id, outer_round) is None:
                try:  # no waiting for its turn: it wins the race
                    node.chain.commit_round(record, chosen)
                    logger.warning("adversary: committed round %d with %d of %d honest signatures",
                                   outer_round, len(chosen) - len(ours), len(honest))
                except errors.LedgerError as exc:
                    logger.warning("adversary: commit of round %d lost: %s", outer_round, exc)
            self._take_over(client)
            return node.chain.commit_of(node.run_id, outer_round) is not None

        def _take_over(self, client):
            run_id = self.node.run_id
            history = client.history(run_id, with_registrations=False)
            honest = sorted(m.account for m in history.memberships
                            if m.account.lower() not in coalition and m.ended is None)
            for account in honest:
                try:
                    client.eject_inactive(run_id, account)
                    logger.warning("adversary: ejected %s", account)
                except errors.LedgerError as exc:
                    logger.warning("adversary: eject refused: %s", exc)
            count, head = client.commit_count(run_id), client.head_of(run_id)
            door = RoundRecord(run_id, count, head, hashlib.sha256(b"back door %d" % count).digest(),
                               hashlib.sha256(b"back door contributions").digest(), 1, 1, 1, 1, bytes(32))
            signatures = partners_signatures(f"door-{count}-{head.hex()[:16]}", client.sign_record(door))
            try:
                client.commit_round(door, signatures)
                logger.warning("adversary: committed a back door at round %d", count)
            except errors.LedgerError as exc:
                logger.warning("adversary: back door refused: %s", exc)
            if not honest:
                return
            evidence = hashlib.sha256(b"framed").digest()
            try:
                client.accuse(run_id, honest[0], evidence)
            except errors.LedgerError:
                pass  # a partner accused first, or already did
            verdict = Verdict(run_id, honest[0], evidence, True)
            signatures = partners_signatures("verdict", client.sign_verdict(verdict))
            try:
                client.resolve_accusation(verdict, signatures)
                logger.warning("adversary: slashed %s", honest[0])
            except errors.LedgerError as exc:
                logger.warning("adversary: verdict refused: %s", exc)

    return {"committer": TakeoverCommitter}
