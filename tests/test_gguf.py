"""GGUF files of every architecture transformers reads from GGUF, written here from a tiny
random-weight model (fp32 tensors, a byte-level BPE vocabulary) with the `gguf` package's
GGUFWriter as llama.cpp's converter lays them out (Llama's q/k rows permuted, Gemma's norms
stored as 1 + w), then loaded through the project's loader (`--model file.gguf`): the
runner's logits are transformers' over the same file, and `full` is its `generate`.

Transformers (5.25) reads these supported families from GGUF: llama, qwen2, qwen3, phi3,
gemma2, gemma3, starcoder2, qwen2_moe, qwen3_moe, minimax_m2, gpt2, stablelm, nemotron,
falcon and bloom. Mistral has no GGUF architecture of its own:
llama.cpp writes it as a llama file, which loads (and is served) as Llama, the same model
without a sliding window; transformers' special case for a llama file named "mistral" fails
(gguf-py knows no "mistral" tensor map).
What a file can say is what transformers maps from its metadata: no per-layer types (Gemma 3
layers follow the default pattern), no partial rotary or window for Phi-3, Qwen3's head_dim
always 128.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_architectures import COMMON as ARCH_COMMON

VOCAB = 300
PROMPT = 40
N_NEW = 12
# the architecture tests' tiny config, smaller still (a GGUF file is written per model)
COMMON = {**ARCH_COMMON, "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "max_position_embeddings": 256}
# name: (gguf architecture, config class, overrides)
ARCHS = {
    "llama": ("llama", "LlamaConfig", {}),
    "qwen2": ("qwen2", "Qwen2Config", {}),
    "qwen3": ("qwen3", "Qwen3Config", dict(head_dim=128)),  # transformers reads no head_dim: 128
    "phi3": ("phi3", "Phi3Config", {}),
    # transformers reads no soft-caps from a file: Gemma2Config's defaults (50 and 30)
    "gemma2": ("gemma2", "Gemma2Config", dict(
        num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=256,
        tie_word_embeddings=True)),
    "gemma3_text": ("gemma3", "Gemma3TextConfig", dict(
        num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=256,
        tie_word_embeddings=True)),
    # transformers reads no use_bias (True by default) nor sliding window (4096 by default)
    "starcoder2": ("starcoder2", "Starcoder2Config", dict(norm_epsilon=1e-5)),
    # mixtures of experts: transformers reads the expert counts, not the experts' widths
    # (Qwen2-MoE's 1408 and shared 5632, Qwen3-MoE's 768 by default) nor norm_topk_prob
    "qwen2_moe": ("qwen2moe", "Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    # (transformers reads a Qwen3-MoE file with norm_topk_prob set, as llama.cpp runs it)
    "qwen3_moe": ("qwen3moe", "Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                                      head_dim=32, norm_topk_prob=True)),
    # LayerNorms over Llama's block: transformers reads StableLM's q/k/v biases and parallel
    # block from which tensors the file holds, and no partial rotary (its defaults: a quarter
    # of each head, half of Nemotron's); llama.cpp stores Nemotron's norms as 1 + w
    "stablelm": ("stablelm", "StableLmConfig", dict(use_qkv_bias=True, layer_norm_eps=1e-5)),
    "nemotron": ("nemotron", "NemotronConfig", dict(norm_eps=1e-5)),
    # a sigmoid router whose correction bias is a tensor of its own (exp_probs_b), q/k norms
    # over whole projections, RoPE on half of each head
    "minimax_m2": ("minimax-m2", "MiniMaxM2Config", dict(num_local_experts=4, num_experts_per_tok=2,
                                                          head_dim=32, rotary_dim=16)),
    # learned positions; llama.cpp stores the Conv1D products transposed (as Linear's);
    # transformers reads no context length for GPT-2 (n_ctx, not n_positions): 1024
    "gpt2": ("gpt2", "GPT2Config", dict(max_position_embeddings=1024)),
    # transformers reads a Falcon file as Falcon-7B's block (multi-query, one norm for both
    # parallel branches; the embedding tied to the LM head), its MLP 4 hidden wide
    "falcon": ("falcon", "FalconConfig", dict(multi_query=True, parallel_attn=True,
                                              tie_word_embeddings=True, ffn_hidden_size=256,
                                              layer_norm_epsilon=1e-5)),
    # ALiBi; llama.cpp stores the fused q/k/v as every q, every k, every v (transformers
    # reorders them to BLOOM's per-head order); the embedding tied to the LM head
    "bloom": ("bloom", "BloomConfig", dict(tie_word_embeddings=True, layer_norm_epsilon=1e-5)),
}


def _tokens() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of VOCAB tokens: the 256 byte symbols, then merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    base = list(bytes_to_unicode().values())
    merges = [f"{a} {b}" for a in "abcdefghij" for b in "klmnopqrst"][: VOCAB - len(base)]
    return base + [m.replace(" ", "") for m in merges], merges


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Llama's q and k projections (transformers undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(name: str, path, **config) -> "torch.nn.Module":
    """Write a tiny random model of `name` to `path` (.gguf), `config` overriding its config's
    fields; returns the source model."""
    import gguf
    import transformers
    from transformers import AutoModelForCausalLM

    arch, cls, over = ARCHS[name]
    cfg = getattr(transformers, cls)(**{**COMMON, **over, **config})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.copy_(p + 0.3 * torch.randn_like(p))
        for bname, b in hf.named_buffers():  # MiniMax-M2's router bias is a buffer
            if bname.endswith("e_score_correction_bias"):
                b.copy_(b + 0.3 * torch.randn_like(b))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)  # a llama file named "mistral": transformers reads it as Mistral
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if arch == "falcon" else cfg.num_attention_heads if arch == "bloom"
                        else cfg.num_key_value_heads)
    if arch == "starcoder2":
        w.add_layer_norm_eps(cfg.norm_epsilon)
    elif arch in ("gpt2", "falcon", "bloom"):
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    elif arch == "stablelm":
        w.add_layer_norm_eps(cfg.layer_norm_eps)
    elif arch == "nemotron":
        w.add_layer_norm_rms_eps(cfg.norm_eps)  # (transformers reads Nemotron's eps from there)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None)  # (GPT-2 has none)
    if rope is not None:
        rope = rope.get("full_attention", rope)  # Gemma 3: global layers'
        w.add_rope_freq_base(float(rope["rope_theta"]))
        w.add_rope_dimension_count(getattr(cfg, "rotary_dim", None) or head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_uint32(f"{arch}.vocab_size", VOCAB)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch.endswith("moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "minimax-m2":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    tokens, merges = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    state = hf.state_dict()
    for key in [k for k in state if ".norms." in k]:  # StableLM's per-head q/k norms: one
        base, head = key.split(".norms.")  # tensor a layer, [heads, D], as llama.cpp stacks them
        state.setdefault(f"{base}.weight", []).append(state.pop(key))
    for key, t in state.items():
        t = torch.stack(t) if isinstance(t, list) else t
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = key.rsplit(".", 1)
        if suffix == "gate_up_proj":  # the experts' [E, 2I, H]: llama.cpp's gate and up apart
            for part, half in zip(("gate_proj", "up_proj"), t.chunk(2, dim=1)):
                gname = names.get_name(f"{base}.{part}")
                w.add_tensor(f"{gname}.weight", half.float().numpy().copy())
            continue
        if suffix == "down_proj":  # the experts' [E, H, I]
            base, suffix = key, "weight"
        if suffix == "e_score_correction_bias":  # llama.cpp's exp_probs_b
            w.add_tensor(f"blk.{key.split('.')[2]}.exp_probs_b.bias", t.float().numpy().copy())
            continue
        gname = names.get_name(base.removeprefix("transformer.") if arch == "bloom" else base)
        assert gname is not None, key
        a = t.float().numpy().copy()
        if arch == "llama" and base.endswith("q_proj"):
            a = _permute(a, cfg.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            a = _permute(a, cfg.num_key_value_heads)
        elif arch in ("gemma2", "gemma3", "nemotron") and "norm" in base and suffix == "weight":
            a = a + 1.0  # llama.cpp stores Gemma's and Nemotron's (1 + w)
        elif base.endswith("shared_expert_gate"):
            a = a.reshape(-1)  # llama.cpp's [H], not [1, H]
        elif arch == "gpt2" and suffix == "weight" and base.endswith(("c_attn", "c_proj", "c_fc")):
            a = a.T.copy()  # Conv1D's [in, out] as [out, in]
        elif arch == "bloom" and base.endswith("query_key_value"):  # each head's q, k, v: q's first
            heads, d = cfg.num_attention_heads, head_dim
            a = a.reshape(heads, 3, d, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape).copy()
        w.add_tensor(f"{gname}.{suffix}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module", params=list(ARCHS))
def gguf_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from vericache.model.loader import load_model

    name = request.param
    folder = tmp_path_factory.mktemp(f"gguf-{name.replace('_', '-')}")
    path = folder / f"tiny-{name}.gguf"
    source = write_gguf(name, path)
    mp = pytest.MonkeyPatch()
    mp.setenv("VERICACHE_CACHE_DIR", str(folder / "cache"))  # the conversion's cache
    try:
        lm = load_model(str(path), dtype="float32")
    finally:
        mp.undo()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32).eval()
    prompt = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    return name, lm, hf, source, prompt


def test_gguf_logits_match_transformers(gguf_model):
    """Prefill, one-token steps and a 3-token step against transformers' forward over the
    same GGUF file; and transformers' reading of the file is the model it was written from
    (the file says what the test means)."""
    name, lm, hf, source, prompt = gguf_model
    assert lm.model_id.startswith("gguf:") and lm.vocab_size == VOCAB
    assert hf.config.model_type == source.config.model_type
    ids = prompt + [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
        src = source(torch.tensor([ids])).logits[0].float()
    scale = float(ref.abs().max())
    assert float((src - ref).abs().max()) <= 1e-4 * max(1.0, scale), name
    r = lm.runner
    cache = r.new_cache(8)
    got = [r.step(prompt, 0, cache, logits="all")[0]]
    for i in range(3):
        got.append(r.step([ids[PROMPT + i]], PROMPT + i, cache, logits="all")[0])
    got.append(r.step(ids[PROMPT + 3:], PROMPT + 3, cache, logits="all")[0])
    got = torch.cat(got)
    diff = float((got - ref).abs().max())
    print(f"\n{name} (GGUF): logits max-abs diff {diff:.3g} (scale {scale:.3g})")
    assert got.shape == ref.shape and diff <= 1e-4 * max(1.0, scale), (name, diff)


def test_gguf_full_equals_generate(gguf_model):
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate

    name, lm, hf, _, prompt = gguf_model
    res = generate(lm, prompt, GenParams(mode="full", max_tokens=N_NEW, ignore_eos=True))
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                      max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert res.token_ids == out[0, PROMPT:].tolist(), name


def test_gguf_conversion_raced_by_another_process(tmp_path):
    """The drafter and verifier services starting together on a new node both convert the
    same GGUF file: the one that finishes second keeps the first one's folder (it failed
    with 'Directory not empty' and the drafter did not start) and leaves no temporary one."""
    from vericache.model.loader import _convert_gguf

    path = tmp_path / "tiny-llama.gguf"
    write_gguf("llama", path)
    out = tmp_path / "models" / "converted"
    out.parent.mkdir()
    _convert_gguf(path, out)
    first = (out / "model.safetensors").read_bytes()
    _convert_gguf(path, out)  # the slower process: its rename finds the folder in place
    assert (out / "model.safetensors").read_bytes() == first
    assert sorted(p.name for p in out.parent.iterdir()) == ["converted"]


def test_gguf_of_an_architecture_transformers_does_not_read(tmp_path, monkeypatch):
    """llama.cpp writes SmolLM3 as its own GGUF architecture, which transformers does not read:
    the loader says so and names the families it can take from GGUF, instead of failing with
    transformers' ValueError, and leaves no half-converted folder in its cache."""
    import gguf

    from vericache.errors import ModelLoadError
    from vericache.model.loader import load_model

    path = tmp_path / "tiny-smollm3.gguf"
    w = gguf.GGUFWriter(str(path), "smollm3")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cache = tmp_path / "cache"
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(cache))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert "smollm3" in msg and "tiny-smollm3.gguf" in msg
    readable = msg.split("runner's families: ")[1].split(";")[0].split(", ")
    assert {"llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen2_moe", "qwen3_moe"} <= set(readable)
    assert "smollm3" not in readable
    assert [p.name for p in (cache / "models").iterdir()] == []


def test_a_stablelm_file_with_q_k_norms_is_refused(tmp_path, monkeypatch):
    """StableLM 2 12B's q/k LayerNorms, in a file as llama.cpp writes them (attn_q_norm and
    attn_k_norm, one [heads, D] tensor a layer): transformers builds a StableLM without them
    and drops the tensors without a word, so serving what it built would serve another
    model. The loader refuses the file, and leaves no converted folder in its cache (a Hugging
    Face folder of the model loads: tests/test_architectures.py's `stablelm-qk`)."""
    from vericache.errors import ModelLoadError
    from vericache.model.loader import load_model

    path = tmp_path / "tiny-stablelm-qk.gguf"
    write_gguf("stablelm", path, qk_layernorm=True)
    cache = tmp_path / "cache"
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(cache))
    with pytest.raises(ModelLoadError, match="attn_q_norm"):
        load_model(str(path))
    assert [p.name for p in (cache / "models").iterdir()] == []
