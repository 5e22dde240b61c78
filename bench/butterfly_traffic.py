"""The per-node traffic of one round in bench/bench_butterfly.py's simulation: today's all-to-all exchange and
the sliced one, with real signed envelopes and real codec bytes (its docstring says what is materialized and
what is modelled)."""

from __future__ import annotations

import dataclasses
import time

import torch

from node.protocol import NO_APPLY, ContributionBody, encode_contribution_body
from p2p.envelope import Envelope
from p2p.identity import Identity, verify_signature
from training.butterfly import _encode, aggregate_slice, encode_slices, guided_slice_budgets
from training.slice_plan import aggregator_of, plan_slices, split_slices
from training.slicemessages import (
    check_partial,
    inputs_root,
    parse_partial,
    parse_slice_message,
    partial_payload,
    slice_message,
    slice_signing_bytes,
)

RUN_ID = 7


def identity(index: int) -> Identity:
    return Identity.from_seed(index.to_bytes(4, "big") * 8)


def perturbed(base: dict[str, torch.Tensor], replica: int) -> dict[str, torch.Tensor]:
    """``base * (1 + 0.01 * noise)``, noise a fixed Gaussian of ``replica`` (keeps the low-rank shape)."""
    generator = torch.Generator().manual_seed(1000 + replica)
    return {
        name: value * (1 + 0.01 * torch.randn(value.shape, generator=generator))
            for name, value in base.items()
    }


# ----------------------------------------------------------------------------- traffic of one node


@dataclasses.dataclass
class NodeTraffic:
    """Bytes and messages of one node (one replica's copy of one stage) in one round."""

    scheme: str
    replicas: int
    slices: int
    bytes_in: int
    bytes_out: int
    messages_in: int
    messages_out: int
    materialized: int  # envelopes built from real codec bytes (the rest repeat their measured sizes)
    aggregator: bool = False


def todays_traffic(pseudo_gradients, replicas: int, cfg, budget: int, stage_index: int, outer_round: int,
                   materialize: int) -> NodeTraffic:
    """All-to-all: the node fetches R-1 contribution envelopes and serves its own R-1 times."""
    sizes = []
    for replica in range(min(replicas, materialize)):
        target = perturbed(pseudo_gradients[replica % len(pseudo_gradients)], replica)
        blob, _, _ = _encode_whole(target, cfg, budget, stage_index, outer_round)
        # The node's own body (docs/PROTOCOL.md ContributionBody:
        # prefix, state hash, data commitment, applied hash).
        body = encode_contribution_body(ContributionBody(bytes(32), bytes(32), blob, NO_APPLY))
        envelope = Envelope.create(identity(replica), RUN_ID, outer_round, "contribution", body, stage_index,
                                   replica)
        sizes.append(len(envelope.to_bytes()))
    mean = sum(sizes[1:]) / max(len(sizes) - 1, 1) if len(sizes) > 1 else sizes[0]
    bytes_in = sum(sizes[1:]) + round(mean * (replicas - len(sizes)))
    return NodeTraffic("all_to_all", replicas, 1, bytes_in, sizes[0] * (replicas - 1), replicas - 1,
                       replicas - 1, len(sizes))


def _encode_whole(target, cfg, budget, stage_index, outer_round):
    from training.compression import encode_within_bandwidth

    return encode_within_bandwidth(target, cfg, budget, stage_index=stage_index, outer_round=outer_round)


def signed_slice_message(replica: int, outer_round: int, stage_index: int, slice_index: int, count: int,
                         blob: bytes) -> bytes:
    signing = slice_signing_bytes(RUN_ID, outer_round, stage_index, replica, slice_index, count, blob)
    return slice_message(slice_index, count, identity(replica).sign(signing), blob)


