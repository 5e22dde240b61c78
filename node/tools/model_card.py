"""What ``dlx-node pull`` adds to an exported model directory: a model card and a generation config.

``README.md`` follows the Hugging Face model card convention (YAML front matter, then Markdown) and
carries the provenance an agent developer needs to trust or re-check the weights: chain id, ledger,
run, round, weights root, checkpoint content hash, the members whose signatures committed the round,
and the commands that audit the run and pull the same checkpoint again.

``generation_config.json`` pins the special token ids (the tokenizer's end of text; byte 0 for the byte
tokenizer) and ``max_length`` to the model's context (``dlx_context``): GPT-2 has one learned position
embedding per position, and its export's table goes on to 1024 positions with copies of the last trained
row (training/export.py; a sequence longer than the table would index past it, ``IndexError`` in ``wpe``);
Llama's rotary positions have no table, but it never trained beyond its context. With this file
``generate()`` called without a length stops at the context. An explicit ``max_new_tokens`` still takes
precedence in transformers (``GenerationMixin._prepare_generated_length``), and beside the file's
``max_length`` it makes transformers warn that both are set: the card's and pull's snippets pass
``max_length`` (prompt + new tokens within the context), and ``custom_generate/generate.py`` (loaded only with
``trust_remote_code=True``) offers nanoGPT's sliding window for longer generations.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

END_OF_TEXT_ID = 0  # training.export: byte 0 stands in for <|endoftext|> with the byte tokenizer
BYTE_TOKENIZER = "byte-level tokenizer, token id = byte value"

#: A sliding-window generate (nanoGPT's ``idx[:, -block_size:]``), as transformers' custom_generate hook
#: wants it: ``generate(model, input_ids, ...)``. Written by dlx-node, not by a peer; runs only with
#: ``trust_remote_code=True``.
SLIDING_GENERATE = '''"""Greedy or sampled generation that never feeds the model more than its context (written by dlx-node pull).

Load with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True) and call model.generate as
usual: every step feeds only the last dlx_context (the context trained; else n_positions, max_position_embeddings)
tokens, so any max_new_tokens works.
"""

import torch


def generate(model, input_ids=None, max_new_tokens=20, do_sample=False, temperature=1.0, top_k=None,
             attention_mask=None, **kwargs):
    context = (getattr(model.config, "dlx_context", None) or getattr(model.config, "n_positions", None)
               or model.config.max_position_embeddings)
    if input_ids is None:
        input_ids = torch.full((1, 1), model.config.bos_token_id, dtype=torch.long, device=model.device)
    ids = input_ids
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = ids[:, -context:]
            logits = model(window, use_cache=False).logits[:, -1, :]
            if do_sample:
                logits = logits / max(temperature, 1e-6)
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1, None]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                token = torch.multinomial(torch.softmax(logits, dim=-1), 1)
            else:
                token = logits.argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
    return ids
'''  # noqa: E501 - written byte for byte into the pulled model's directory


def generation_config(block_size: int, special_token_id: int = END_OF_TEXT_ID) -> dict[str, Any]:
    """``generation_config.json``: the tokenizer's end-of-text id and the context as ``max_length``."""
    return {
        "bos_token_id": special_token_id,
        "eos_token_id": special_token_id,
        "pad_token_id": special_token_id,
        "max_length": block_size,
        "do_sample": False,
    }


_FAMILY_NAMES = {"gpt2": "GPT-2-shaped", "llama": "Llama-architecture (RMSNorm, rotary positions, SwiGLU, "
                 "grouped-query attention)"}


def _context_note(family: str, block: int) -> str:
    if family == "gpt2":
        from training.gpt2 import HF_POSITIONS

        limit = (
            f"The model learned one position embedding per position, {block} in all; its table goes on to "
            f"{max(block, HF_POSITIONS)} positions (as GPT-2's), the rows past {block} copies of the last "
            f"trained one, so `generate()` runs past the context, but what it writes there is untrained.")
    else:
        limit = (f"The model was trained on windows of {block} tokens; its rotary positions go further, but "
                 "what it writes beyond them is untrained.")
    return (
        f"{limit} `generation_config.json` makes `generate()` without a length stop at {block} tokens "
        "(prompt and new tokens); pass `max_length` for fewer (`max_new_tokens` beside the file's "
        "`max_length` makes transformers warn that both are set). For longer text, load with "
        "`trust_remote_code=True`: `custom_generate/generate.py` (written by dlx-node, nanoGPT's sliding "
        f"window) then feeds the model only the last {block} tokens at every step.")


def model_card(provenance: dict[str, Any], model: dict[str, Any], rpc_url: str = "",
               peers: list[str] = ()) -> str:
    """The README.md of a pulled model directory (Hugging Face model card: YAML front matter + Markdown)."""
    return "\n".join(_front_matter(provenance, model) + [""] + _card_body(provenance, model, rpc_url, peers))


