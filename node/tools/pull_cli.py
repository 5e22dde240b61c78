"""The dlx-node pull command: the verified checkpoint of a round, written as a model directory."""

from __future__ import annotations

from typing import Any

from node.tools.evidence import LazyPeerFetcher, reader_client
from node.tools.pull import pull_checkpoint


def run_pull(args: Any) -> int:
    """``dlx-node pull``: exit 0 with the model written, 9 if the round or the bytes were refused."""
    client = reader_client(args)
    fetcher = LazyPeerFetcher(args.bootstrap) if args.bootstrap else None  # dialed only if needed
    try:
        result = pull_checkpoint(
            client,
            args.run,
            args.out_dir,
            None if args.round < 0 else args.round,
            archives=args.archive,
            fetcher=fetcher,
            rpc_url=getattr(args, "rpc", ""),  # for the model card; a library caller may have none
            peers=args.bootstrap,
            final_only=not getattr(args, "pending", False),
        )
    finally:
        if fetcher is not None:
            fetcher.close()
    out = str(result.out_dir)
    for reason in result.skipped:
        print(f"passed over {reason}")
    print(
        f"verified checkpoint of run {result.run_id} round {result.round} ("
        + (f"sha256 {result.content_hash}, " if result.file_sha256 in ("", result.content_hash) else
           f"checkpointHash {result.content_hash} (its header's), file sha256 {result.file_sha256}, ")
        + f"{result.size} bytes, from {result.source}) -> {out}"
    )
    for round_index, how in sorted(result.cleared.items()):
        print(f"disputed round {round_index} cleared: {how}")
    if result.final:
        print(f"round {result.round} is final (the chain's isFinal; its proof window closed at block "
              f"{result.final_from})")
    else:
        print(f"round {result.round} is NOT final (--pending): the chain's isFinal is false (its proof "
              f"window closes at block {result.final_from}, a challenge may extend it)")
    print(f"round {result.round} (block {result.commit_block}) attested by {len(result.attesters)}:")
    for attester in result.attesters:
        joined = result.members_since.get(attester, -1)
        tenure = (f"member since block {joined}, {result.commit_block - joined} blocks before the commit"
                  if joined >= 0 else "membership not found")
        print(f"  {attester} ({tenure})")
    print(
        'from transformers import AutoModelForCausalLM, AutoTokenizer; tok = '
        f'AutoTokenizer.from_pretrained("{out}"); model = AutoModelForCausalLM.from_pretrained("{out}")'
    )
    print(f"model card with the provenance and the audit command: {out}/README.md")
    # prompt + new tokens must fit the context: max_length (generation_config.json sets it to the context, so
    # max_new_tokens beside it makes transformers warn that both are set)
    length = max(8, min(48, result.block_size))
    print(
        f'print(tok.decode(model.generate(**tok("To be", return_tensors="pt"), max_length={length}, '
        "do_sample=False)[0]))"
    )
    return 0