def sliced_traffic(pseudo_gradients, replicas: int, cfg, budget: int, stage_index: int, outer_round: int, *,
                   shapes, min_slice_numel: int, norm_clip: float, node: int = 0,
                   audit: bool = False) -> tuple[NodeTraffic, dict]:
    """The sliced exchange seen by replica ``node``: what it sends, aggregates, serves and fetches."""
    plan = plan_slices(shapes, replicas, min_slice_numel=min_slice_numel)
    count = plan.num_slices
    own_slice = next((j for j in range(count) if aggregator_of(j, outer_round, replicas) == node), None)
    # The node's own A signed slice messages, one to each aggregator.
    own_target = perturbed(pseudo_gradients[node % len(pseudo_gradients)], node)
    own_blobs, _, _ = encode_slices(own_target, plan, cfg, budget, stage_index=stage_index,
                                    outer_round=outer_round)
    bytes_out = messages_out = 0
    for j in range(count):
        if j != own_slice:
            bytes_out += len(signed_slice_message(node, outer_round, stage_index, j, count, own_blobs[j]))
            messages_out += 1
    bytes_in = messages_in = 0
    extra: dict = {}
    base_targets = [perturbed(g, k) for k, g in enumerate(pseudo_gradients)]
    base_budgets = [guided_slice_budgets(target, plan, cfg, budget) for target in base_targets]
    if own_slice is not None:
        # Every replica's slice own_slice (materialized: R codings
        # of one slice), signature checked as the node would.
        inputs = []
        verify_seconds = 0.0
        for replica in range(replicas):
            if replica == node:
                inputs.append(own_blobs[own_slice])
                continue
            target = perturbed(pseudo_gradients[replica % len(pseudo_gradients)], replica)
            # Its budget: the guided one of its base replica (a 1% perturbation barely moves the allocation;
            # computing it per replica would cost R whole-stage codings).
            part = split_slices(target, plan)[own_slice]
            blob = _encode(part, cfg, base_budgets[replica % len(pseudo_gradients)][own_slice], stage_index,
                           outer_round)[0]
            message = signed_slice_message(replica, outer_round, stage_index, own_slice, count, blob)
            t0 = time.perf_counter()
            signature, received = parse_slice_message(message, own_slice, count)
            signing = slice_signing_bytes(RUN_ID, outer_round, stage_index, replica, own_slice, count,
                                          received)
            assert verify_signature(identity(replica).public_key_bytes, signing, signature)
            verify_seconds += time.perf_counter() - t0
            bytes_in += len(message)
            inputs.append(received)
        messages_in += replicas - 1
        started = time.perf_counter()
        result = aggregate_slice(inputs, plan, own_slice, cfg, budget, norm_clip=norm_clip,
                                 stage_index=stage_index, outer_round=outer_round)
        aggregate_seconds = time.perf_counter() - started
        payload = partial_payload(own_slice, count, inputs_root(inputs), replicas, result.partial)
        partial = Envelope.create(identity(node), RUN_ID, outer_round, "partial", payload, stage_index, node)
        bytes_out += len(partial.to_bytes()) * (replicas - 1)
        messages_out += replicas - 1
        extra.update(aggregate_seconds=aggregate_seconds, verify_seconds=verify_seconds,
                     partial_bytes=len(result.partial), partial_envelope_bytes=len(partial.to_bytes()),
                     slice_input_bytes=sum(map(len, inputs)), accepted=len(result.accepted))
        if audit:
            started = time.perf_counter()
            reason = check_partial(parse_partial(partial.payload), inputs, plan, cfg, budget,
                                   norm_clip=norm_clip, stage_index=stage_index, outer_round=outer_round)
            extra.update(audit_seconds=time.perf_counter() - started, audit_ok=reason == "")
    # The other partials (modelled: coded from the K base replicas' slices, the same rule and budget rule as a
    # real one; a partial's size follows its inputs' sizes, not R).
    base_blobs = [encode_slices(target, plan, cfg, budget, stage_index=stage_index,
                                outer_round=outer_round)[0]
                  for target in base_targets]
    for j in range(count):
        if j == own_slice:
            continue
        result = aggregate_slice([blobs[j] for blobs in base_blobs], plan, j, cfg, budget,
                                 norm_clip=norm_clip, stage_index=stage_index, outer_round=outer_round)
        payload = partial_payload(j, count, bytes(32), replicas, result.partial)
        aggregator = aggregator_of(j, outer_round, replicas)
        envelope = Envelope.create(identity(aggregator), RUN_ID, outer_round, "partial", payload, stage_index,
                                   aggregator)
        bytes_in += len(envelope.to_bytes())
        messages_in += 1
    traffic = NodeTraffic("sliced", replicas, count, bytes_in, bytes_out, messages_in, messages_out,
                          replicas if own_slice is not None else 1, aggregator=own_slice is not None)
    return traffic, extra