def _front_matter(p: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """The card's YAML front matter: Hugging Face's fields and the provenance under ``dlx``."""
    attesters = p.get("attesters") or []
    family = model.get("family", "gpt2")
    front = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        f"- {family}",
        "- dlx-node",
        "- diloco",
        "- decentralized-training",
        "dlx:",
        f"  chain_id: {p['chain_id']}",
        f"  ledger: \"{p['ledger']}\"",
        f"  registry: \"{p['registry']}\"",
        f"  run_id: {p['run_id']}",
        f"  round: {p['round']}",
        f"  weights_root: \"{p['weights_root']}\"",
        f"  content_hash: \"{p['content_hash']}\"",
        f"  config_hash: \"{p['config_hash']}\"",
        "  attesters:",
        *[f"  - \"{a}\"" for a in attesters],
        "---",
    ]
    if not attesters:
        front[front.index("  attesters:")] = "  attesters: []"
    return front


def _card_body(p: dict[str, Any], model: dict[str, Any], rpc_url: str, peers: list[str]) -> list[str]:
    """The card's Markdown: what the model is, its provenance table, how to re-check it and use it."""
    rpc = rpc_url or "<chain RPC URL>"
    peer_args = " ".join(f"--bootstrap {peer}" for peer in peers) \
        or "--bootstrap <multiaddr of a node of the run>"
    attesters = p.get("attesters") or []
    block = model["block_size"]
    family = model.get("family", "gpt2")
    table = [
        ("chain id", p["chain_id"]), ("TrainingLedger", p["ledger"]), ("NodeRegistry", p["registry"]),
        ("run", p["run_id"]), ("round", p["round"]),
        ("weights root (record's weightsRoot)", p["weights_root"]),
        ("checkpoint content hash (sha256 of the checkpoint file, record's checkpointHash)",
         p["content_hash"]), ("run document hash (configHash)", p["config_hash"]),
        ("members whose signatures committed the round", ", ".join(attesters) or "-"),
        ("commit transaction", p.get("commit_tx") or "-"),
    ]
    body = [
        f"# dlx-node run {p['run_id']}, round {p['round']}",
        "",
        f"A {_FAMILY_NAMES.get(family, family)} language model ({model['params']:,} parameters: "
        f"{model['n_layer']} layers, {model['n_embd']} wide, {model['n_head']} heads"
        + (f" / {model['n_kv_head']} key-value heads" if "n_kv_head" in model else "")
        + f"; context {block} tokens; {model.get('tokenizer', BYTE_TOKENIZER)}) trained with DiLoCoX by the "
        "members of a dlx-node run. `dlx-node pull` "
        "downloaded the checkpoint that the round's on-chain record publishes, and wrote this directory only "
        "after checking that the file hashes to the record's checkpoint hash and its weights to the record's "
        "weights root, and that the record was signed by the run's quorum of staked "
        "members and not disputed.",
        "",
        "## Provenance",
        "",
        "| | |",
        "|---|---|",
        *[f"| {name} | `{value}` |" for name, value in table],
        "",
        "## Check it yourself",
        "",
        "Audit the whole run (every round's signatures, contributions and a bit-exact replay of the "
        "aggregation; docs/AUDIT.md), and pull the same checkpoint again:",
        "",
        "```bash",
        f"dlx-node audit --rpc {rpc} --run {p['run_id']} --ledger {p['ledger']} --registry {p['registry']} "
        f"{peer_args}",
        f"dlx-node pull --rpc {rpc} --run {p['run_id']} --ledger {p['ledger']} --registry {p['registry']} "
        f"--round {p['round']} {peer_args} ./model",
        "```",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("./model")',
        'tok = AutoTokenizer.from_pretrained("./model")',
        'ids = tok("To be", return_tensors="pt")',
        f"out = model.generate(**ids, max_length={block})  # prompt + new tokens <= {block}",
        "print(tok.decode(out[0]))",
        "```",
        "",
        _context_note(family, block),
        "",
        "## Limitations",
        "",
        "A small research model trained on a small corpus for few rounds: expect fluent-looking bytes, not "
        "facts. The held-out loss of every round is in the run's on-chain records.",
        "",
    ]
    return body


def write_model_extras(out: Path, provenance: dict[str, Any], model: dict[str, Any], rpc_url: str = "",
                       peers: list[str] = ()) -> None:
    """Write README.md, generation_config.json and custom_generate/ into the export directory ``out``
    (before it is moved into place), and give every file mode 0644, directories 0755."""
    (out / "README.md").write_text(model_card(provenance, model, rpc_url, peers), encoding="utf-8")
    special = model.get("special_token_id", END_OF_TEXT_ID)
    if not (out / "generation_config.json").exists():  # an imported model's own is kept
        (out / "generation_config.json").write_text(
            json.dumps(generation_config(model["block_size"], special), indent=2) + "\n")
    (out / "custom_generate").mkdir(exist_ok=True)
    (out / "custom_generate" / "generate.py").write_text(SLIDING_GENERATE)
    for path in [out, *out.rglob("*")]:
        # safetensors writes its file 0600; a model directory is meant to be read by others.
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
