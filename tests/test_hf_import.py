"""Start from a Hugging Face model directory (training/hf_import.py), no hub: transformers builds small random
models of each supported family locally; the imported model's logits equal transformers' (float32, within
1e-5), and the export writes the source's class back with equal logits; anything else is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training.config import ModelConfig
from training.data import generated_text
from training.errors import ExportError
from training.export import export_hf
from training.hf_import import HFImportError, import_hf, load_init_weights, read_source
from training.model import GPT, init_state_dict
from training.tokenizer import load_tokenizer, train_bpe

transformers = pytest.importorskip("transformers")
VOCAB = 320


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_bytes(train_bpe(iter([generated_text(seed=3, n_bytes=20_000)]), 300))
    return path


def _family(name: str):
    """(config, model class) of a small random model of ``name``."""
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "llama":  # GQA, Llama 3's rope scaling (every band hit: head size 8), untied head
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 0.5,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return transformers.LlamaConfig(**small, rope_parameters=rope, tie_word_embeddings=False), \
            transformers.LlamaForCausalLM
    if name == "llama-tied":
        return transformers.LlamaConfig(**small, tie_word_embeddings=True, rms_norm_eps=1e-6), \
            transformers.LlamaForCausalLM
    if name == "qwen2":  # q/k/v biases, tied head, eps 1e-6, rope theta 1e6
        return transformers.Qwen2Config(**small, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), \
            transformers.Qwen2ForCausalLM
    if name == "mistral":  # a window as long as the context: supported
        return transformers.MistralConfig(**small, sliding_window=64, tie_word_embeddings=False), \
            transformers.MistralForCausalLM
    if name == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=48,
                                       tie_word_embeddings=True), transformers.GPT2LMHeadModel
    raise AssertionError(name)


def _source(name: str, directory: Path, tokenizer_file: Path, shard: bool = False) -> torch.nn.Module:
    config, cls = _family(name)
    torch.manual_seed(5)
    model = cls(config).eval()
    with torch.no_grad():  # random biases and norms, so that a dropped or swapped one shows
        for pname, param in model.named_parameters():
            if pname.endswith("bias") or param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "5GB")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return model


CASES = [("llama", "LlamaForCausalLM"), ("llama-tied", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
         ("mistral", "MistralForCausalLM"), ("gpt2", "GPT2LMHeadModel")]


@pytest.mark.parametrize(("name", "arch"), CASES)
def test_imported_logits_equal_transformers_and_export_writes_the_source_class(name, arch, tmp_path,
                                                                               tokenizer_file):
    source = _source(name, tmp_path / "src", tokenizer_file, shard=name == "llama")
    imported = import_hf(tmp_path / "src", tmp_path / "initial")
    cfg = ModelConfig(**imported.fields)
    assert imported.architecture == arch and cfg.init_weights == str(imported.weights)
    ours = GPT(cfg, seed=None).eval()
    ours.load_state_dict(init_state_dict(cfg, seed=123))  # the seed draws nothing: the imported weights
    ids = torch.randint(0, VOCAB, (2, min(cfg.block_size, 40)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = source(ids).logits
        got, _ = ours(ids)
    assert want.abs().max() > 0.01 and (got - want).abs().max() <= 1e-5
    # back into the source's class, without trust_remote_code, its logits ours
    out = export_hf(ours.state_dict(), cfg, tmp_path / "out", tokenizer=load_tokenizer(cfg.tokenizer))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == arch == json.loads((out / "config.json").read_text())["architectures"][0]
    with torch.no_grad():
        assert (back(ids).logits - got).abs().max() <= 1e-5
    assert (out / "generation_config.json").is_file() and (out / "tokenizer_config.json").is_file()
    text = "the quick brown fox"
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == \
        list(load_tokenizer(cfg.tokenizer).encode(text))


def test_the_run_document_of_a_random_model_is_unchanged():
    for preset in ("tiny", "llama-tiny", "llama-mini"):
        doc = ModelConfig(preset=preset).document()
        assert not {"attention_bias", "rms_norm_eps", "rope_scaling", "init_weights", "hf_source"} & set(doc)


def test_tied_head_starts_as_the_embedding_and_qwen_keeps_its_biases(tmp_path, tokenizer_file):
    _source("qwen2", tmp_path / "src", tokenizer_file)
    cfg = ModelConfig(**import_hf(tmp_path / "src", tmp_path / "initial").fields)
    state = load_init_weights(cfg)
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert "model.layers.1.self_attn.k_proj.bias" in state and cfg.attention_bias and cfg.rms_norm_eps == 1e-6


def test_unsupported_and_broken_sources_are_refused_by_name(tmp_path, tokenizer_file):
    src = tmp_path / "src"
    _source("mistral", src, tokenizer_file)
    with pytest.raises(HFImportError, match="sliding_window=64 and model.block_size=128"):
        import_hf(src, tmp_path / "initial", block_size=128)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["PhiForCausalLM"],
                                                 "model_type": "phi"}))
    with pytest.raises(HFImportError, match="PhiForCausalLM .* not supported; supported: LlamaForCausalLM"):
        read_source(src)
    (src / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    with pytest.raises(HFImportError, match="tokenizer and its model disagree"):
        import_hf(src, tmp_path / "initial")
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(HFImportError, match="model.layers.2.* is missing"):
        import_hf(src, tmp_path / "initial")
    (src / "tokenizer.json").unlink()
    with pytest.raises(HFImportError, match="no tokenizer.json"):
        import_hf(src, tmp_path / "initial")


def test_a_corrupt_copy_of_the_initial_weights_is_refused(tmp_path, tokenizer_file):
    _source("llama", tmp_path / "src", tokenizer_file)
    imported = import_hf(tmp_path / "src", tmp_path / "initial")
    digest = imported.weights.stem
    cfg = ModelConfig(**{**imported.fields, "init_weights": f"sha256:{digest}"})
    assert load_init_weights(cfg, [tmp_path / "initial"]).keys() == init_state_dict(
        ModelConfig(**imported.fields), 0).keys()
    data = bytearray(imported.weights.read_bytes())
    data[-3] ^= 0xFF
    imported.weights.write_bytes(bytes(data))
    with pytest.raises(HFImportError, match="not the run's initial weights"):
        load_init_weights(cfg, [tmp_path / "initial"])
    with pytest.raises(HFImportError, match="initial weights are not here"):
        load_init_weights(cfg, [tmp_path])
    with pytest.raises(ExportError):
        export_hf({}, cfg, tmp_path / "x")


def test_a_joiner_fetches_the_initial_weights_from_a_peer_and_refuses_a_corrupt_copy(tmp_path,
                                                                                   tokenizer_file):
    """Over a real libp2p host: the run document names the weights by hash; a joiner with none fetches them
    (checked) into initial/<hash>.safetensors; a wrong local copy is refused in one line."""
    from node.initfetch import initial_weights
    from node.errors import ConfigError
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    _source("llama", tmp_path / "src", tokenizer_file)
    imported = import_hf(tmp_path / "src", tmp_path / "organizer" / "initial")
    digest = imported.weights.stem
    document = {"model": {"init_weights": f"sha256:{digest}"}}
    joiner = tmp_path / "joiner"
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "peer") as peer:
        peer.provide_file(imported.weights, digest)
        path = initial_weights(document, joiner, tuple(peer.listen_addrs[:1]))
    assert Path(path) == (joiner / "initial" / f"{digest}.safetensors").resolve()
    assert Path(path).read_bytes() == imported.weights.read_bytes()
    assert initial_weights(document, joiner, ()) == path  # kept: no peer needed again
    Path(path).write_bytes(Path(path).read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ConfigError, match="not the run's initial weights") as refused:
        initial_weights(document, joiner, ())
    assert "\n" not in str(refused.value)
    assert initial_weights({"model": {}}, joiner, ()) == ""
