"""Weight extraction per model family: one function per `model_type`, registered in FAMILIES.

Each function takes a transformers causal LM and returns `Weights`: the layer tensors in the
runner's layout (fused QKV, fused gate/up) plus what differs between families as data (q/k
norms, the Gemma norm offset and extra norms, the activation, the window and the RoPE table
of each layer, a mixture of experts in place of the MLP, scales and soft-caps). The runner's
forward reads only this data.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from vericache.errors import ModelLoadError


# `rowwise` pads rows to a multiple of this many elements: two of the widest vectors torch
# steps by (AVX-512's 16 float32s, 32 bfloat16s)
ROW_PAD = 64


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn, an elementwise function (torch ops, or a composite of them), over x [T, N], each
    row's bits those the row alone gets. torch runs an elementwise op over a contiguous
    tensor as one run of its elements: vector code over whole steps of two vectors, scalar
    code over the tail (a vector exp is not the scalar one), and exact GELU takes vector code
    for contiguous input only. So an element's bits would depend on the rows beside it (a
    router's sigmoid over 8 experts). Here each row is padded with zeros to a multiple of
    ROW_PAD, so every op's run, over the rows or over one, is whole vector steps, each row's
    starting on a step: every element takes the vector code, lane by lane, in every op of a
    composite too. (On one thread: a pass split between threads splits runs anywhere.)"""
    n = x.shape[-1]
    wide = x.new_zeros(*x.shape[:-1], -(-n // ROW_PAD) * ROW_PAD)
    wide[..., :n] = x
    return fn(wide)[..., :n].contiguous()


@dataclass(frozen=True)
class Chunk:
    """Chunked attention's window (Llama 4's): positions are cut into chunks of `size` from
    0, and a row sees only its own chunk's keys. A plain int window W slides instead: a row
    sees the last W positions, its own included. `first_seen` gives either's first key."""

    size: int


def first_seen(pos, window):
    """The oldest position a row at `pos` (an int or an int64 tensor) sees under `window`,
    a sliding window (int) or a `Chunk`; a key older than it is not seen."""
    if isinstance(window, Chunk):
        return pos - pos % window.size
    return pos - window + 1


@dataclass
class Experts:
    """A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), computed as
    transformers computes it: the router's logits (x router^T, in the router weight's dtype:
    float32 where the checkpoint keeps it so or transformers computes them so,
    `_ROUTER_FLOAT32`), each row's top_k experts and their weights
    (`route`), each chosen expert's gated MLP over the rows that chose it, scaled by the row's
    weight and added to the row's output in the experts' order; then, where there is one, the
    shared expert's MLP, times sigmoid(x shared_gate^T) where it is gated (Qwen2-MoE)."""

    router: torch.Tensor  # [E, H]
    gate_up: list[torch.Tensor]  # E x [2 I, H], gate first
    down: list[torch.Tensor]  # E x [H, I]
    top_k: int
    norm_topk: bool
    weights_in_dtype: bool  # False: Mixtral, whose weights stay float32 until the sum
    shared_gate_up: torch.Tensor | None = None  # [2 Is, H]
    shared_down: torch.Tensor | None = None  # [H, Is]
    shared_gate: torch.Tensor | None = None  # [1, H]
    shared_gate_up_b: torch.Tensor | None = None  # the shared expert's biases (ERNIE's)
    shared_down_b: torch.Tensor | None = None
    # GPT-OSS: a router bias [E]; the top_k of the logits, then their softmax (in the model's
    # dtype; Granite-MoE's: in float32, `router_float32`); biases on the experts' products; the
    # clamped SwiGLU (alpha, limit): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g),
    # g = clamp(gate, max=limit)
    router_b: torch.Tensor | None = None
    softmax_after_topk: bool = False
    router_float32: bool = False
    gate_up_b: list[torch.Tensor] | None = None  # E x [2 I]
    down_b: list[torch.Tensor] | None = None  # E x [H]
    swiglu: tuple[float, float] | None = None
    # DeepSeek-V3's router (GLM-4.5, dots.llm1, EXAONE-MoE, Solar Open, MiniCPM5-MoE; AFMoE's
    # and MiniMax-M2's without groups), `scores` "sigmoid": sigmoid scores of the float32 logits; the choice adds
    # `score_bias` (e_score_correction_bias) and keeps the experts of the `groups` (n_group,
    # topk_group) best groups, a group scored by its two best choices; the weights are the
    # chosen experts' scores (divided by their sum + `norm_eps` where `norm_topk`), times
    # `scale` (routed_scaling_factor), float32. Mistral 4's and ERNIE 4.5's, "softmax": the
    # logits' softmax in their dtype (ERNIE's float32), the other groups' scores masked to 0,
    # the weights divided by their sum clamped to at least `norm_min` (ERNIE's), then in the
    # model's dtype. DeepSeek-V2's, "softmax" too: a group scored by its best (`group_top` 1),
    # the weights float32. Phi-MoE's, "sparsemixer": `_sparsemixer`'s two choices. `scale`
    # also multiplies the softmax-after-top-k weights (Cohere 2 MoE's 0.5 where it averages
    # the routed and shared experts' outputs: `_cohere`)
    scores: str | None = None
    score_bias: torch.Tensor | None = None  # [E]
    # Kolibri-1's: the bias added to the float32 logits for the choice, not to the scores
    bias_on_logits: bool = False
    groups: tuple[int, int] | None = None
    group_top: int = 2
    jitter: float = 0.0  # "sparsemixer": router_jitter_noise
    # DBRX's: the top k of the softmax (in the logits' dtype) divided by their p-norm
    norm_p: float | None = None
    norm_eps: float = 0.0
    norm_min: float | None = None
    scale: float = 1.0
    # Llama 4's: the row's weight multiplies the chosen expert's input (in the model's dtype),
    # not its output
    scale_input: bool = False
    # transformers' grouped (or batched) experts, its default where the checkpoint's experts
    # class takes one (`extract` asks its `_experts_implementation`): each chosen expert's
    # output (its biases added to its products) times its weight, kept in the product's
    # dtype (float32 for Mixtral's weights), summed over the row's top-k slots in slot order,
    # then cast once; else (its eager loop) each weighted output cast, then added in the
    # experts' order
    sum_slots: bool = False
    # Beam's: `scale` multiplies the summed output (in the model's dtype), not the weights
    scale_after: bool = False
    # Beam's router takes its top k sorted (DeepSeek-V3's take theirs unsorted)
    choice_sorted: bool = False
    # Laguna's: the float32 logits soft-capped, c tanh(logits / c), before their sigmoid
    logit_softcap: float | None = None
    # LongCat-Flash's zero-computation experts: the router scores len(gate_up) + this many, and
    # a row that chooses one of these adds its input times the weight (`Runner._experts`)
    zero_experts: int = 0
    # JetMoE's: a bias [H] added to the experts' summed output
    out_b: torch.Tensor | None = None
    # Ergo's: each chosen expert's output RMS-normed in float32 (eps `out_norm_eps`) and scaled
    # by that expert's row of `out_norm` [E, H] before its weight; the shared expert's output
    # RMS-normed by `shared_norm` [H] (the model's norm) before it is added
    out_norm: torch.Tensor | None = None
    out_norm_eps: float = 1e-6
    shared_norm: torch.Tensor | None = None
    # Ergo's float32 weights rounded to the model's dtype first (float32 again after)
    weights_rounded: bool = False

    def route(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts [T, top_k] and their weights (float32, or `dtype` where
        `weights_in_dtype`), from the router's logits [T, E], with transformers' arithmetic."""
        if self.norm_p is not None:  # DBRX
            top, idx = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
            return top / torch.norm(top, p=self.norm_p, dim=-1, keepdim=True), idx
        if self.softmax_after_topk:  # GPT-OSS, Granite-MoE, Cohere 2 MoE (float32)
            top, idx = torch.topk(logits.float() if self.router_float32 else logits, self.top_k,
                                  dim=-1)
            top = torch.softmax(top, dim=-1, dtype=top.dtype)
            return (top if self.scale == 1.0 else top * self.scale).to(dtype), idx
        if self.scores == "sparsemixer":
            return _sparsemixer(logits, self.jitter)
        if self.scores == "top_k_sigmoid":  # Llama 4's: the sigmoid of the top k logits
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            return rowwise(torch.sigmoid, top.float()).to(dtype), idx
        sigmoid = self.scores == "sigmoid"
        if self.logit_softcap is not None:  # (row by row, as the sigmoid: `rowwise`)
            c = self.logit_softcap
            logits = rowwise(lambda t: torch.tanh(t / c) * c, logits.float())
        if sigmoid:
            scores = rowwise(torch.sigmoid, logits.float())
        else:  # in float32 (Mixtral's), or in the logits' dtype (`scores` "softmax")
            scores = logits.softmax(-1) if self.scores else torch.softmax(logits.float(), dim=-1)
        choice = scores if self.score_bias is None else (
            logits.float() if self.bias_on_logits else scores) + self.score_bias
        if self.groups is not None:
            n, keep = self.groups
            best = choice.view(-1, n, choice.shape[-1] // n).topk(self.group_top, dim=-1)[0].sum(dim=-1)
            mask = torch.zeros_like(best).scatter_(1, best.topk(keep, dim=-1, sorted=False)[1], 1)
            choice = choice.masked_fill(~mask.bool().repeat_interleave(choice.shape[-1] // n, 1),
                                        float("-inf") if sigmoid else 0.0)
        # (transformers' DeepSeek-V3 routers take their top k unsorted, Mixtral's sorted)
        idx = torch.topk(choice, self.top_k, dim=-1,
                         sorted=self.scores is None or self.choice_sorted)[1]
        top = scores.gather(1, idx)
        if self.norm_topk:
            total = top.sum(dim=-1, keepdim=True)
            top = top / (total.clamp(min=self.norm_min) if self.norm_min is not None
                         else total + self.norm_eps)
        if not self.scale_after:
            top = top * self.scale
        if self.weights_rounded:
            return top.to(dtype).float(), idx
        return (top.to(dtype) if self.weights_in_dtype else top), idx

    def mats(self) -> list[torch.Tensor]:
        """Every product's matrix: the router, the experts', the shared expert's."""
        return [self.router, *self.gate_up, *self.down] + [
            t for t in (self.shared_gate_up, self.shared_down, self.shared_gate) if t is not None]


def _sparsemixer(logits: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-MoE's router at inference (transformers' `sparsemixer`, top 2): the best expert, its
    weight the softmax of the logits within 2 `jitter` (relative) of it at its index; then the
    same over the logits with the first masked out. Weights in the logits' dtype."""
    tops, idx, masked = [], [], logits
    for _ in range(2):
        best, i = masked.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * jitter
        tops.append(masked.masked_fill(far, float("-inf")).softmax(-1).gather(-1, i))
        idx.append(i)
        masked = torch.scatter(logits, -1, i, float("-inf"))
    return torch.cat(tops, -1), torch.cat(idx, -1)


@dataclass
class MLA:
    """DeepSeek's multi-head latent attention, run as the attention it equals: each head's key
    is its own k_nope (from the latent, through `kv_b`) beside the shared, rotated k_pe, and
    its value comes from the latent too. The layer's first product (`Layer.w_qkv`) gives q
    (or q's low-rank part, then `q_norm` and `q_b`) and the latent beside k_pe; then the latent
    is normed (`kv_norm`) and widened by `kv_b` to every head's k_nope and v. The cache holds
    each head's key as transformers concatenates it (nope, then pe: each score sums its
    products in transformers' order) and its value padded with zeros to the key's width (the
    padding's products are zeros: the attention output's first `v` dims are the value's);
    DeepSeek's interleaved RoPE pairs (`rope_interleave`) are reordered to halves at load, as
    transformers reorders them before rotating, and the runner's RoPE rotates each head's last
    `pe` dims (`Runner._rope_pass`'s `tail`)."""

    q_rows: int  # the first product's rows that are q's (or q_a's)
    q_norm: torch.Tensor | None  # [q_lora_rank] (None: q is the first product's)
    q_b: torch.Tensor | None  # [Hq (nope + pe), q_lora_rank]
    kv_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [Hq (nope + v), kv_lora_rank]
    rank: int  # kv_lora_rank
    nope: int
    pe: int
    v: int
    eps: float  # the two norms' (DeepSeek's RMSNorm default, not the config's)
    # LongCat-Flash's: q times q_scale after q_b, the normed latent times kv_scale before kv_b
    q_scale: float | None = None
    kv_scale: float | None = None

    def mats(self) -> list[torch.Tensor]:
        return [t for t in (self.q_b, self.kv_b) if t is not None]


@dataclass
class Layer:
    ln_attn_in: torch.Tensor | None  # [H] before attention (input_layernorm; None: OLMo 2)
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    b_qkv: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    w_o: torch.Tensor  # [H, Hq D]
    # [H] before the MLP (Llama's post_attention, Gemma's pre_feedforward; None: OLMo 2)
    ln_mlp_in: torch.Tensor | None
    # [2 I, H] (None: `moe` is the layer's MLP; [I, H] where the MLP is not gated)
    w_gate_up: torch.Tensor | None
    w_down: torch.Tensor | None  # [H, I]
    ln_attn_out: torch.Tensor | None = None  # [H] on the attention output (Gemma)
    ln_mlp_out: torch.Tensor | None = None  # [H] on the MLP output (Gemma)
    qk_norm: torch.Tensor | None = None  # [Hq + Hkv, D] per-head RMSNorm of q then k, before RoPE
    qk_norm_after_rope: bool = False  # `qk_norm` after RoPE instead (HunYuan, nanochat)
    # `qk_norm` a LayerNorm instead (centred, in float32, then cast: StableLM's per-head ones,
    # Persimmon's one for every head), plus its bias [Hq + Hkv, D] where it has one
    qk_layer_norm: bool = False
    qk_norm_b: torch.Tensor | None = None
    # ... one for all of q's heads and one for all of k's (Persimmon's): with torch's
    # LayerNorms (`Weights.torch_layer_norm`), two F.layer_norm calls (else one a head)
    qk_norm_shared: bool = False
    # [(Hq + Hkv) D]: one RMSNorm over all of q's heads, then one over k's, before RoPE (OLMo 2)
    qk_norm_wide: torch.Tensor | None = None
    # sliding window (int: a key older than pos - window + 1 is not seen) or chunked
    # attention's (`Chunk`): `first_seen`
    window: "int | Chunk | None" = None
    rope: int = 0  # index into Weights.ropes
    moe: Experts | None = None  # the MLP, where it is a mixture of experts
    # Cohere: attention and MLP in parallel, both on ln_attn_in's output, both added to h
    # (GPT-NeoX: the MLP on ln_mlp_in's output of the layer's input)
    parallel: bool = False
    # ... and the two branches summed first, then added to h: (attn + mlp) + h, Phi's,
    # GPT-J's, CodeGen's, GPT-NeoX's and Falcon's order (Cohere's and StableLM's: (h + attn)
    # + mlp); in bfloat16 the roundings differ
    branches_first: bool = False
    # output-projection and MLP biases (StarCoder 2; Llama's attention_bias, mlp_bias)
    b_o: torch.Tensor | None = None  # [H]
    b_gate_up: torch.Tensor | None = None  # [2 I] (or [I] where the MLP is not gated)
    b_down: torch.Tensor | None = None  # [H]
    # LayerNorm biases (StarCoder 2's), where the norms are LayerNorms (`Weights.layer_norm`)
    ln_attn_in_b: torch.Tensor | None = None
    ln_mlp_in_b: torch.Tensor | None = None
    # GPT-OSS: a learned logit per query head [Hq] that joins each row's softmax as one more
    # key with no value (the explicit attention path)
    sinks: torch.Tensor | None = None
    mla: MLA | None = None  # DeepSeek's latent attention (`w_qkv` is its first product)
    # an output gate (MiniCPM5-MoE, AFMoE): w_qkv's last Hq D rows give g, and the attention's
    # output is multiplied by sigmoid(g) before o_proj
    out_gate: bool = False
    clip_qkv: float | None = None  # q, k and v clamped to [-c, c] (OLMo's)
    # a value narrower than the key (MiMo-V2-Flash's): the cache holds it padded with zeros to
    # the key's width (the padding's products are zeros), and the attention output's first
    # `v_dim` dims of each head are the value's (latent attention's: `MLA.v`)
    v_dim: int | None = None
    v_scale: float | None = None  # v times this after its product (MiMo-V2-Flash's)
    # Ergo's global layers: q and k times this after RoPE, in the model's dtype
    qk_scale: torch.Tensor | None = None
    # BitNet's RMSNorms inside the branches: on the attention's output before o_proj [Hq D],
    # and on act(gate) * up before down_proj [I]
    ln_attn_sub: torch.Tensor | None = None
    ln_mlp_sub: torch.Tensor | None = None
    # LongCat-Flash's shortcut mixture of experts: computed on this layer's MLP input beside
    # its dense MLP, and added after the next layer's MLP (that layer's `add_shortcut`)
    shortcut: Experts | None = None
    add_shortcut: bool = False
    # Laguna's fewer query heads on some layers: the runner computes `Runner.num_heads` (the
    # most of any layer), this layer's heads among them (each KV head's group padded with
    # heads whose q rows are zeros), their places [Hq_layer]; the output takes these heads'
    # only, so o_proj reads the layer's own heads
    q_heads: torch.Tensor | None = None
    # DiffLlama's differential attention (λ, λ_init): the first half of the query heads'
    # output less λ times the second half's, each head RMS-normed (no weight) over its width,
    # times 1 - λ_init; λ a 0-dim tensor in the model's dtype (`_diffllama`)
    diff: tuple[torch.Tensor, float] | None = None
    # JetMoE's mixture of attention heads: its router picks a row's top_k experts; expert e's
    # query projection (`gate_up[e]`, [Hkv D, H]) gives the row's queries of that slot, one a
    # K/V head, and its output projection (`down[e]`, [H, Hkv D]) takes that slot's heads'
    # output back, weighted and summed in the experts' order, plus `out_b`. `w_qkv` is then
    # the K/V product alone and `w_o` None; the runner's query heads are Hkv x top_k, a K/V
    # head's group its slots (`Runner._moa_queries`, `_moa_output`)
    moa: Experts | None = None
    # Laguna's output gate: softplus(g) in float32, then cast (else sigmoid(g)); one a head,
    # broadcast over its width (`gate_heads`), or one an element
    gate_softplus: bool = False
    gate_heads: bool = False
    # the MLP's activation where it is the layer's own (Apertus's xIELU has learned
    # parameters a layer); None: the model's (`Weights.activation`)
    act: Callable[[torch.Tensor], torch.Tensor] | None = None
    q_scaled: bool = True  # `Weights.q_scale` applies (Llama 4's: its layers without RoPE only)
    # GPT-1's post-norm block: ln_attn_in norms h + attention (the MLP's input and the next
    # residual), ln_mlp_in norms h + MLP; no norm before either branch
    post_norms: bool = False
    # RoPE over interleaved pairs (x[2i], x[2i + 1]) in place, outside float32
    # (`_interleaved_rope`: q's and k's dims as transformers lays them, so each score sums in
    # its order); the layer's table is then in pairs too (`_pair_tables`)
    rope_pairs: bool = False
    # Beam's bias a head on the output gate [Hq D], added after the gate's product
    out_gate_b: torch.Tensor | None = None
    # Beam's depth-scaled sums: h = attention a + h b, then h = MLP c + h d, (a, b, c, d), each
    # product in the model's dtype; None: h + branch
    residual_mix: tuple[float, float, float, float] | None = None

    @property
    def value_width(self) -> int | None:
        """A head's value width where it is narrower than the cache's (latent attention's
        `MLA.v`, else `v_dim`); None: the cache's."""
        return self.mla.v if self.mla is not None else self.v_dim

    def mats(self) -> list[torch.Tensor]:
        """Every product's matrix: qkv (and the latent attention's), output, then the MLP's
        (gate/up and down, or the experts') and a shortcut mixture's."""
        mlp = [self.w_gate_up, self.w_down] if self.moe is None else self.moe.mats()
        if self.shortcut is not None:
            mlp += self.shortcut.mats()
        attn = [self.w_o] if self.moa is None else self.moa.mats()
        return [self.w_qkv, *([] if self.mla is None else self.mla.mats()), *attn, *mlp]


@dataclass
class Weights:
    layers: list[Layer]
    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor | None  # [H] the final norm (None: GPT-1's, whose layers end in norms)
    lm_head: torch.Tensor  # [V, H]
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) [P, R] each, R <= D (partial)
    head_dim: int
    activation: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    # Gemma: sqrt(hidden); Granite: embedding_multiplier; a tensor in the model dtype, or a
    # number (`embed_scale_number`)
    embed_scale: float | None = None
    # the scale as a number: the product in float32, then rounded (transformers' Granite,
    # HyperCLOVAX, AFMoE, BioGPT, XGLM and CTRL multiply by a Python float); else a tensor
    # in the model's dtype (Gemma's, MiniCPM3's)
    embed_scale_number: bool = False
    norm_upcast: bool = False  # Gemma: (x_norm * w) in fp32 then cast; else cast then scale
    final_softcap: float | None = None  # logits = c * tanh(logits / c)
    softcap_float32: bool = False  # Beam: that in float32 (Gemma's: in the model's dtype)
    # Ergo's in a narrow dtype: the residual stream float32 (its embedding float32, the model's
    # dtype its products'), each branch's normed input cast to the model's dtype, its output
    # float32 before its post-norm, the final norm's output cast to the model's dtype before
    # a float32 LM head
    stream_float32: bool = False
    attn_softcap: float | None = None  # Gemma 2: scores = c * tanh(scores / c), before the mask
    # Flint, GPT-Neo, GPT-J and CodeGen: the scores (Flint's sinks' logits too) and their
    # softmax in float32, the weights then cast to the model's dtype (their eager attention's
    # arithmetic; the explicit path, `Runner._sdpa`)
    attn_float32: bool = False
    # GPT-1, XGLM: transformers' only attention is its eager arithmetic (`Runner._sdpa`'s
    # explicit path: scores in the model's dtype, softmax in float32, cast back), not SDPA
    attn_eager: bool = False
    # GPT-1: the explicit path's scores divided by sqrt(D) (transformers' order; a product
    # with its inverse rounds otherwise where sqrt(D) is not a power of two)
    attn_divide: bool = False
    # Beam: a gated MLP's act(gate) * up in float32, then cast (its experts' too)
    glu_float32: bool = False
    # Granite-SWA: attention sinks (`Layer.sinks`) as transformers computes them, the output
    # times sigmoid(logsumexp(scores) - sink) in float32; else GPT-OSS's, one more logit in
    # the softmax (the same value, other roundings)
    sinks_lse: bool = False
    # MiMo-V2-Flash: transformers' only attention is its eager arithmetic, every layer's row
    # less its maximum, softmax in the model's dtype (GPT-OSS's sinks path, with or without
    # a sink)
    softmax_in_dtype: bool = False
    # GPT-NeoX Japanese's eager attention: the scores baddbmm(0, q, k^T, alpha=scale) and
    # their softmax (no maximum taken off first) in the model's dtype
    scores_baddbmm: bool = False
    # OPT, XGLM: q scaled by the attention's scale in the model's dtype (after its bias), the
    # attention then unscaled (their order; in bfloat16 the rounding differs)
    q_prescaled: bool = False
    # Granite's and MiniCPM3's multiplier on each branch's output, before the residual sum,
    # in the model's dtype (in float32 it is folded into the weights, `_fold_residual`)
    residual_scale: float | None = None
    # Falcon's products: x W^T, then + b, rounded apart (its FalconLinear); else one F.linear
    bias_after: bool = False
    logit_divisor: float | None = None  # Granite: logits / logits_scaling, in the model dtype
    logit_scale: float | None = None  # Cohere: logits * logit_scale, in the model dtype
    # LayerNorm (x - mean) / std * w (+ b), in fp32 then cast (Cohere's, StarCoder 2's), for
    # every norm but the q/k norms; else RMSNorm
    layer_norm: bool = False
    # those LayerNorms are torch's own: "dtype" where they are transformers' nn.LayerNorm
    # (`extract` asks the checkpoint's modules), F.layer_norm in the model's dtype, whose
    # arithmetic (moments in float32, w and b applied before the one rounding) a cast copy
    # of Cohere's order does not repeat bit for bit in bfloat16; "float32": F.layer_norm
    # over a float32 copy, then cast (OLMo's); "": Cohere's order
    torch_layer_norm: str = ""
    norm_b: torch.Tensor | None = None  # the final LayerNorm's bias
    lm_head_b: torch.Tensor | None = None  # [V] (Phi's)
    eps: float | None = None  # the norms' epsilon (None: the config's rms_norm_eps)
    # the final norm's, where it is not the layers' (JetMoE's layers take 1e-6 whatever the
    # config says, its final norm the config's; CTRL's the other way round); None: `eps`
    final_eps: float | None = None
    gated: bool = True  # the MLP: down(act(gate x) * up x); False: down(act(up x)) (StarCoder 2)
    # learned absolute positions (GPT-2, OPT): row p added to the embedding of position p
    # (after `embed_scale`); such a model's RoPE table is the identity (`_identity_rope`)
    pos_embed: torch.Tensor | None = None  # [P, H]
    # Ministral 3: q times a factor of its position, after RoPE [P] (exactly 1 before
    # `q_scale_from`, where the fused pass may run); the product then in q's dtype (Llama 4's
    # float32 factors: the product in float32, rounded once). On the layers `Layer.q_scaled`
    q_scale: torch.Tensor | None = None
    q_scale_from: int = 0
    # nanochat: a norm of the embedding (and of `pos_embed`'s sum) before the first layer
    # (BLOOM's a LayerNorm with its bias)
    embed_norm: torch.Tensor | None = None  # [H]
    embed_norm_b: torch.Tensor | None = None  # [H]
    # ModernBERT-decoder's prediction head, between the final norm and the LM head: a dense
    # product (with its bias where it has one), an activation, a norm (the model's kind)
    head_dense: torch.Tensor | None = None  # [H, H]
    head_dense_b: torch.Tensor | None = None  # [H]
    head_activation: str | None = None
    head_norm: torch.Tensor | None = None  # [H]
    head_norm_b: torch.Tensor | None = None  # [H]
    # ALiBi (BLOOM, MPT, Falcon's ALiBi checkpoints): each query head's slope [Hq], float32; a
    # score gets slope (key's position - row's position) (`Runner._alibi`); such a model's
    # RoPE table is the identity
    alibi: torch.Tensor | None = None
    # how transformers computes the bias (`Runner._alibi`): "relative" (MPT's arithmetic);
    # "bloom", slope x the key's position in float32, rounded to the model's dtype, joining the
    # scores' product (baddbmm); "falcon", slope (bfloat16) x the key's position, rounded to
    # bfloat16 in any dtype, over sqrt(D)
    alibi_kind: str = "relative"


# families whose attention has one K/V head a query head (no num_key_value_heads)
_MULTI_HEAD = ("gpt2", "opt", "gpt_neox", "gpt_bigcode", "gptj", "gpt_neo", "codegen",
               "persimmon", "biogpt", "xglm", "ctrl", "bloom", "mpt", "openai-gpt",
               "gpt_neox_japanese", "modernbert-decoder")


def kv_heads(cfg) -> int:
    """The config's K/V heads: num_key_value_heads; GPT-BigCode's one where `multi_query`;
    one a query head for the families that have no such field (`_MULTI_HEAD`) and for latent
    attention (`MLA`: every head its own key); Falcon's as its attention counts them."""
    if getattr(cfg, "kv_lora_rank", None):
        return cfg.num_attention_heads
    if cfg.model_type == "falcon":
        return (cfg.num_kv_heads if cfg.new_decoder_architecture else
                1 if cfg.multi_query else cfg.num_attention_heads)
    if cfg.model_type in _MULTI_HEAD:
        return 1 if getattr(cfg, "multi_query", False) else cfg.num_attention_heads
    if cfg.model_type == "mimo_v2_flash":  # its sliding layers' twice as many (`_mimo`)
        return cfg.num_key_value_heads * (2 if "sliding_attention" in cfg.layer_types else 1)
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def q_heads(cfg) -> int:
    """The query heads the runner computes a layer: the config's; Laguna's, whose layers may
    have fewer, the most of any layer (`Layer.q_heads`)."""
    per = getattr(cfg, "num_attention_heads_per_layer", None) if cfg.model_type == "laguna" else None
    return max(per) if per else cfg.num_attention_heads


def _t(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.detach().to(device).contiguous()


def head_dim(cfg) -> int:
    """A head's width in the cache (latent attention's: its key's, nope + pe, `MLA`)."""
    if getattr(cfg, "kv_lora_rank", None):
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * d if cfg.model_type == "diffllama" else d  # (`_diffllama`: its two values a head)



def _rope_params(cfg) -> dict[str, dict]:
    """RoPE parameters by layer type ("" when one set serves every layer)."""
    rp = getattr(cfg, "rope_parameters", None) or {}
    if rp and all(isinstance(v, dict) for v in rp.values()):
        return dict(rp)
    return {"": rp}


# The most positions the runner serves (VERICACHE_MAX_CONTEXT): its RoPE tables hold every
# position from load on (2 x positions x head dim floats: Llama 4 Scout's declared 10M would be
# 10 GB), so a model whose config declares more is served up to this many
MAX_CONTEXT = 131072


def context_cap() -> int:
    """VERICACHE_MAX_CONTEXT, else MAX_CONTEXT."""
    value = os.environ.get("VERICACHE_MAX_CONTEXT", str(MAX_CONTEXT))
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ModelLoadError(f"VERICACHE_MAX_CONTEXT={value!r}: give a positive number of tokens")
    return n


# sparse attention whose indexer keeps each query's `index_topk` best keys (DeepSeek-V3.2's
# DSA): up to that many positions it keeps every key, so the attention is the dense one its
# block computes without the indexer; served up to there (`max_positions`), the indexer unused
_DENSE_UP_TO_TOPK = ("deepseek_v32", "glm_moe_dsa")


def max_positions(cfg) -> int:
    """The context the runner serves: the model's, at most `context_cap()`. Static RoPE types
    only: dynamic NTK is refused; longrope is exact only up to its original context (past it
    transformers switches every position to the long factors), so the context is capped there.
    ALiBi's have no table: MPT's is its max_seq_len, BLOOM's the 2048 it was trained on
    (`seq_length`). A sparse-attention model's context is capped at its indexer's top k
    (`_DENSE_UP_TO_TOPK`)."""
    n = (cfg.max_seq_len if cfg.model_type == "mpt" else getattr(cfg, "seq_length", 2048)
         if cfg.model_type == "bloom" else cfg.max_position_embeddings)
    if cfg.model_type in _DENSE_UP_TO_TOPK:
        n = min(n, cfg.index_topk)
    for params in _rope_params(cfg).values():
        rope_type = params.get("rope_type", "default")
        # (HunYuan's "dynamic" with a fixed `alpha` is NTK-alpha, static: transformers runs it so)
        if "dynamic" in rope_type and not (cfg.model_type.startswith("hunyuan")
                                           and params.get("alpha")):
            raise ModelLoadError(f"RoPE type {rope_type!r} is not supported (its frequencies "
                                 "change with the sequence length; positions must be static)")
        if rope_type == "longrope":
            orig = params.get("original_max_position_embeddings") or \
                getattr(cfg, "original_max_position_embeddings", None) or n
            n = min(n, orig)
    return min(n, context_cap())


def _rope_table(rotary, n: int, dtype: torch.dtype, device, layer_type: str | None = None):
    positions = torch.arange(n).unsqueeze(0)
    probe = torch.zeros(1, dtype=dtype)
    with torch.no_grad():
        out = rotary(probe, positions) if layer_type is None else rotary(probe, positions, layer_type)
    if torch.is_tensor(out) and out.is_complex():  # DeepSeek-V2's freqs_cis: cos + i sin a pair
        out = [torch.cat([t, t], -1) for t in (out.real, out.imag)]  # (`_mla` reorders pairs)
    cos, sin = out
    return _t(cos[0], device), _t(sin[0], device)


def _ropes(cfg, m, device, per_kind: bool,
           dtype: torch.dtype | None = None) -> tuple[list, list[int], list[int]]:
    """The RoPE tables, each layer's index into them and the layers without RoPE: one table a
    layer type where `per_kind` (Gemma 3's and OLMo 3's sliding layers have their own), else
    one for all. A layer type whose parameters the config gives as None (Beam's, Cohere
    Compass's) has no table: its layers read table 0 until `_without_rope` gives them the identity; where no
    type has any, the one table is the identity. `dtype`: the tables' (the embedding's)."""
    types = cfg.layer_types if per_kind else [None] * len(m.layers)
    params = (cfg.rope_parameters or {}) if per_kind else {}
    kinds = sorted(t for t in set(types) if t not in params or params[t] is not None)
    n = max_positions(cfg)
    dtype = m.embed_tokens.weight.dtype if dtype is None else dtype
    if not kinds:
        return [_identity_rope(n, head_dim(cfg), dtype, device)], [0] * len(types), []
    ropes = [_rope_table(m.rotary_emb, n, dtype, device, kind) for kind in kinds]
    index = [kinds.index(t) if t in kinds else 0 for t in types]
    return ropes, index, [i for i, t in enumerate(types) if t not in kinds]


def _window(cfg, layer_idx: int) -> int | None:
    """The layer's sliding window, or None. Layers with `layer_types` (Qwen2/3, Ministral,
    SmolLM3, OLMo 3, Gemma 2/3) slide only where marked "sliding_attention"; Mistral and Phi-3
    slide on every layer."""
    w = getattr(cfg, "sliding_window", None)
    if not w or w >= cfg.max_position_embeddings:
        return None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and cfg.model_type != "mistral":
        return w if types[layer_idx] == "sliding_attention" else None
    return w


def _bias(mod, device) -> torch.Tensor | None:
    b = getattr(mod, "bias", None)
    return None if b is None else _t(b, device)


def _output_biases(a, mlp, device) -> dict:
    """A layer's output-projection and MLP biases (Llama's `attention_bias` / `mlp_bias`)."""
    down = getattr(mlp, "down_proj", None)
    return dict(b_o=_bias(a.o_proj, device),
                b_gate_up=None if hasattr(mlp, "experts") else _gate_up(mlp, device, "bias"),
                b_down=None if down is None else _bias(down, device))


def _gated_attention(cfg, a, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, v and the output gate's rows in one product (`Layer.out_gate`) and its bias
    (zeros where a projection has none; None where none has one): AFMoE's and Beam's gate_proj
    is its own; MiniCPM5-MoE's q_gate_proj holds each head's q, then its gate."""
    if hasattr(a, "q_gate_proj"):
        if any(getattr(p, "bias", None) is not None for p in (a.q_gate_proj, a.k_proj, a.v_proj)):
            raise ModelLoadError(f"{cfg.model_type}: a gated attention with biases is not "
                                 "supported by the runner")
        hq, d = cfg.num_attention_heads, head_dim(cfg)
        qg = a.q_gate_proj.weight.reshape(hq, 2, d, -1)
        projs = [qg[:, 0].reshape(hq * d, -1), a.k_proj.weight, a.v_proj.weight,
                 qg[:, 1].reshape(hq * d, -1)]
        biases = [None] * 4
    else:
        mods = (a.q_proj, a.k_proj, a.v_proj, a.gate_proj)
        projs, biases = [p.weight for p in mods], [p.bias for p in mods]
    if all(b is None for b in biases):
        return _t(torch.cat(projs), device), None
    return _t(torch.cat(projs), device), _t(torch.cat([
        b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
        for w, b in zip(projs, biases)]), device)


def _attention(a, device):
    w_qkv = _t(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), device)
    bias = None
    if a.q_proj.bias is not None:
        bias = _t(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]), device)
    return w_qkv, bias


def _qk_norm(cfg, a, device, offset: float | None = None) -> torch.Tensor | None:
    """The q_norm weight for every query head, then k_norm's for every KV head: [Hq + Hkv, D]
    (with `offset`, Gemma's (offset + w) in fp32; HunYuan's query_ and key_layernorm; ones
    for nanochat's norms without weights)."""
    qn, kn = (getattr(a, n, None) or getattr(a, f"{long}_layernorm", None)
              for n, long in (("q_norm", "query"), ("k_norm", "key")))
    if qn is None:
        return None
    ones = torch.ones(head_dim(cfg), dtype=next(a.parameters()).dtype)
    q, k = (n.weight if getattr(n, "weight", None) is not None else ones for n in (qn, kn))
    if offset is not None:
        q, k = offset + q.float(), offset + k.float()
    return _t(torch.cat([q.expand(cfg.num_attention_heads, -1), k.expand(cfg.num_key_value_heads, -1)]),
              device)


def _gate_up(mlp, device, attr: str = "weight") -> torch.Tensor | None:
    """The MLP's gate and up projections as one matrix, gate first (Phi-3's and GLM's are one
    already); its up projection alone where it has no gate (Arcee's); `attr` "bias": their
    biases (None: none)."""
    fused, gate, up = (getattr(mlp, n, None) for n in ("gate_up_proj", "gate_proj", "up_proj"))
    if fused is not None or gate is None:
        t = getattr(fused if fused is not None else up, attr, None)
        return None if t is None else _t(t, device)
    if getattr(gate, attr, None) is None:
        return None
    return _t(torch.cat([getattr(gate, attr), getattr(up, attr)]), device)


# families whose top-k weights stay float32 until they scale the experts' outputs
_TOP_K_FLOAT32 = ("mixtral",)
# families whose router takes the top k of its float32 logits, then their softmax (Cohere 2
# MoE's takes them in its logits' dtype: the same choice, the float32 softmax of the same values)
_TOP_K_THEN_SOFTMAX = ("granitemoe", "granitemoeshared", "granitemoe_swa", "cohere2_moe",
                       "granitemoehybrid")
# ... and those whose softmax of the top k logits is in the logits' dtype (Aria's)
_TOP_K_THEN_SOFTMAX_IN_DTYPE = ("aria_text",)
# families whose router's scores are the sigmoid of its float32 logits, with no bias and no
# groups (DeepSeek-V3's arithmetic otherwise: `Experts.scores` "sigmoid")
_SIGMOID_PLAIN = ("flint",)
# families whose choice is their float32 logits plus the bias, their weights those logits'
# sigmoid (`Experts.bias_on_logits`)
_BIAS_ON_LOGITS = ("kolibri1",)
# families whose router's logits are F.linear(x.float(), W.float()) in any dtype while
# transformers loads W in the model's dtype: W is kept in float32 here, so the runner's product
# is that one (DeepSeek-V3's router and its kin, HunYuan's and Flint's, are float32 as loaded)
_ROUTER_FLOAT32 = ("kolibri1", "beam")
# families whose grouped choice (DeepSeek-V3's) is over softmax scores (`Experts.scores`)
_SOFTMAX_CHOICE = ("mistral4", "ernie4_5_moe", "deepseek_v2")


def _experts(cfg, mlp, device) -> Experts:
    """A sparse MoE block's router, experts (transformers' [E, 2I, H] and [E, H, I] tensors,
    an expert a view of them) and shared expert."""
    ex = mlp.experts
    if getattr(ex, "has_bias", False):
        raise ModelLoadError(f"{cfg.model_type}: experts with biases are not supported by the "
                             "runner")
    # Aria's experts hold [E, H, 2I] and [E, I, H] (the runner's [2I, H] and [H, I] transposed)
    flip = ((lambda w: _in_out(w, device)) if getattr(ex, "is_transposed", False)
            else (lambda w: _t(w, device)))
    shared = next((getattr(mlp, n) for n in ("shared_expert", "shared_experts", "shared_mlp")
                   if getattr(mlp, n, None) is not None), None)
    gate = getattr(mlp, "shared_expert_gate", None)  # (Qwen2-MoE's; the others' are not gated)
    router = mlp.gate if hasattr(mlp, "gate") else mlp.router  # (Granite-MoE's, AFMoE's name)
    weight = getattr(router, "weight", None)
    if weight is None:  # AFMoE's router holds a gate; HunYuan's, `wg`, float32 as its weights;
        # Ergo's, `linear` (float32 logits of a float32 weight)
        weight = next(getattr(router, n) for n in ("gate", "wg", "linear")
                      if hasattr(router, n)).weight
    after = cfg.model_type in (*_TOP_K_THEN_SOFTMAX, *_TOP_K_THEN_SOFTMAX_IN_DTYPE)
    # DeepSeek-V2's: softmax scores, the top k of all ("greedy") or of the best groups, a group
    # scored by its best; the weights not normalised, times routed_scaling_factor, float32
    method = getattr(router, "topk_method", None)
    # DeepSeek-V3's router keeps its bias (MiniMax-M2's block, ERNIE's `moe_statics`, AFMoE's
    # block as `expert_bias` keep it); its class has groups (Mistral 4's has groups, no bias)
    statics = getattr(router, "moe_statics", None)
    bias = getattr(router, "e_score_correction_bias",
                   getattr(mlp, "e_score_correction_bias", getattr(mlp, "expert_bias", None)))
    bias = statics.e_score_correction_bias.reshape(-1) if statics is not None else bias
    groups = None if method == "greedy" else getattr(router, "num_group", None)
    softmax = cfg.model_type in _SOFTMAX_CHOICE
    if hasattr(router, "router_jitter_noise"):  # Phi-MoE's
        grouped = dict(scores="sparsemixer", jitter=float(router.router_jitter_noise))
    elif bias is None and groups is None and method is None and cfg.model_type not in _SIGMOID_PLAIN:
        grouped = {}
    else:
        scale = next((getattr(router, n) for n in ("routed_scaling_factor", "route_scale",
                                                   "router_scaling_factor")
                      if hasattr(router, n)), 1.0)
        grouped = dict(
            scores="softmax" if softmax else "sigmoid",
            score_bias=None if bias is None else _t(bias, device),
            norm_eps=0.0 if cfg.model_type in ("minimax_m2", *_SIGMOID_PLAIN, *_BIAS_ON_LOGITS)
            else 1e-20, bias_on_logits=cfg.model_type in _BIAS_ON_LOGITS,
            groups=(int(groups), int(router.topk_group)) if groups and groups > 1 else None,
            group_top=1 if method else 2, norm_min=getattr(router, "norm_min", None),
            scale=float(scale))
    return Experts(
        router=_t(weight, device).float() if cfg.model_type in _ROUTER_FLOAT32 else _t(weight, device),
        # (experts not gated, Ergo's: their up projections, `Weights.gated` False)
        gate_up=[flip(w) for w in (ex.gate_up_proj if hasattr(ex, "gate_up_proj") else ex.up_proj)],
        down=[flip(w) for w in ex.down_proj],
        top_k=int(router.top_k),
        norm_topk=bool(getattr(router, "norm_topk_prob", not after and method is None)),
        softmax_after_topk=after, router_float32=cfg.model_type in _TOP_K_THEN_SOFTMAX,
        # (HunYuan's weights are in its router's dtype)
        weights_in_dtype=(weight.dtype != torch.float32 if hasattr(router, "wg") else
                          cfg.model_type not in _TOP_K_FLOAT32 and method is None
                          and grouped.get("scores") != "sigmoid"),
        shared_gate_up=None if shared is None else _gate_up(shared, device),
        shared_down=None if shared is None else _t(shared.down_proj.weight, device),
        shared_gate=None if gate is None else _t(gate.weight, device),
        shared_gate_up_b=None if shared is None else _gate_up(shared, device, "bias"),
        shared_down_b=None if shared is None else _bias(shared.down_proj, device),
        **grouped)


def _mla(cfg, a, device) -> tuple[torch.Tensor, torch.Tensor | None, MLA]:
    """A latent attention's first product (its weight and bias) and its `MLA`."""
    hq, nope, pe, v, rank = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.v_head_dim, cfg.kv_lora_rank)
    d = nope + pe
    if v > d:
        raise ModelLoadError(f"{cfg.model_type}: a value wider than the key ({v} > {d}) is not "
                             "supported by the runner")
    # DeepSeek-V3's interleaved RoPE pairs (`rope_interleave`) reordered to halves, as
    # transformers reorders them before rotating; DeepSeek-V2's (complex numbers) too in
    # float32, else left for the runner to multiply in place (`_complex_pairs`)
    kv_a = a.kv_a_proj_with_mqa
    # (DeepSeek-V3.2's and GLM-MoE-DSA's attention rotates interleaved pairs always: their
    # configs have no field)
    interleave = getattr(cfg, "rope_interleave", cfg.model_type in (
        "deepseek_v2", "longcat_flash", *_DENSE_UP_TO_TOPK))
    halves = interleave and not _complex_pairs(cfg, kv_a.weight.dtype)
    pairs = _halves_order(pe, pe) if halves else torch.arange(pe)
    head = torch.cat([torch.arange(nope), nope + pairs])  # a head's q: nope, then pe
    q_order = (torch.arange(hq)[:, None] * d + head[None]).reshape(-1)
    kv_order = torch.cat([torch.arange(rank), rank + pairs])
    # q = q_b(norm(q_a x)), else q_proj x in the first product (A.X-K1's module has no q_proj)
    low_rank = getattr(a, "q_proj", None) is None
    first = a.q_a_proj if low_rank else a.q_proj
    w_first = first.weight if low_rank else first.weight[q_order]
    w_qkv = _t(torch.cat([w_first, kv_a.weight[kv_order]]), device)
    b_qkv = None
    if kv_a.bias is not None:
        b_first = first.bias if first.bias is not None else torch.zeros(w_first.shape[0],
                                                                        dtype=kv_a.bias.dtype)
        b_qkv = _t(torch.cat([b_first, kv_a.bias[kv_order]]), device)
    mla = MLA(q_rows=w_first.shape[0],
              q_norm=_t(a.q_a_layernorm.weight, device) if low_rank else None,
              q_b=_t(a.q_b_proj.weight[q_order], device) if low_rank else None,
              kv_norm=_t(a.kv_a_layernorm.weight, device), kv_b=_t(a.kv_b_proj.weight, device),
              rank=rank, nope=nope, pe=pe, v=v, eps=float(a.kv_a_layernorm.variance_epsilon))
    return w_qkv, b_qkv, mla


def _complex_pairs(cfg, dtype: torch.dtype) -> bool:
    """Whether a latent attention's RoPE rotates interleaved pairs in place
    (`Layer.rope_pairs`): DeepSeek-V2's outside float32, where transformers multiplies them as
    complex numbers in float32 (the runner's `_rope` over a float32 table is that arithmetic)."""
    return cfg.model_type == "deepseek_v2" and dtype != torch.float32


def _block(lyr, device, cfg=None, qkv=None, **kw) -> Layer:
    """A decoder layer's projections in the runner's layout (fused QKV and gate/up, from
    separate q/k/v and gate/up projections; a latent attention's, `_mla`; a sparse MoE
    block's experts, `_experts`, which needs the `cfg`); `qkv`: the first product's weight
    and bias where the family lays them out itself; the family's norms, window and the rest
    in `kw`."""
    a = lyr.self_attn
    mlp = lyr.mlp if hasattr(lyr, "mlp") else lyr.block_sparse_moe  # (Granite-MoE's name)
    if qkv is not None:
        w_qkv, bias = qkv
    elif hasattr(a, "kv_a_proj_with_mqa"):
        w_qkv, bias, kw["mla"] = _mla(cfg, a, device)
        kw["rope_pairs"] = _complex_pairs(cfg, w_qkv.dtype)
    elif hasattr(a, "q_gate_proj") or hasattr(a, "gate_proj"):  # an output gate (`out_gate`)
        w_qkv, bias = _gated_attention(cfg, a, device)
        kw["out_gate"] = True
    else:
        w_qkv, bias = _attention(a, device)
    kw.update(_output_biases(a, mlp, device))
    if hasattr(mlp, "experts"):
        ffn = dict(w_gate_up=None, w_down=None, moe=_experts(cfg, mlp, device))
    else:
        ffn = dict(w_gate_up=_gate_up(mlp, device), w_down=_t(mlp.down_proj.weight, device))
    return Layer(w_qkv=w_qkv, b_qkv=bias, w_o=_t(a.o_proj.weight, device), **ffn, **kw)


def _embed_and_head(hf, embed: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding table and the LM head's weight: the same tensor where they are tied.
    (The head is `lm_head`, or where that is not a product, what the model names its output
    embeddings: GPT-NeoX Japanese's `embed_out`, ModernBERT-decoder's `decoder`.)"""
    embed = _t(embed, device)
    if hf.config.tie_word_embeddings:
        return embed, embed
    head = getattr(hf, "lm_head", None)
    if not hasattr(head, "weight"):
        head = hf.get_output_embeddings()
    return embed, _t(head.weight, device)


def _common(hf, device, layers: list[Layer], norm: torch.Tensor | None = None,
            ropes: list | None = None, **kw) -> Weights:
    cfg, m = hf.config, hf.model
    embed, lm_head = _embed_and_head(hf, m.embed_tokens.weight, device)
    if ropes is None:
        ropes = [_rope_table(m.rotary_emb, max_positions(cfg), embed.dtype, device)]
    kw.setdefault("activation", getattr(cfg, "hidden_act", None) or "silu")
    kw.setdefault("lm_head_b", None if cfg.tie_word_embeddings else _bias(hf.lm_head, device))
    return Weights(layers, embed, _t(m.norm.weight, device) if norm is None else norm, lm_head,
                   ropes, head_dim(cfg), **kw)


def _llama(hf, device) -> Weights:
    """Llama (biases on o_proj and the MLP where `attention_bias` / `mlp_bias` put them),
    Mistral, Ministral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm before
    RoPE); Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5 (`glm4_moe`: partial rotary, q/k norms
    optional), dots.llm1 and Solar Open, the same blocks with a mixture of experts in some or
    all of the MLPs (`Experts`)."""
    cfg = hf.config
    # a RoPE table a layer type where the config gives each its own (Mellum's)
    ropes, rope, _ = _ropes(cfg, hf.model, device, per_kind="" not in _rope_params(cfg))
    layers = [_block(lyr, device, cfg, ln_attn_in=_t(lyr.input_layernorm.weight, device),
                     ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device),
                     qk_norm=_qk_norm(cfg, lyr.self_attn, device), window=_window(cfg, i),
                     rope=rope[i])
              for i, lyr in enumerate(hf.model.layers)]
    return _common(hf, device, layers, ropes=ropes)


def _without_rope(w: Weights, nope: list[int]) -> Weights:
    """Layers `nope` read an identity RoPE table (cos 1, sin 0, as wide as the model's own so
    one fused pass serves every layer), which leaves q and k bit for bit as they are:
    x * 1 - y * 0 = x. It is a stride-0 view, so it costs no memory (and the layers rotate
    no pairs in place, so `_pair_tables` leaves it as it is)."""
    if nope:
        cos = w.ropes[0][0]
        w.ropes.append(_identity_rope(*cos.shape, cos.dtype, cos.device))
        for i in nope:
            w.layers[i].rope, w.layers[i].rope_pairs = len(w.ropes) - 1, False
    return w


def _smollm3(hf, device) -> Weights:
    """SmolLM3: Llama's block, without RoPE on the layers `no_rope_layers` marks 0 (every
    fourth by default: `_without_rope`)."""
    w = _llama(hf, device)
    return _without_rope(w, [i for i, use in enumerate(hf.config.no_rope_layers) if not use])


def _granite(hf, device) -> Weights:
    """Granite and Granite-MoE: Llama's block (Mixtral's, with its router's softmax over the
    top-k float32 logits; Granite-MoE-Shared adds a shared MLP, not gated by the router, as the
    experts' shared expert) with four multipliers. The embedding's is `embed_scale`, the
    attention's is its scale, and the logits are divided by `logits_scaling`. The residual
    multiplier is folded into o_proj and down_proj (`_fold_residual`), so the fused pass
    serves Granite. Granite-SWA (and its MoE) adds sliding layers and attention sinks
    (`Layer.sinks`, `Weights.sinks_lse`: transformers scales the output by
    sigmoid(lse - sink), which equals one more logit in the softmax). HyperCLOVAX norms each
    branch's output before the residual multiplier, which is then folded into those norms'
    weights, and multiplies its logits by `logits_scaling`."""
    cfg = hf.config
    w = _llama(hf, device)
    m = float(cfg.residual_multiplier)
    clova = cfg.model_type == "hyperclovax"
    for lyr, src in zip(w.layers, hf.model.layers):
        shared = getattr(src, "shared_mlp", None)  # Granite-MoE-Shared's shared MLP
        if shared is not None:
            lyr.moe.shared_gate_up = _t(shared.input_linear.weight, device)
            lyr.moe.shared_down = _t(shared.output_linear.weight, device)
        if getattr(src.self_attn, "sinks", None) is not None:
            lyr.sinks, w.sinks_lse = _t(src.self_attn.sinks, device), True
        if clova and cfg.use_post_norm:
            lyr.ln_attn_out = _t(src.post_norm1.weight * m, device)
            lyr.ln_mlp_out = _t(src.post_norm2.weight * m, device)
    return _granite_scales(w, cfg, fold=not (clova and cfg.use_post_norm), clova=clova)


def _granite_scales(w: Weights, cfg, fold: bool = True, clova: bool = False) -> Weights:
    """Granite's multipliers: the residual one folded into o_proj and down_proj
    (`_fold_residual`, where `fold`), the attention's as its scale, the embedding's, and the
    logits divided by `logits_scaling` (HyperCLOVAX's multiplied)."""
    if fold:
        _fold_residual(w, float(cfg.residual_multiplier))
    w.attn_scale = float(cfg.attention_multiplier)
    if float(cfg.embedding_multiplier) != 1.0:
        w.embed_scale, w.embed_scale_number = float(cfg.embedding_multiplier), True
    if float(cfg.logits_scaling) != 1.0:  # (HyperCLOVAX multiplies, Granite divides)
        setattr(w, "logit_scale" if clova else "logit_divisor", float(cfg.logits_scaling))
    return w


def _granite_hybrid(hf, device) -> Weights:
    """Granite 4.0 (`granitemoehybrid`) where every layer is attention (Granite 4.0 Micro's
    kind): Granite's multipliers over Llama's block, whose MLP is its shared MLP (gate and up
    in one product) beside, where it has experts, Granite-MoE's mixture (the top k's softmax
    in float32); RoPE, or none where `position_embedding_type` is not "rope" (an identity
    table). Its hybrids' Mamba layers hold a state, not a KV cache, and are refused."""
    cfg, m = hf.config, hf.model
    mamba = [i for i, lyr in enumerate(m.layers) if lyr.mamba is not None]
    if mamba:
        raise ModelLoadError(f"granitemoehybrid: layers {mamba} are Mamba layers (a state-space "
                             "layer's state is not a KV cache to compress); only checkpoints "
                             "whose layers are all attention are supported by the runner")
    layers = []
    for src in m.layers:
        a, shared, sparse = src.self_attn, src.shared_mlp, src.block_sparse_moe
        w_qkv, b_qkv = _attention(a, device)
        gate_up, down = _t(shared.input_linear.weight, device), _t(shared.output_linear.weight, device)
        moe = None
        if sparse is not None:  # (its shared MLP is the layer's, as Granite-MoE-Shared's)
            moe = _experts(cfg, sparse, device)
            moe.shared_gate_up, moe.shared_down = gate_up, down
        layers.append(Layer(ln_attn_in=_t(src.input_layernorm.weight, device), w_qkv=w_qkv,
                            b_qkv=b_qkv, w_o=_t(a.o_proj.weight, device), b_o=_bias(a.o_proj, device),
                            ln_mlp_in=_t(src.post_attention_layernorm.weight, device),
                            w_gate_up=None if moe else gate_up, w_down=None if moe else down,
                            moe=moe))
    n, dtype = max_positions(cfg), m.embed_tokens.weight.dtype
    ropes = [_rope_table(m.rotary_emb, n, dtype, device) if m.rotary_emb is not None
             else _identity_rope(n, head_dim(cfg), dtype, device)]
    return _granite_scales(_common(hf, device, layers, ropes=ropes), cfg)


# vision-language checkpoints whose language model the runner serves on text prompts;
# transformers loads those not in its causal-LM table as image-text-to-text models
# (`vericache.model.loader`)
VISION_LANGUAGE = ("gemma3", "mistral3", "llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                   "apertus1p5", "fuyu", "aria", "llava_next", "llava_next_video",
                   "llava_onevision", "vipllava", "video_llava", "internvl", "aya_vision",
                   "cohere2_vision", "idefics2", "idefics3", "smolvlm", "deepseek_vl", "got_ocr2",
                   "video_llama_3", "ovis2", "lighton_ocr", "qianfan_ocr", "exaone4_5",
                   "hyperclovax_vision_v2", "qwen3_vl_moe", "kimi_k25", "ovis2_5", "janus",
                   "mllama", "emu3", "cohere_compass")
# ... of those, the ones whose causal-LM class does not load their checkpoints (Mllama's and
# Emu3's take their text config), so they load as image-text-to-text too
# (`loader.transformers_class`)
VISION_LANGUAGE_ONLY = ("mllama", "emu3")


# vision-language checkpoints whose logits are lm_head(h) though their language model scales
# its own (Cohere 2 Vision's, with Cohere 2 inside; Aya Vision's scale them as Cohere 2 does)
_NO_LOGIT_SCALE = ("cohere2_vision",)


def _language_model(hf, device) -> Weights:
    """A vision-language checkpoint (VISION_LANGUAGE: Gemma 3 4B and up, Mistral 3, LLaVA and
    its variants, the Qwen VL models, Apertus 1.5, Fuyu, Aria, InternVL, Idefics, ...): its
    language model (`text_config`, `model.language_model` or `model.text_model`, `lm_head`),
    taken by its own family's function, served on text prompts; the vision tower is not taken.
    Their transformers classes compute the logits as lm_head(h) alone:
    Gemma3ForConditionalGeneration applies no final-logit soft-cap (Gemma3ForCausalLM does; the
    released checkpoints set none), so neither does the runner here. The Qwen VL models'
    multimodal RoPE gives a text token the same position in each of its three sections, so their
    rotary module's table at positions 0..n-1 is the one RoPE table the runner needs (Qwen3-VL's
    deepstack features join only with images)."""
    text = hf.config.get_text_config()
    fn = FAMILIES.get(text.model_type)
    if fn is None or text.model_type in VISION_LANGUAGE:
        raise ModelLoadError(f"{hf.config.model_type}'s language model {text.model_type!r} is not "
                             f"supported by the runner; supported: {', '.join(SUPPORTED)}")
    # (Idefics3's and SmolVLM's language model is their `text_model`)
    lm = getattr(hf.model, "language_model", None) or hf.model.text_model
    w = fn(SimpleNamespace(config=text, model=lm, lm_head=hf.lm_head), device)
    w.final_softcap = None
    if hf.config.model_type in _NO_LOGIT_SCALE:
        w.logit_scale = None
    return w


def _olmo2(hf, device) -> Weights:
    """OLMo 2 and 3: post-norm blocks (no norm before attention or the MLP, one after each,
    added to the residual), norms that scale in fp32 then cast (`norm_upcast`, as Gemma's,
    with the weight itself), and RMSNorms over the whole q and k projections, not per head,
    before RoPE (`qk_norm_wide`). OLMo 3 adds sliding-window layers with a RoPE table of their
    own; FlexOLMo a mixture of experts (OLMoE's router) for every MLP."""
    cfg, m = hf.config, hf.model

    def f32(w):
        return _t(w.float(), device)

    ropes, rope, _ = _ropes(cfg, m, device, per_kind=cfg.model_type == "olmo3")
    layers = [_block(lyr, device, cfg, ln_attn_in=None, ln_mlp_in=None,
                     ln_attn_out=f32(lyr.post_attention_layernorm.weight),
                     ln_mlp_out=f32(lyr.post_feedforward_layernorm.weight),
                     qk_norm_wide=f32(torch.cat([lyr.self_attn.q_norm.weight,
                                                 lyr.self_attn.k_norm.weight])),
                     window=_window(cfg, i), rope=rope[i])
              for i, lyr in enumerate(m.layers)]
    return _common(hf, device, layers, ropes=ropes, norm=f32(m.norm.weight), norm_upcast=True)


def _olmoe(hf, device) -> Weights:
    """OLMoE and MiniMax-M2: Llama's pre-norm block with RMSNorms over the whole q and k
    projections (`qk_norm_wide`, Llama's norm) and a mixture of experts for every MLP
    (MiniMax-M2's router: `Experts.sigmoid`, without groups). A checkpoint that clips q/k/v
    (`clip_qkv`) is refused."""
    cfg = hf.config
    if getattr(cfg, "clip_qkv", None) is not None:
        raise ModelLoadError("OLMoE with clip_qkv is not supported by the runner")
    layers = [_block(lyr, device, cfg, ln_attn_in=_t(lyr.input_layernorm.weight, device),
                     ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device),
                     qk_norm_wide=_t(torch.cat([lyr.self_attn.q_norm.weight,
                                                lyr.self_attn.k_norm.weight]), device))
              for lyr in hf.model.layers]
    return _common(hf, device, layers)


def _halves_order(d: int, rot: int) -> torch.Tensor:
    """The order that takes the first `rot` of `d` entries from interleaved pairs (x[2i],
    x[2i + 1]) to halves (x[i], x[i + rot/2]): the even ones, then the odd, then the rest (a
    head's dims for RoPE; GPT-OSS's gate/up columns)."""
    return torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, d)])


def _interleaved_rope(layers: list[Layer], cfg, rot: int) -> None:
    """For a RoPE over interleaved pairs (Cohere's, GLM's, over each head's first `rot` dims):
    in float32, q's and k's projection rows (and biases) reordered in each head to the halves
    Llama's RoPE pairs (x[i], x[i + rot/2]), `_halves_order`, which the native kernels
    rotate. q and k reordered alike leave every score as it was, up to the order its
    products are summed in (v is not reordered), and the rotation is the same arithmetic on
    each pair. In other dtypes, where that order shows, the rows stay and the layers rotate
    their pairs in place (`Layer.rope_pairs`)."""
    if layers and layers[0].w_qkv.dtype != torch.float32:
        for layer in layers:
            layer.rope_pairs = True
        return
    hq, hkv, d = cfg.num_attention_heads, kv_heads(cfg), head_dim(cfg)
    order = _halves_order(d, rot)

    def halves(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.reshape(heads, d, *t.shape[1:])[:, order.to(t.device)].reshape(t.shape)

    def reorder(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        q, k, v = t[: hq * d], t[hq * d: (hq + hkv) * d], t[(hq + hkv) * d:]
        return torch.cat([halves(q, hq), halves(k, hkv), v]).contiguous()

    for layer in layers:
        layer.w_qkv, layer.b_qkv = reorder(layer.w_qkv), reorder(layer.b_qkv)
        if layer.qk_norm is not None:  # per-head q/k norms' weights follow their rows (Ergo's)
            layer.qk_norm = layer.qk_norm[:, order.to(layer.qk_norm.device)].contiguous()


def _cohere(hf, device) -> Weights:
    """Cohere (Command R) and Cohere 2 (Command R7B, Command A): attention and MLP in parallel on
    one LayerNorm's output (`parallel`, `layer_norm`), RoPE over interleaved pairs (in
    float32 q and k rows reordered, `_interleaved_rope`, and the table with them), logits times
    `logit_scale`. Cohere computes RoPE in float32, so the table is float32 (its values the
    model dtype's, as transformers' rotary module gives them). Cohere 2's full-attention
    layers have no RoPE (`_without_rope`). Cohere 2 MoE: Cohere 2's block with experts after
    its dense prefix layers (full attention with RoPE where `prefix_dense_sliding_window_
    pattern` is 1), its router the softmax of the top k logits; RMSNorms where it sets
    `rms_norm_eps`; where it averages the routed and shared experts' outputs, the 0.5 is in
    the routed weights (`Experts.scale`) and the shared expert's down_proj, exactly (a power
    of two). Checkpoints with q/k LayerNorms (`use_qk_norm`) and Cohere 2 MoE's sigmoid
    router (its sigmoid in the logits' dtype) are refused."""
    cfg, m = hf.config, hf.model
    if getattr(cfg, "use_qk_norm", False):
        raise ModelLoadError("Cohere with q/k LayerNorms (use_qk_norm) is not supported by the "
                             "runner")
    if getattr(cfg, "expert_selection_fn", "softmax") != "softmax":
        raise ModelLoadError(f"Cohere 2 MoE's {cfg.expert_selection_fn!r} router is not "
                             "supported by the runner (its softmax router is)")
    strategy = getattr(cfg, "shared_expert_combination_strategy", "sum")
    if getattr(cfg, "num_shared_experts", 0) and strategy not in ("sum", "average"):
        raise ModelLoadError(f"Cohere 2 MoE's {strategy!r} combination of experts is not "
                             "supported by the runner")
    d = head_dim(cfg)
    layers = [_block(lyr, device, cfg, ln_attn_in=_t(lyr.input_layernorm.weight, device),
                     ln_mlp_in=None, parallel=True, window=_window(cfg, i))
              for i, lyr in enumerate(m.layers)]
    _interleaved_rope(layers, cfg, d)
    cos, sin = _rope_table(m.rotary_emb, max_positions(cfg), m.embed_tokens.weight.dtype, device)
    order = _halves_order(d, d).to(cos.device)  # the table's interleaved pairs, in halves
    ropes = [(_t(cos[:, order].float(), device), _t(sin[:, order].float(), device))]
    # Cohere 2 MoE's RMSNorms (the field means nothing to the others' configs)
    rms = cfg.rms_norm_eps if cfg.model_type == "cohere2_moe" else None
    w = _common(hf, device, layers, ropes=ropes, logit_scale=float(cfg.logit_scale),
                layer_norm=rms is None, eps=cfg.layer_norm_eps if rms is None else rms)
    if cfg.model_type in ("cohere2", "cohere2_moe"):
        _without_rope(w, [i for i, t in enumerate(cfg.layer_types) if t != "sliding_attention"
                          and not getattr(m.layers[i].self_attn, "force_rope", False)])
    if getattr(cfg, "num_shared_experts", 0) and strategy == "average":
        for lyr in w.layers:
            if lyr.moe is not None:
                lyr.moe.scale, lyr.moe.shared_down = 0.5, lyr.moe.shared_down * 0.5
    return w


def _diffllama(hf, device) -> Weights:
    """DiffLlama: Llama's block with differential attention. Each query head's scores (over
    its K/V head's keys, GQA as Llama's) weigh two values, the K/V head's pair's (heads g mod
    Hkv/2 and that + Hkv/2, transformers' two calls over the value's halves), so the cache
    holds a head as 2D: the key padded with zeros (q too: the scores are the D-wide ones,
    scaled by D^-0.5) and the two values side by side, each row of the first product laid out
    so (twice the model's K/V bytes). Then `Layer.diff`: the first half of the heads' 2D-wide
    output less λ times the second half's, RMS-normed, times 1 - λ_init."""
    from transformers.models.diffllama.modeling_diffllama import lambda_init_fn

    cfg, m = hf.config, hf.model
    hq, hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    d, dtype = D // 2, m.embed_tokens.weight.dtype
    half = hkv // 2
    pair = [(g % half, g % half + half) for g in range(hkv)]  # each K/V head's two values

    def laid(t: torch.Tensor | None) -> torch.Tensor | None:  # q, k padded; v's pairs
        if t is None:
            return None
        q, k, v = t.split([hq * d, hkv * d, hkv * d])
        q, k, v = (x.reshape(-1, d, *t.shape[1:]) for x in (q, k, v))
        pad = torch.cat([q, torch.zeros_like(q)], 1), torch.cat([k, torch.zeros_like(k)], 1)
        return torch.cat([pad[0].reshape(-1, *t.shape[1:]), pad[1].reshape(-1, *t.shape[1:]),
                          torch.cat([torch.cat([v[a], v[b]]) for a, b in pair])])

    layers = []
    for i, lyr in enumerate(m.layers):
        a = lyr.self_attn
        w_qkv, b_qkv = (_t(laid(t), device) if t is not None else None
                        for t in _attention(a, device))
        layer = _block(lyr, device, cfg, qkv=(w_qkv, b_qkv),
                       ln_attn_in=_t(lyr.input_layernorm.weight, device),
                       ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device))
        lam1, lam2 = (torch.exp(torch.sum(x * y, dim=-1, dtype=torch.float32)).to(dtype)
                      for x, y in ((a.lambda_q1, a.lambda_k1), (a.lambda_q2, a.lambda_k2)))
        init = lambda_init_fn(i)
        layer.diff = (_t(lam1 - lam2 + init, device), init)
        layers.append(layer)
    return _common(hf, device, layers, attn_scale=d ** -0.5)


def _modernbert_decoder(hf, device) -> Weights:
    """ModernBERT-decoder (Ettin's decoders): a LayerNorm on the embedding (`embed_norm`),
    pre-norm blocks of LayerNorms (biases where `norm_bias`; none before the first layer's
    attention), q/k/v and the output with biases where `attention_bias`, a gated MLP whose
    first half is activated (Wi) with biases where `mlp_bias`, sliding on the layers
    `layer_types` marks with a RoPE table a layer type (RoPE in float32, as transformers
    computes it); after the final norm a prediction head (dense, activation, LayerNorm:
    `Weights.head_dense`) before the LM head (`decoder`, with its bias where
    `decoder_bias`)."""
    cfg, m = hf.config, hf.model
    ropes, rope, _ = _ropes(cfg, m, device, per_kind=True,
                            dtype=m.embeddings.tok_embeddings.weight.dtype)
    # (its RoPE in float32, over the model dtype's table: a float32 table, `Runner._rope`)
    ropes = [tuple(t.float() for t in table) for table in ropes]
    layers = []
    for i, lyr in enumerate(m.layers):
        a, mlp = lyr.attn, lyr.mlp
        first = isinstance(lyr.attn_norm, torch.nn.Identity)  # (the first layer's)
        w_qkv, b_qkv = _attention(a, device)
        layers.append(Layer(
            ln_attn_in=None if first else _t(lyr.attn_norm.weight, device),
            ln_attn_in_b=None if first else _bias(lyr.attn_norm, device),
            w_qkv=w_qkv, b_qkv=b_qkv, w_o=_t(a.Wo.weight, device), b_o=_bias(a.Wo, device),
            ln_mlp_in=_t(lyr.mlp_norm.weight, device), ln_mlp_in_b=_bias(lyr.mlp_norm, device),
            w_gate_up=_t(mlp.Wi.weight, device), b_gate_up=_bias(mlp.Wi, device),
            w_down=_t(mlp.Wo.weight, device), b_down=_bias(mlp.Wo, device),
            window=_window(cfg, i), rope=rope[i]))
    emb, head = m.embeddings, hf.lm_head
    embed, lm_head = _embed_and_head(hf, emb.tok_embeddings.weight, device)
    return Weights(layers, embed, _t(m.final_norm.weight, device), lm_head, ropes, head_dim(cfg),
                   activation=cfg.hidden_activation, layer_norm=True, eps=cfg.norm_eps,
                   norm_b=_bias(m.final_norm, device), lm_head_b=_bias(hf.decoder, device),
                   embed_norm=_t(emb.norm.weight, device), embed_norm_b=_bias(emb.norm, device),
                   head_dense=_t(head.dense.weight, device), head_dense_b=_bias(head.dense, device),
                   head_activation=cfg.classifier_activation,
                   head_norm=_t(head.norm.weight, device), head_norm_b=_bias(head.norm, device))


def _jetmoe(hf, device) -> Weights:
    """JetMoE: Llama's pre-norm block, with a mixture of attention heads (`Layer.moa`: each
    row's top_k experts give its queries, one a K/V head, and take their output back; K/V
    from the shared kv_proj) and a mixture of experts for the MLP, both routed by the top k
    float32 logits' softmax, cast to the model's dtype, each with a bias on its summed output
    (`Experts.out_b`). Its layers' RMSNorms take eps 1e-6 whatever the config says, its final
    norm the config's (`Weights.final_eps`)."""
    cfg, m = hf.config, hf.model

    def mixture(mod) -> Experts:  # (the experts' [E, out, in] tensors, an expert a view)
        return Experts(router=_t(mod.router.layer.weight, device),
                       gate_up=[_t(w, device) for w in mod.input_linear.weight],
                       down=[_t(w, device) for w in mod.output_linear.weight],
                       top_k=cfg.num_experts_per_tok, norm_topk=False, weights_in_dtype=True,
                       softmax_after_topk=True, router_float32=True, out_b=_t(mod.bias, device))

    eps = {float(n.variance_epsilon) for lyr in m.layers
           for n in (lyr.input_layernorm, lyr.post_attention_layernorm)}
    if len(eps) != 1:
        raise ModelLoadError(f"JetMoE whose layers' norms take different epsilons {sorted(eps)} "
                             "is not supported by the runner")
    layers = [Layer(ln_attn_in=_t(lyr.input_layernorm.weight, device),
                    w_qkv=_t(lyr.self_attention.kv_proj.weight, device), b_qkv=None, w_o=None,
                    ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device),
                    w_gate_up=None, w_down=None, moe=mixture(lyr.mlp),
                    moa=mixture(lyr.self_attention.experts))
              for lyr in m.layers]
    return _common(hf, device, layers, activation=cfg.activation_function, eps=eps.pop(),
                   final_eps=float(m.norm.variance_epsilon))


def _cohere_compass(hf, device) -> Weights:
    """Cohere Compass's language model (North): Cohere 2's parallel block on one LayerNorm
    without a bias, sliding on the layers `layer_types` marks, logits times `logit_scale`
    where it is set; RoPE over halves (not Cohere's interleaved pairs), in the model's dtype,
    a table a layer type that has parameters and none on a type whose parameters are None
    (`_without_rope`). Its multimodal RoPE gives a text token one position on all three
    axes, so its rotary module's table at positions 0..n-1 is the plain RoPE."""
    cfg, m = hf.config, hf.model
    ropes, rope, nope = _ropes(cfg, m, device, per_kind=True)
    layers = [_block(lyr, device, cfg, ln_attn_in=_t(lyr.input_layernorm.weight, device),
                     ln_mlp_in=None, parallel=True, window=_window(cfg, i), rope=rope[i])
              for i, lyr in enumerate(m.layers)]
    scale = None if cfg.logit_scale is None else float(cfg.logit_scale)
    w = _common(hf, device, layers, ropes=ropes, logit_scale=scale, layer_norm=True,
                eps=cfg.layer_norm_eps)
    return _without_rope(w, nope)


def _starcoder2(hf, device) -> Weights:
    """StarCoder 2: LayerNorms with biases, biases on every projection (`use_bias`), an MLP
    that is not gated (c_fc, the activation, c_proj), sliding window on every layer."""
    cfg, m = hf.config, hf.model
    layers = []
    for i, lyr in enumerate(m.layers):
        a, mlp = lyr.self_attn, lyr.mlp
        w_qkv, b_qkv = _attention(a, device)
        layers.append(Layer(
            ln_attn_in=_t(lyr.input_layernorm.weight, device),
            ln_attn_in_b=_bias(lyr.input_layernorm, device),
            w_qkv=w_qkv, b_qkv=b_qkv, w_o=_t(a.o_proj.weight, device), b_o=_bias(a.o_proj, device),
            ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device),
            ln_mlp_in_b=_bias(lyr.post_attention_layernorm, device),
            w_gate_up=_t(mlp.c_fc.weight, device), b_gate_up=_bias(mlp.c_fc, device),
            w_down=_t(mlp.c_proj.weight, device), b_down=_bias(mlp.c_proj, device),
            window=_window(cfg, i)))
    return _common(hf, device, layers, layer_norm=True, norm_b=_bias(m.norm, device),
                   eps=cfg.norm_epsilon, gated=False)


def _layer_norms(hf, device, one_plus: bool = False) -> Weights:
    """Llama's block (`_block`: biases where the config puts them, an MLP not gated where it has
    no gate) with LayerNorms (with biases) for its norms: StableLM (RoPE on a quarter of each
    head; with `use_parallel_residual` the MLP beside the attention on the same norm), Jais 2
    and Nemotron (its LayerNorm1P scales by 1 + w, the sum in the weights' dtype as
    transformers forms it; RoPE on half of each head); Phi-MoE, with its experts (Phi-MoE's
    router, `_sparsemixer`). StableLM's q/k LayerNorms (`qk_layernorm`: one a head, without
    biases) are `Layer.qk_layer_norm`."""
    cfg, m = hf.config, hf.model

    def w(norm) -> torch.Tensor:
        return _t(norm.weight + 1.0 if one_plus else norm.weight, device)

    def qk(a) -> dict:  # StableLM's q/k LayerNorms, one a head
        if not getattr(cfg, "qk_layernorm", False):
            return {}
        heads = [n.weight for n in (*a.q_layernorm.norms, *a.k_layernorm.norms)]
        return dict(qk_layer_norm=True, qk_norm=_t(torch.stack(heads), device))

    layers = []
    for lyr in m.layers:
        post = lyr.post_attention_layernorm  # (None: StableLM's parallel block)
        layers.append(_block(lyr, device, cfg, ln_attn_in=w(lyr.input_layernorm),
                             ln_attn_in_b=_bias(lyr.input_layernorm, device),
                             ln_mlp_in=None if post is None else w(post),
                             ln_mlp_in_b=None if post is None else _bias(post, device),
                             parallel=post is None, **qk(lyr.self_attn)))
    mlp = m.layers[0].mlp
    return _common(hf, device, layers, norm=w(m.norm), norm_b=_bias(m.norm, device),
                   layer_norm=True, eps=m.norm.eps,
                   gated=hasattr(mlp, "gate_proj") or hasattr(mlp, "experts"),
                   # (Nemotron's LayerNorm1P: F.layer_norm over 1 + w, in the model's dtype)
                   torch_layer_norm="dtype" if one_plus else "")


def _flint(hf, device) -> Weights:
    """Flint: Qwen3-MoE's block (per-head q/k norms before RoPE, dense MLPs on
    `mlp_only_layers`) with attention sinks on every layer (`Layer.sinks`), RoPE on the
    sliding layers only (`_without_rope`), and experts whose router takes the sigmoid of its
    float32 logits, with no bias, normalised over the top k (`_SIGMOID_PLAIN`), beside a shared
    expert that is not gated. Its attention's scores and softmax are float32 in any dtype
    (`Weights.attn_float32`), and its norms scale in float32 (`norm_upcast`)."""
    cfg = hf.config
    w = _llama(hf, device)
    for lyr, src in zip(w.layers, hf.model.layers):
        lyr.sinks = _t(src.self_attn.sinks, device)
    w.attn_float32 = w.norm_upcast = True
    return _without_rope(w, [i for i, t in enumerate(cfg.layer_types)
                             if t != "sliding_attention" or not cfg.sliding_window])


def _hunyuan(hf, device) -> Weights:
    """HunYuan (dense and MoE): Llama's block with per-head q/k norms after RoPE
    (`Layer.qk_norm_after_rope`); the MoE's router is float32, softmax then top k,
    normalised, beside a shared MLP."""
    w = _llama(hf, device)
    for lyr in w.layers:
        lyr.qk_norm_after_rope = True
    return w


def _nanochat(hf, device) -> Weights:
    """nanochat: norms without weights (RMSNorm times ones, exact), one on the embedding
    (`Weights.embed_norm`), q/k norms after RoPE, RoPE whose rotation is flipped (its
    rotate_half is (x2, -x1): the table's sine negated, exact), an MLP not gated (ReLU²) and
    soft-capped logits."""
    cfg, m = hf.config, hf.model
    ones = torch.ones(cfg.hidden_size, dtype=m.embed_tokens.weight.dtype)
    layers = [Layer(ln_attn_in=_t(ones, device), w_qkv=w_qkv, b_qkv=b_qkv,
                    w_o=_t(lyr.self_attn.o_proj.weight, device), b_o=_bias(lyr.self_attn.o_proj, device),
                    ln_mlp_in=_t(ones, device), w_gate_up=_t(lyr.mlp.fc1.weight, device),
                    w_down=_t(lyr.mlp.fc2.weight, device),
                    qk_norm=_qk_norm(cfg, lyr.self_attn, device), qk_norm_after_rope=True)
              for lyr in m.layers for w_qkv, b_qkv in [_attention(lyr.self_attn, device)]]
    cos, sin = _rope_table(m.rotary_emb, max_positions(cfg), ones.dtype, device)
    return _common(hf, device, layers, norm=_t(ones, device), ropes=[(cos, -sin)],
                   embed_norm=_t(ones, device), gated=False,
                   final_softcap=cfg.final_logit_softcapping)


def _olmo(hf, device) -> Weights:
    """OLMo (the first): Llama's block with LayerNorms without weights or biases (ones, eps
    1e-5, transformers' F.layer_norm over a float32 copy, `torch_layer_norm` "float32") and
    q, k and v clamped to `clip_qkv` (`Layer.clip_qkv`)."""
    cfg, m = hf.config, hf.model
    ones = _t(torch.ones(cfg.hidden_size, dtype=m.embed_tokens.weight.dtype), device)
    layers = [_block(lyr, device, cfg, ln_attn_in=ones, ln_mlp_in=ones, clip_qkv=cfg.clip_qkv)
              for lyr in m.layers]
    return _common(hf, device, layers, norm=ones, layer_norm=True, eps=1e-5,
                   torch_layer_norm="float32")


def _apertus(hf, device) -> Weights:
    """Apertus: Llama's block (its norms named for their branches) with per-head q/k norms and
    an MLP not gated (up, xIELU, down), each layer's xIELU its own (`Layer.act`:
    transformers' module, its learned parameters)."""
    cfg = hf.config
    layers = [_block(lyr, device, cfg, ln_attn_in=_t(lyr.attention_layernorm.weight, device),
                     ln_mlp_in=_t(lyr.feedforward_layernorm.weight, device),
                     qk_norm=_qk_norm(cfg, lyr.self_attn, device),
                     act=lyr.mlp.act_fn.to(device) if isinstance(lyr.mlp.act_fn, torch.nn.Module)
                     else None)
              for lyr in hf.model.layers]
    return _common(hf, device, layers, gated=False)


def _arcee(hf, device) -> Weights:
    """Arcee (AFM): Llama's block with an MLP that is not gated (up, ReLU², down)."""
    w = _llama(hf, device)
    w.gated = False
    return w


def _interleaved(hf, device) -> Weights:
    """Helium, ERNIE 4.5 (and its MoE), GLM and GLM-4: Llama's block (biases where `attention_bias` /
    `use_bias` put them; GLM's gate and up one projection) with RoPE over interleaved pairs
    of each head's first dims, as wide as the table (`_interleaved_rope`; transformers' table
    is already in halves). ERNIE's table is float32 (RoPE in float32, then cast, as the
    runner does with such a table); Helium's norms scale in float32 (`norm_upcast`); GLM-4
    adds norms on each branch's output (`ln_attn_out`, `ln_mlp_out`, Llama's RMSNorm)."""
    kind = hf.config.model_type
    w = _llama(hf, device)
    _interleaved_rope(w.layers, hf.config, w.ropes[0][0].shape[1])
    if kind == "helium":
        w.norm_upcast = True
        for lyr in w.layers:
            lyr.ln_attn_in, lyr.ln_mlp_in = lyr.ln_attn_in.float(), lyr.ln_mlp_in.float()
        w.norm = w.norm.float()
    if kind == "glm4":
        _glm4_post_norms(w, hf, device)
    return w


def _glm4_post_norms(w: Weights, hf, device) -> None:
    """GLM-4's norms on each branch's output (`ln_attn_out`, `ln_mlp_out`), Kolibri-1's too."""
    for lyr, src in zip(w.layers, hf.model.layers):
        lyr.ln_attn_out = _t(src.post_self_attn_layernorm.weight, device)
        lyr.ln_mlp_out = _t(src.post_mlp_layernorm.weight, device)


def _phi(hf, device) -> Weights:
    """Phi (1, 1.5, 2): attention and MLP in parallel on one LayerNorm with a bias, biases on
    every projection and the LM head, an MLP not gated (fc1, the activation, fc2), partial
    rotary. Checkpoints with q/k LayerNorms (`qk_layernorm`) are refused."""
    cfg, m = hf.config, hf.model
    if getattr(cfg, "qk_layernorm", False):
        raise ModelLoadError("Phi with q/k LayerNorms (qk_layernorm) is not supported by the "
                             "runner")
    layers = []
    for lyr in m.layers:
        a, mlp = lyr.self_attn, lyr.mlp
        w_qkv, b_qkv = _attention(a, device)
        layers.append(Layer(
            ln_attn_in=_t(lyr.input_layernorm.weight, device),
            ln_attn_in_b=_bias(lyr.input_layernorm, device), parallel=True, branches_first=True,
            w_qkv=w_qkv, b_qkv=b_qkv, w_o=_t(a.dense.weight, device), b_o=_bias(a.dense, device),
            ln_mlp_in=None, w_gate_up=_t(mlp.fc1.weight, device), b_gate_up=_bias(mlp.fc1, device),
            w_down=_t(mlp.fc2.weight, device), b_down=_bias(mlp.fc2, device)))
    return _common(hf, device, layers, norm=_t(m.final_layernorm.weight, device),
                   norm_b=_bias(m.final_layernorm, device), lm_head_b=_bias(hf.lm_head, device),
                   layer_norm=True, eps=cfg.layer_norm_eps, gated=False)


def _exaone4(hf, device) -> Weights:
    """EXAONE 4: OLMo 2's post-norm block (a norm after each branch, none before) with
    Llama's RMSNorm and per-head q/k norms; where it slides (`sliding_window`), its global
    layers have no RoPE (`_without_rope`)."""
    cfg, m = hf.config, hf.model
    layers = [_block(lyr, device, cfg, ln_attn_in=None, ln_mlp_in=None,
                     ln_attn_out=_t(lyr.post_attention_layernorm.weight, device),
                     ln_mlp_out=_t(lyr.post_feedforward_layernorm.weight, device),
                     qk_norm=_qk_norm(cfg, lyr.self_attn, device), window=_window(cfg, i))
              for i, lyr in enumerate(m.layers)]
    w = _common(hf, device, layers)
    if cfg.sliding_window:
        _without_rope(w, [i for i, t in enumerate(cfg.layer_types) if t != "sliding_attention"])
    return w


def _kolibri(hf, device) -> Weights:
    """Kolibri-1: GLM-4's four norms a layer (before and after each branch), EXAONE 4's
    attention (per-head q/k norms; where it slides, RoPE on the sliding layers only), and
    experts on every layer beside a shared expert not gated, whose router chooses by its
    float32 logits plus a bias and weighs its choices by their sigmoid, normalised where
    `norm_topk_prob` (`Experts.bias_on_logits`)."""
    cfg = hf.config
    w = _llama(hf, device)
    _glm4_post_norms(w, hf, device)
    if cfg.sliding_window:
        _without_rope(w, [i for i, t in enumerate(cfg.layer_types) if t != "sliding_attention"])
    return w


def _q_scale(w: Weights, cfg, device) -> Weights:
    """Where the RoPE parameters have `llama_4_scaling_beta` (Ministral 3, Mistral 4): q scaled
    after RoPE by 1 + beta log(1 + floor(p / original_max_position_embeddings)) at position p
    (`q_scale`, computed as transformers computes it: float32, then the model's dtype),
    exactly 1 below the original context."""
    rp = cfg.rope_parameters
    beta, orig = rp.get("llama_4_scaling_beta"), rp.get("original_max_position_embeddings")
    if beta:
        p = torch.arange(max_positions(cfg))
        w.q_scale = _t((1 + beta * torch.log(1 + torch.floor(p / orig))).to(w.embed.dtype), device)
        w.q_scale_from = int(orig)
    return w


def _ministral3(hf, device) -> Weights:
    """Ministral 3: Mistral's block, YaRN RoPE, q scaled by its position (`_q_scale`)."""
    return _q_scale(_llama(hf, device), hf.config, device)


def _llama4(hf, device) -> Weights:
    """Llama 4's language model (`llama4_text`). Llama's block, and:
    - its RoPE layers (`no_rope_layers` 1) attend in chunks (`Chunk`: a row sees only its own
      `attention_chunk_size` chunk), their RoPE over interleaved pairs (transformers' complex
      table, taken in halves, and q/k rows reordered: `_interleaved_rope`), then per-head q/k
      norms without weights (ones, after RoPE) where `use_qk_norm`;
    - its other layers attend to every key without RoPE, q scaled by its position where
      `attn_temperature_tuning`: 1 + attn_scale log(1 + floor((p + 1) / floor_scale)), float32
      as transformers computes it, exactly 1 before floor_scale - 1 (`Weights.q_scale` on the
      layers `Layer.q_scaled`);
    - its MoE layers (`moe_layers`): each row's top-k router logits, their sigmoid, scale the
      chosen experts' input, not their output (`Experts.scale_input`; the experts stored
      [E, H, 2I] and [E, I, H], transposed here), beside a shared expert; its dense layers'
      MLP is `intermediate_size_mlp` wide."""
    cfg, m = hf.config, hf.model
    d, dtype = head_dim(cfg), m.embed_tokens.weight.dtype
    # the q/k norms have no weights: ones, one tensor for every layer
    ones = _t(torch.ones(cfg.num_attention_heads + cfg.num_key_value_heads, d, dtype=dtype),
              device)
    layers = []
    for i, lyr in enumerate(m.layers):
        a, ff = lyr.self_attn, lyr.feed_forward
        w_qkv, b_qkv = _attention(a, device)
        if hasattr(ff, "experts"):
            sh = ff.shared_expert
            ffn = dict(w_gate_up=None, w_down=None, moe=Experts(
                router=_t(ff.router.weight, device),
                gate_up=[_in_out(w, device) for w in ff.experts.gate_up_proj],
                down=[_in_out(w, device) for w in ff.experts.down_proj],
                top_k=int(ff.router.top_k), norm_topk=False, weights_in_dtype=True,
                shared_gate_up=_gate_up(sh, device), shared_down=_t(sh.down_proj.weight, device),
                scores="top_k_sigmoid", scale_input=True))
        else:
            ffn = dict(w_gate_up=_gate_up(ff, device), w_down=_t(ff.down_proj.weight, device))
        chunked = cfg.layer_types[i] == "chunked_attention"
        layers.append(Layer(
            ln_attn_in=_t(lyr.input_layernorm.weight, device), w_qkv=w_qkv, b_qkv=b_qkv,
            w_o=_t(a.o_proj.weight, device), b_o=_bias(a.o_proj, device),
            ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device), **ffn,
            qk_norm=ones if hasattr(a, "qk_norm") else None,
            qk_norm_after_rope=hasattr(a, "qk_norm"), q_scaled=not a.use_rope,
            window=Chunk(cfg.attention_chunk_size) if chunked else None))
    _interleaved_rope([lyr for lyr, a in zip(layers, (x.self_attn for x in m.layers))
                       if a.use_rope], cfg, d)
    w = _without_rope(_common(hf, device, layers),
                      [i for i, lyr in enumerate(m.layers) if not lyr.self_attn.use_rope])
    if cfg.attn_temperature_tuning:
        p = torch.arange(max_positions(cfg), dtype=torch.float32)
        w.q_scale = _t(torch.log1p(torch.floor((p + 1.0) / cfg.floor_scale)) * cfg.attn_scale
                       + 1.0, device)
        w.q_scale_from = int(cfg.floor_scale) - 1
    return w


def _fold_residual(w: Weights, m: float) -> None:
    """A multiplier on each branch's output. In float32, folded into o_proj and down_proj
    (each expert's and the shared expert's): each weight times it, so the runner's block
    stays Llama's and the fused native pass serves it; a branch's output is then (m W) x
    instead of m (W x), a rounding apart. In other dtypes, where that rounding is coarse,
    each branch's output times it, as transformers computes it (`Weights.residual_scale`)."""
    def scaled(t: torch.Tensor) -> torch.Tensor:
        return (t.float() * m).to(t.dtype).contiguous()

    if m == 1.0:
        return
    if w.embed.dtype != torch.float32:
        w.residual_scale = m
        return
    for lyr in w.layers:
        lyr.w_o = scaled(lyr.w_o)
        if lyr.moe is None:
            lyr.w_down = scaled(lyr.w_down)
        else:
            lyr.moe.down = [scaled(t) for t in lyr.moe.down]
            if lyr.moe.shared_down is not None:
                lyr.moe.shared_down = scaled(lyr.moe.shared_down)


def _deepseek(hf, device) -> Weights:
    """DeepSeek-V2 (its RoPE's complex pairs, `_rope_table`; its router, `Experts.scores`),
    DeepSeek-V3, GLM-4.7-Flash (`glm4_moe_lite`), Mistral 4 (its router's
    softmax scores, `Experts.scores`; q scaled by position, `_q_scale`), Youtu and MiniCPM3
    (its embedding, branch and logit scales): Llama's pre-norm block with latent attention
    (`MLA`) and, where the config has them, DeepSeek-V3's experts. The attention's scale is
    the module's own (YaRN's mscale folded in)."""
    cfg = hf.config
    w = _q_scale(_llama(hf, device), cfg, device)
    w.attn_scale = float(hf.model.layers[0].self_attn.scaling)
    if cfg.model_type == "minicpm3":
        w.embed_scale, w.logit_divisor = float(cfg.scale_emb), float(cfg.logits_scaling)
        _fold_residual(w, cfg.scale_depth / math.sqrt(cfg.num_hidden_layers))
    return w


def _axk1(hf, device) -> Weights:
    """A.X-K1: DeepSeek-V3's layers (latent attention with a low-rank q, its router and
    experts) with a norm on each mixture of experts' output (`ln_mlp_out`; its dense layers
    have none)."""
    w = _deepseek(hf, device)
    for lyr, src in zip(w.layers, hf.model.layers):
        norm = getattr(src.mlp, "post_mlp_layernorm", None)
        if norm is not None:
            lyr.ln_mlp_out = _t(norm.weight, device)
    return w


def _f32(norm, device) -> torch.Tensor:
    """A norm's weight in float32 (AFMoE's and Ergo's norms scale in float32)."""
    return _t(norm.weight.float(), device)


def _afmoe(hf, device) -> Weights:
    """AFMoE (Arcee's Trinity): norms before and after each branch that scale in float32 (as
    OLMo 2's: `norm_upcast`), per-head q/k norms, an output gate (`Layer.out_gate`), RoPE on
    the sliding layers only (`_without_rope`), embeddings times sqrt(hidden) where
    `mup_enabled`, and a sigmoid router with a bias and no groups (`Experts.scores`) after
    `num_dense_layers` dense layers."""
    cfg, m = hf.config, hf.model
    layers = [_block(lyr, device, cfg, ln_attn_in=_f32(lyr.input_layernorm, device),
                     ln_attn_out=_f32(lyr.post_attention_layernorm, device),
                     ln_mlp_in=_f32(lyr.pre_mlp_layernorm, device),
                     ln_mlp_out=_f32(lyr.post_mlp_layernorm, device),
                     qk_norm=_qk_norm(cfg, lyr.self_attn, device), window=_window(cfg, i))
              for i, lyr in enumerate(m.layers)]
    w = _common(hf, device, layers, norm=_f32(m.norm, device), norm_upcast=True)
    if cfg.mup_enabled:
        w.embed_scale, w.embed_scale_number = cfg.hidden_size ** 0.5, True
    return _without_rope(w, [i for i, t in enumerate(cfg.layer_types) if t != "sliding_attention"])


def _ergo(hf, device) -> Weights:
    """Ergo: Gemma 2's four norms a layer, all in float32 (`norm_upcast`), per-head q/k norms,
    a fused q/k/v product, its sliding layers with RoPE over interleaved pairs (float32, its
    table in pairs: `_interleaved_rope`) and its global ones without; there,
    where the config sets `global_attention_scale`, q and k times its square root
    (`Layer.qk_scale`). Each branch joins the residual through a learned gate a
    dimension: sigmoid(w) times the branch plus sqrt(1 + sigmoid(w)) exp(-softplus(w) / 2)
    times the residual, in float32 (`Layer.residual_mix`, its four vectors). A dense ReLU² MLP
    on the first layers, then DeepSeek-V3's sigmoid router over float32 logits (no groups) and
    ReLU² experts held [in, out], each expert's output RMS-normed by its own weight
    (`Experts.out_norm`) and the weighted outputs summed over the row's slots; a shared
    expert normed after its product (`Experts.shared_norm`). In bfloat16 and float16 its
    embedding, norms and residual stream stay float32 (`Weights.stream_float32`), its LM head
    multiplies in float32, and its router rounds its weight and its weights to the model's
    dtype (`Experts.weights_rounded`), as transformers' Ergo does."""
    cfg, m = hf.config, hf.model
    ropes, rope, nope = _ropes(cfg, m, device, per_kind=True)

    def gate(g) -> tuple[torch.Tensor, torch.Tensor]:  # (transformers' arithmetic, once)
        w = g.weight.detach().float()
        s = w.sigmoid()
        residual = torch.sqrt(1.0 + s) * torch.exp(-0.5 * torch.nn.functional.softplus(w))
        return _t(s, device), _t(residual, device)

    layers = []
    for i, lyr in enumerate(m.layers):
        a = lyr.self_attn
        layer = _block(lyr, device, cfg, qkv=(_t(a.qkv_proj.weight, device), None),
                       ln_attn_in=_f32(lyr.input_layernorm, device),
                       ln_attn_out=_f32(lyr.post_attention_layernorm, device),
                       ln_mlp_in=_f32(lyr.pre_feedforward_layernorm, device),
                       ln_mlp_out=_f32(lyr.post_feedforward_layernorm, device),
                       qk_norm=_qk_norm(cfg, a, device), window=_window(cfg, i), rope=rope[i])
        if a.qk_scale is not None:
            layer.qk_scale = _t(a.qk_scale.to(a.qkv_proj.weight.dtype), device)
        layer.residual_mix = (*gate(lyr.attention_residual_gate),
                              *gate(lyr.feedforward_residual_gate))
        if layer.moe is not None:
            e, ex = layer.moe, lyr.mlp.experts
            e.out_norm = _t(ex.post_expert_norm.weight.float(), device)
            e.out_norm_eps = float(ex.post_expert_norm.eps)
            e.shared_norm = _f32(lyr.mlp.shared_experts.norm, device)
            e.sum_slots = True  # (its experts' forward sums the slots, whatever implementation)
            e.weights_rounded = True
            # its router's float32 weight rounded to the input's dtype, then multiplied in
            # float32 (transformers' `ErgoLinearWithFP32Output` over a narrow input)
            e.router = e.router.to(layer.w_qkv.dtype).float()
        layers.append(layer)
    # RoPE over interleaved pairs, from a table in pairs (c0, c0, c1, c1, ...): in halves here,
    # as Cohere's
    order = _halves_order(head_dim(cfg), head_dim(cfg))
    ropes = [tuple(t[:, order.to(t.device)] for t in table) for table in ropes]
    _interleaved_rope(layers, cfg, head_dim(cfg))
    w = _common(hf, device, layers, ropes=ropes, norm=_f32(m.norm, device), norm_upcast=True,
                activation="relu2", gated=False, stream_float32=True)
    w.lm_head = w.lm_head.float()  # (F.linear(x.float(), W.float()), in any dtype)
    return _without_rope(w, nope)


def _beam(hf, device) -> Weights:
    """Beam: Gemma 2's four norms a layer, which scale in float32 (`norm_upcast`), per-head q/k
    norms, an output gate with a bias a head (sigmoid(gate x + b): the bias is the gate rows'
    part of the first product's, `Layer.out_gate`), RoPE on the layer types that have it
    (its float32 table), and on those without it q times (1 + (p + 1) / 2048)^0.1 in float32
    (`q_scale`); each branch and the residual scaled by the depth of their sum
    (`Layer.residual_mix`); DeepSeek-V3's grouped sigmoid router (float32 weights) on the
    `mlp_layer_types` marked sparse, its output times `routed_scaling_factor` (the weights
    here, `Experts.scale`); the logits soft-capped."""
    cfg, m = hf.config, hf.model
    hq, d = cfg.num_attention_heads, head_dim(cfg)
    ropes, rope, nope = _ropes(cfg, m, device, per_kind=True)
    n = max_positions(cfg)
    layers = []
    for i, lyr in enumerate(m.layers):
        a = lyr.self_attn
        layer = _block(lyr, device, cfg, ln_attn_in=_t(lyr.input_layernorm.weight, device),
                       ln_attn_out=_t(lyr.post_attention_layernorm.weight, device),
                       ln_mlp_in=_t(lyr.pre_feedforward_layernorm.weight, device),
                       ln_mlp_out=_t(lyr.post_feedforward_layernorm.weight, device),
                       qk_norm=_qk_norm(cfg, a, device), window=_window(cfg, i),
                       rope=rope[i], q_scaled=i in nope)
        layer.out_gate_b = _t(a.gate_bias.repeat_interleave(d), device)
        ia, im = 2 * (i + 1), 2 * (i + 1) + 1
        layer.residual_mix = (1 / math.sqrt(ia), math.sqrt((ia - 1) / ia),
                              1 / math.sqrt(im), math.sqrt((im - 1) / im))
        if layer.moe is not None:
            layer.moe.scale = float(lyr.mlp.routed_scaling_factor)
            layer.moe.scale_after = layer.moe.choice_sorted = True
        layers.append(layer)
    w = _common(hf, device, layers, ropes=ropes, norm_upcast=True, glu_float32=True,
                final_softcap=cfg.final_logit_softcapping, softcap_float32=True)
    p = torch.arange(n, dtype=torch.float32)
    w.q_scale = _t(torch.exp(0.1 * torch.log1p((p + 1) / 2048)), device)
    return _without_rope(w, nope)


def _exaone_moe(hf, device) -> Weights:
    """EXAONE-MoE: Llama's pre-norm block with per-head q/k norms and DeepSeek-V3's router
    (`Experts.sigmoid`) over the sparse layers; where it slides, its global layers have no
    RoPE (`_without_rope`), as EXAONE 4's."""
    cfg = hf.config
    w = _llama(hf, device)
    if cfg.sliding_window:
        _without_rope(w, [i for i, t in enumerate(cfg.layer_types) if t != "sliding_attention"])
    return w


def _gpt_oss(hf, device) -> Weights:
    """GPT-OSS: Llama's pre-norm block with biases on q/k/v and o, attention sinks (`sinks`),
    sliding and full layers, and a mixture of experts (`Experts`) whose router has a bias and
    takes the softmax of its top-k logits, and whose experts carry biases and the clamped
    SwiGLU. transformers keeps an expert's gate/up as [H, 2I] with gate and up interleaved
    (columns 0, 2, ... and 1, 3, ...): here it is [2I, H], the gate's rows first. RoPE tables
    of D/2 columns, doubled to the runner's (the same products on each half). Its norms
    scale in float32 (`norm_upcast`)."""
    cfg, m = hf.config, hf.model
    layers = []
    for i, lyr in enumerate(m.layers):
        a, mlp = lyr.self_attn, lyr.mlp
        ex, n = mlp.experts, mlp.experts.intermediate_size
        order = _halves_order(2 * n, 2 * n)  # gate's columns, then up's
        experts = Experts(
            router=_t(mlp.router.weight, device), router_b=_bias(mlp.router, device),
            gate_up=[_in_out(w[:, order], device) for w in ex.gate_up_proj],
            gate_up_b=[_t(b[order], device) for b in ex.gate_up_proj_bias],
            down=[_in_out(w, device) for w in ex.down_proj],
            down_b=[_t(b, device) for b in ex.down_proj_bias],
            top_k=int(mlp.router.top_k), norm_topk=False, weights_in_dtype=True,
            softmax_after_topk=True, swiglu=(float(ex.alpha), float(ex.limit)))
        w_qkv, b_qkv = _attention(a, device)
        layers.append(Layer(
            ln_attn_in=_t(lyr.input_layernorm.weight, device), w_qkv=w_qkv, b_qkv=b_qkv,
            w_o=_t(a.o_proj.weight, device), b_o=_bias(a.o_proj, device),
            ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device), w_gate_up=None,
            w_down=None, moe=experts, window=_window(cfg, i), sinks=_t(a.sinks, device)))
    cos, sin = _rope_table(m.rotary_emb, max_positions(cfg), m.embed_tokens.weight.dtype, device)
    ropes = [(_t(torch.cat([cos, cos], -1), device), _t(torch.cat([sin, sin], -1), device))]
    return _common(hf, device, layers, ropes=ropes, norm_upcast=True)


def _heads_as(t: torch.Tensor, width: int, d: int, rep: int) -> torch.Tensor:
    """A projection's rows (or bias) [heads width, ...], each head padded with zeros to d and
    held `rep` times in place: [heads rep d, ...] (`_mimo`)."""
    t = t.reshape(-1, width, *t.shape[1:])
    t = torch.cat([t, t.new_zeros(t.shape[0], d - width, *t.shape[2:])], 1)
    return t.repeat_interleave(rep, 0).reshape(-1, *t.shape[2:])


def _mimo(hf, device) -> Weights:
    """MiMo-V2-Flash: Llama's pre-norm block, sliding layers with attention sinks (GPT-OSS's,
    `sinks`) and twice the full layers' K/V heads, a value narrower than the key (`v_dim`)
    and scaled after its product (`v_scale`), partial RoPE with a table a layer type, and
    DeepSeek-V3's router (without shared experts) after a dense layer 0. The cache has one
    width and head count for every layer: the sliding layers' K/V heads, each full layer's
    head held twice (transformers' query head i reads head i // (Hq / Hkv_layer): with its
    heads doubled, head i // (Hq / Hkv) is a copy of that one, so each score and output is
    the same sum), each value padded with zeros to the key's width."""
    cfg, m = hf.config, hf.model
    hkv, d = kv_heads(cfg), head_dim(cfg)
    ropes, rope, _ = _ropes(cfg, m, device, per_kind="" not in _rope_params(cfg))
    layers = []
    for i, lyr in enumerate(m.layers):
        a = lyr.self_attn
        vd = a.v_head_dim
        rep = hkv // (a.k_proj.out_features // d)  # 2 on full layers, 1 on sliding ones
        w_qkv = torch.cat([a.q_proj.weight, _heads_as(a.k_proj.weight, d, d, rep),
                           _heads_as(a.v_proj.weight, vd, d, rep)])
        b_qkv = None
        if a.q_proj.bias is not None:
            b_qkv = _t(torch.cat([a.q_proj.bias, _heads_as(a.k_proj.bias, d, d, rep),
                                  _heads_as(a.v_proj.bias, vd, d, rep)]), device)
        layers.append(_block(lyr, device, cfg, qkv=(_t(w_qkv, device), b_qkv),
                             ln_attn_in=_t(lyr.input_layernorm.weight, device),
                             ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device),
                             window=_window(cfg, i), rope=rope[i],
                             sinks=None if a.sinks is None else _t(a.sinks, device),
                             v_dim=vd if vd != d else None,
                             v_scale=float(a.v_scale) if a.v_scale != 1.0 else None))
    return _common(hf, device, layers, ropes=ropes, softmax_in_dtype=True)


def _mllama_text(hf, device) -> Weights:
    """Llama 3.2 Vision's language model (`mllama`) on text prompts: Llama's blocks (its RoPE
    scaling too). Its cross-attention layers, which transformers skips where no image was
    given, are not taken: the runner's layers and cache are the others. Its embedding's 8 extra
    rows (image tokens) are never produced by its LM head."""
    m = hf.model
    keep = [lyr for i, lyr in enumerate(m.layers) if i not in hf.config.cross_attention_layers]
    text = SimpleNamespace(layers=keep, rotary_emb=m.rotary_emb, embed_tokens=m.embed_tokens,
                           norm=m.norm)
    return _llama(SimpleNamespace(config=hf.config, model=text, lm_head=hf.lm_head), device)


def _bitnet(hf, device) -> Weights:
    """BitNet b1.58's checkpoints with plain weights (its bf16 ones): Llama's block with an
    RMSNorm on the attention's output before o_proj and one on the MLP's act(gate) * up
    before down_proj (`Layer.ln_attn_sub`, `ln_mlp_sub`), ReLU². Its packed ternary
    checkpoints (transformers' BitLinear, activations rounded to 8 bits) are refused."""
    if getattr(hf.config, "quantization_config", None) is not None:
        raise ModelLoadError("bitnet: packed ternary checkpoints (a quantization_config) are not "
                             "supported by the runner; load its plain-weight (bf16) checkpoint")
    w = _llama(hf, device)
    for lyr, src in zip(w.layers, hf.model.layers):
        lyr.ln_attn_sub = _t(src.self_attn.attn_sub_norm.weight, device)
        lyr.ln_mlp_sub = _t(src.mlp.ffn_sub_norm.weight, device)
    return w


def _longcat(hf, device) -> Weights:
    """LongCat-Flash: each of its layers is two of the runner's, each a pre-norm block of
    DeepSeek-V3's latent attention (q and the normed latent scaled, `MLA.q_scale`,
    `kv_scale`) and a dense MLP; the first also computes the layer's mixture of experts on
    its MLP input (`Layer.shortcut`), which the second adds after its MLP. The router:
    softmax scores of float32 logits (its bias unused, as transformers' forward leaves it),
    a correction bias in the choice, the top k unsorted, the weights scaled, float32; a choice
    of one of its zero-computation experts adds the row's input times the weight
    (`Experts.zero_experts`)."""
    cfg, m = hf.config, hf.model
    layers = []
    for lyr in m.layers:
        moe, r = lyr.mlp, lyr.mlp.router
        experts = Experts(router=_t(r.classifier.weight, device).float(),
                          gate_up=[_t(w, device) for w in moe.experts.gate_up_proj],
                          down=[_t(w, device) for w in moe.experts.down_proj],
                          top_k=int(r.top_k), norm_topk=False, weights_in_dtype=False,
                          scores="softmax", score_bias=_t(r.e_score_correction_bias, device),
                          scale=float(r.routed_scaling_factor),
                          zero_experts=int(moe.zero_expert_num))
        for j in (0, 1):
            a = lyr.self_attn[j]
            w_qkv, b_qkv, mla = _mla(cfg, a, device)
            mla.q_scale, mla.kv_scale = float(a.mla_scale_q_lora), float(a.mla_scale_kv_lora)
            layers.append(Layer(
                ln_attn_in=_t(lyr.input_layernorm[j].weight, device), w_qkv=w_qkv, b_qkv=b_qkv,
                w_o=_t(a.o_proj.weight, device), b_o=_bias(a.o_proj, device),
                ln_mlp_in=_t(lyr.post_attention_layernorm[j].weight, device),
                w_gate_up=_gate_up(lyr.mlps[j], device),
                w_down=_t(lyr.mlps[j].down_proj.weight, device), mla=mla,
                shortcut=experts if j == 0 else None, add_shortcut=j == 1))
    w = _common(hf, device, layers)
    w.attn_scale = float(m.layers[0].self_attn[0].scaling)
    return w


def _laguna(hf, device) -> Weights:
    """Laguna: Llama's pre-norm block with per-head q/k RMSNorms, a query head count a layer
    (`q_heads`: the runner computes the most of any layer, each KV head's group padded with
    heads whose q rows are zeros, and o_proj reads the layer's own heads), an output gate
    softplus(g) a head or an element (`gate_softplus`, `gate_heads`), sliding layers, partial
    RoPE a table a layer type, and after a dense layer 0 a sigmoid router with a correction
    bias (logits soft-capped where the config says), its top k sorted, the weights divided
    by their sum and cast, the experts' sum scaled (`scale_after`), beside a shared expert."""
    cfg, m = hf.config, hf.model
    hq, hkv, d = q_heads(cfg), kv_heads(cfg), head_dim(cfg)
    group = hq // hkv
    ropes, rope, _ = _ropes(cfg, m, device, per_kind="" not in _rope_params(cfg))
    per_head = cfg.gating is True or cfg.gating == "per-head"
    layers = []
    for i, lyr in enumerate(m.layers):
        a = lyr.self_attn
        n = a.num_heads
        real = torch.tensor([j // (n // hkv) * group + j % (n // hkv) for j in range(n)])
        q = a.q_proj.weight.new_zeros(hq, d, a.q_proj.weight.shape[1])
        q[real] = a.q_proj.weight.view(n, d, -1)
        gate = a.g_proj.weight
        projs = [q.view(hq * d, -1), a.k_proj.weight, a.v_proj.weight, gate]
        b_qkv = None
        if a.q_proj.bias is not None:
            qb = a.q_proj.bias.new_zeros(hq, d)
            qb[real] = a.q_proj.bias.view(n, d)
            b_qkv = _t(torch.cat([qb.view(-1), a.k_proj.bias, a.v_proj.bias,
                                  gate.new_zeros(gate.shape[0])]), device)
        qk_norm = _t(torch.cat([a.q_norm.weight.expand(hq, -1), a.k_norm.weight.expand(hkv, -1)]),
                     device)
        layer = _block(lyr, device, cfg, qkv=(_t(torch.cat(projs), device), b_qkv),
                       ln_attn_in=_t(lyr.input_layernorm.weight, device),
                       ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device),
                       qk_norm=qk_norm, window=_window(cfg, i), rope=rope[i], out_gate=True,
                       gate_softplus=True, gate_heads=per_head,
                       q_heads=None if n == hq else _t(real, device))
        e = layer.moe
        if e is not None:  # (`_experts` read DeepSeek-V3's router; Laguna's arithmetic)
            e.norm_eps, e.weights_in_dtype, e.choice_sorted = 0.0, True, True
            e.scale, e.scale_after = float(lyr.mlp.routed_scaling_factor), True
            cap = float(cfg.moe_router_logit_softcapping)
            e.logit_softcap = cap if cap > 0 else None
        layers.append(layer)
    return _common(hf, device, layers, ropes=ropes)


def _identity_rope(n: int, d: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A RoPE table that leaves q and k as they are (cos 1, sin 0: x * 1 - y * 0 = x, bit for
    bit) for n positions of d dims, as stride-0 views: for families without RoPE."""
    one = torch.ones(1, d, dtype=dtype, device=device)
    return one.expand(n, d), torch.zeros_like(one).expand(n, d)


def _heads_interleaved(t: torch.Tensor | None, heads: int, d: int) -> torch.Tensor | None:
    """A fused qkv product's rows (or bias) from per-head interleaved order (head h's q, k, v:
    GPT-NeoX's, GPT-BigCode's without multi-query) to the runner's (every q, every k, every v)."""
    if t is None:
        return None
    return t.reshape(heads, 3, d, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def _in_out(w: torch.Tensor, device) -> torch.Tensor:
    """A product's weight that the checkpoint holds [in, out] (transformers computes x W:
    Conv1D's, transposed experts') as the runner's [out, in]: in float32 contiguous (the
    native kernels read it so); in other dtypes a view of the [in, out] layout, so torch's
    product takes transformers' path with its bits (on AVX2 a bfloat16 product of many rows
    gives other bits over the other layout)."""
    if w.dtype == torch.float32:
        return _t(w.t(), device)
    return _t(w, device).t()


def _conv1d(mod, device) -> torch.Tensor:
    """A Conv1D's weight (x W + b, W [in, out]: GPT-2's, GPT-1's) as the runner's [out, in]."""
    return _in_out(mod.weight, device)


def _gpt2(hf, device) -> Weights:
    """GPT-2 and GPT-BigCode (StarCoder 1, SantaCoder): learned absolute positions
    (`pos_embed`) and no RoPE (`_identity_rope`), LayerNorms with biases, biases on every
    product, an MLP not gated (c_fc, the activation, c_proj). GPT-2's products are Conv1D
    (x W + b: W is transposed here). GPT-BigCode's c_attn holds q's heads, then one K/V head's k
    and v where `multi_query`, else each head's q, k and v in turn (`_heads_interleaved`).
    Attention scaled by the inverse layer index is refused."""
    cfg, m = hf.config, hf.transformer
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        raise ModelLoadError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported by the "
                             "runner")
    conv, d = cfg.model_type == "gpt2", cfg.hidden_size // cfg.num_attention_heads
    mq = getattr(cfg, "multi_query", False)

    def w(mod) -> torch.Tensor:
        return _conv1d(mod, device) if conv else _t(mod.weight, device)

    def qkv(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if conv or mq else _heads_interleaved(t, cfg.num_attention_heads, d)

    layers = [Layer(ln_attn_in=_t(b.ln_1.weight, device), ln_attn_in_b=_bias(b.ln_1, device),
                    w_qkv=qkv(w(b.attn.c_attn)), b_qkv=qkv(_bias(b.attn.c_attn, device)),
                    w_o=w(b.attn.c_proj), b_o=_bias(b.attn.c_proj, device),
                    ln_mlp_in=_t(b.ln_2.weight, device), ln_mlp_in_b=_bias(b.ln_2, device),
                    w_gate_up=w(b.mlp.c_fc), b_gate_up=_bias(b.mlp.c_fc, device),
                    w_down=w(b.mlp.c_proj), b_down=_bias(b.mlp.c_proj, device))
              for b in m.h]
    embed, lm_head = _embed_and_head(hf, m.wte.weight, device)
    return Weights(layers, embed, _t(m.ln_f.weight, device), lm_head,
                   [_identity_rope(max_positions(cfg), d, embed.dtype, device)], d,
                   activation=cfg.activation_function, layer_norm=True,
                   attn_scale=None if cfg.scale_attn_weights else 1.0, norm_b=_bias(m.ln_f, device),
                   eps=cfg.layer_norm_epsilon, gated=False, pos_embed=_t(m.wpe.weight, device))


def _bloom(hf, device) -> Weights:
    """BLOOM: ALiBi (`Weights.alibi`: transformers' slopes) and no RoPE (`_identity_rope`), a
    LayerNorm with its bias on the embedding (`embed_norm`), LayerNorms with biases, biases on
    every product, each head's q, k and v in turn in one product (`_heads_interleaved`), an
    MLP not gated with BLOOM's own tanh GELU (`Layer.act`). Its residual from a norm's output
    (`apply_residual_connection_post_layernorm`) is refused."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, bloom_gelu_forward

    cfg, m = hf.config, hf.transformer
    if cfg.apply_residual_connection_post_layernorm:
        raise ModelLoadError("BLOOM with apply_residual_connection_post_layernorm is not "
                             "supported by the runner")
    hq = cfg.num_attention_heads
    d = cfg.hidden_size // hq

    def qkv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else _t(_heads_interleaved(t, hq, d), device)

    layers = [Layer(ln_attn_in=_t(b.input_layernorm.weight, device),
                    ln_attn_in_b=_bias(b.input_layernorm, device),
                    w_qkv=qkv(b.self_attention.query_key_value.weight),
                    b_qkv=qkv(b.self_attention.query_key_value.bias),
                    w_o=_t(b.self_attention.dense.weight, device),
                    b_o=_bias(b.self_attention.dense, device),
                    ln_mlp_in=_t(b.post_attention_layernorm.weight, device),
                    ln_mlp_in_b=_bias(b.post_attention_layernorm, device),
                    w_gate_up=_t(b.mlp.dense_h_to_4h.weight, device),
                    b_gate_up=_bias(b.mlp.dense_h_to_4h, device),
                    w_down=_t(b.mlp.dense_4h_to_h.weight, device),
                    b_down=_bias(b.mlp.dense_4h_to_h, device), act=bloom_gelu_forward)
              for b in m.h]
    embed, lm_head = _embed_and_head(hf, m.word_embeddings.weight, device)
    return Weights(layers, embed, _t(m.ln_f.weight, device), lm_head,
                   [_identity_rope(max_positions(cfg), d, embed.dtype, device)], d,
                   layer_norm=True, norm_b=_bias(m.ln_f, device), eps=cfg.layer_norm_epsilon,
                   gated=False, embed_norm=_t(m.word_embeddings_layernorm.weight, device),
                   embed_norm_b=_bias(m.word_embeddings_layernorm, device),
                   alibi=_t(_get_alibi_slopes(hq, torch.device("cpu")), device),
                   alibi_kind="bloom")


def _mpt(hf, device) -> Weights:
    """MPT: ALiBi (`Weights.alibi`: the slopes transformers' MPT builds, with its default
    alibi_bias_max of 8 whatever the config says, as its forward does) and no RoPE,
    LayerNorms without biases, no biases on the products, q, k and v clamped to `clip_qkv`
    (`Layer.clip_qkv`), the attention scaled by `softmax_scale` where it is set, an MLP not
    gated (exact GELU)."""
    cfg, m = hf.config, hf.transformer
    hq = cfg.num_attention_heads
    d = cfg.hidden_size // hq
    ac = cfg.attn_config
    layers = [Layer(ln_attn_in=_t(b.norm_1.weight, device), w_qkv=_t(b.attn.Wqkv.weight, device),
                    b_qkv=None, w_o=_t(b.attn.out_proj.weight, device),
                    ln_mlp_in=_t(b.norm_2.weight, device),
                    w_gate_up=_t(b.ffn.up_proj.weight, device),
                    w_down=_t(b.ffn.down_proj.weight, device), clip_qkv=ac.clip_qkv or None)
              for b in m.blocks]
    embed, lm_head = _embed_and_head(hf, m.wte.weight, device)
    # its slope per head: the bias of the key one before the last
    slopes = -m.build_mpt_alibi_tensor(hq, 2, device=torch.device("cpu"))[:, 0, 0].float()
    return Weights(layers, embed, _t(m.norm_f.weight, device), lm_head,
                   [_identity_rope(max_positions(cfg), d, embed.dtype, device)], d,
                   activation="gelu", attn_scale=ac.softmax_scale, layer_norm=True,
                   eps=cfg.layer_norm_epsilon, gated=False, alibi=_t(slopes, device))


def _openai_gpt(hf, device) -> Weights:
    """GPT-1 (`openai-gpt`): GPT-2's products (Conv1D, transposed here; q, k and v in turn;
    biases everywhere), learned positions (`pos_embed`) and no RoPE, and a post-norm block
    (`Layer.post_norms`): each sum, h + attention and then h + MLP, goes through its LayerNorm,
    and there is no final norm. Its "gelu" is transformers' gelu_new (its ACT_FNS)."""
    from transformers.models.openai.modeling_openai import ACT_FNS

    cfg, m = hf.config, hf.transformer
    d = cfg.n_embd // cfg.n_head
    act = ACT_FNS[cfg.afn]

    layers = [Layer(ln_attn_in=_t(b.ln_1.weight, device), ln_attn_in_b=_bias(b.ln_1, device),
                    w_qkv=_conv1d(b.attn.c_attn, device), b_qkv=_bias(b.attn.c_attn, device),
                    w_o=_conv1d(b.attn.c_proj, device), b_o=_bias(b.attn.c_proj, device),
                    ln_mlp_in=_t(b.ln_2.weight, device), ln_mlp_in_b=_bias(b.ln_2, device),
                    w_gate_up=_conv1d(b.mlp.c_fc, device), b_gate_up=_bias(b.mlp.c_fc, device),
                    w_down=_conv1d(b.mlp.c_proj, device), b_down=_bias(b.mlp.c_proj, device),
                    act=act, post_norms=True)
              for b in m.h]
    embed, lm_head = _embed_and_head(hf, m.tokens_embed.weight, device)
    return Weights(layers, embed, None, lm_head,
                   [_identity_rope(max_positions(cfg), d, embed.dtype, device)], d,
                   layer_norm=True, eps=cfg.layer_norm_epsilon, gated=False,
                   pos_embed=_t(m.positions_embed.weight, device), attn_eager=True,
                   attn_divide=True)


def _gpt_neo(hf, device) -> Weights:
    """GPT-Neo: GPT-2's block (learned absolute positions, LayerNorms with biases, an MLP not
    gated) with q/k/v without biases, attention not scaled and taken in float32
    (`attn_float32`), and its "local" layers sliding over `window_size` keys (a row's own
    among them)."""
    cfg, m = hf.config, hf.transformer
    d = cfg.hidden_size // cfg.num_heads
    layers = []
    for kind, b in zip(cfg.attention_layers, m.h):
        a = b.attn.attention
        layers.append(Layer(
            ln_attn_in=_t(b.ln_1.weight, device), ln_attn_in_b=_bias(b.ln_1, device),
            w_qkv=_t(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), device),
            b_qkv=None, w_o=_t(a.out_proj.weight, device), b_o=_bias(a.out_proj, device),
            ln_mlp_in=_t(b.ln_2.weight, device), ln_mlp_in_b=_bias(b.ln_2, device),
            w_gate_up=_t(b.mlp.c_fc.weight, device), b_gate_up=_bias(b.mlp.c_fc, device),
            w_down=_t(b.mlp.c_proj.weight, device), b_down=_bias(b.mlp.c_proj, device),
            window=int(cfg.window_size) if kind == "local" else None))
    embed, lm_head = _embed_and_head(hf, m.wte.weight, device)
    return Weights(layers, embed, _t(m.ln_f.weight, device), lm_head,
                   [_identity_rope(max_positions(cfg), d, embed.dtype, device)], d,
                   activation=cfg.activation_function, layer_norm=True, attn_scale=1.0,
                   norm_b=_bias(m.ln_f, device), eps=cfg.layer_norm_epsilon, gated=False,
                   pos_embed=_t(m.wpe.weight, device), attn_float32=True)


def _codegen_qkv(a, device) -> tuple[torch.Tensor, None]:
    """CodeGen's qkv_proj in q, k, v order: it holds `mp_num` parts, each part's rows its
    heads' queries, then values, then keys."""
    w, parts = a.qkv_proj.weight, a.mp_num
    local = w.shape[0] // 3 // parts
    part = torch.arange(parts)[:, None] * 3 * local + torch.arange(local)[None]  # each q slice
    q, v, k = (part + i * local for i in range(3))
    return _t(w[torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])], device), None


def _gptj(hf, device) -> Weights:
    """GPT-J and CodeGen: attention and MLP in parallel on one LayerNorm (Phi's block: biases
    on the MLP and the LM head, none on q/k/v/o), RoPE over interleaved pairs of each head's
    first `rotary_dim` dims (`_interleaved_rope`), its table transformers' sin and cos halves
    (GPT-J's in the model's dtype, as transformers casts it; CodeGen's in float32),
    and, where the checkpoint is loaded with eager attention, the scores in float32 in any
    dtype (`attn_float32`; transformers takes SDPA by default). CodeGen's q, k and v are one
    product in its own order (`_codegen_qkv`)."""
    cfg, m = hf.config, hf.transformer
    d = head_dim(cfg)
    qkv = _codegen_qkv if cfg.model_type == "codegen" else _attention
    layers = [Layer(ln_attn_in=_t(b.ln_1.weight, device), ln_attn_in_b=_bias(b.ln_1, device),
                    w_qkv=w_qkv, b_qkv=b_qkv, w_o=_t(b.attn.out_proj.weight, device),
                    ln_mlp_in=None, w_gate_up=_t(b.mlp.fc_in.weight, device),
                    b_gate_up=_bias(b.mlp.fc_in, device), w_down=_t(b.mlp.fc_out.weight, device),
                    b_down=_bias(b.mlp.fc_out, device), parallel=True, branches_first=True)
              for b in m.h for w_qkv, b_qkv in [qkv(b.attn, device)]]
    rot = cfg.rotary_dim or d
    _interleaved_rope(layers, cfg, rot)
    table = m.rotary_emb.embed_positions[: max_positions(cfg)]
    if cfg.model_type == "gptj":  # (GPT-J's rotates in the model's dtype; CodeGen's float32)
        table = table.to(m.wte.weight.dtype)
    sin, cos = table.split(rot // 2, dim=-1)
    embed, lm_head = _embed_and_head(hf, m.wte.weight, device)
    ropes = [(_t(torch.cat([cos, cos], -1), device), _t(torch.cat([sin, sin], -1), device))]
    return Weights(layers, embed, _t(m.ln_f.weight, device), lm_head, ropes, d,
                   activation=cfg.activation_function, layer_norm=True,
                   norm_b=_bias(m.ln_f, device), lm_head_b=_bias(hf.lm_head, device),
                   eps=cfg.layer_norm_epsilon, gated=False,
                   attn_float32=cfg._attn_implementation == "eager")


def _falcon(hf, device) -> Weights:
    """Falcon: LayerNorms with biases, biases on every product where `bias` (added to the
    product, `bias_after`), an MLP not gated, and RoPE, or ALiBi (`alibi`, Falcon-RW's:
    `Weights.alibi_kind`). Its fused q/k/v holds
    each K/V group's queries then its key and value (`new_decoder_architecture`), or q's heads
    then one key and value (`multi_query`), or each head's q, k and v in turn
    (`_heads_interleaved`): here q's heads, then k's, then v's. The block is sequential, or
    parallel on one norm (`parallel_attn`), or parallel with a norm for each branch (the new
    architecture's two, as GPT-NeoX's)."""
    cfg, m = hf.config, hf.transformer
    hq, hkv, d = cfg.num_attention_heads, kv_heads(cfg), head_dim(cfg)

    def qkv(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or (cfg.multi_query and not cfg.new_decoder_architecture):
            return t
        if not cfg.new_decoder_architecture:
            return _heads_interleaved(t, hq, d)
        g = t.reshape(hkv, hq // hkv + 2, d, *t.shape[1:])
        rest = t.shape[1:]
        return torch.cat([g[:, :-2].reshape(hq * d, *rest), g[:, -2].reshape(hkv * d, *rest),
                          g[:, -1].reshape(hkv * d, *rest)]).contiguous()

    two = cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2
    parallel = cfg.new_decoder_architecture or cfg.parallel_attn
    layers = []
    for b in m.h:
        a, mlp = b.self_attention, b.mlp
        ln_in = b.ln_attn if two else b.input_layernorm
        ln_mlp = b.ln_mlp if two else None if parallel else b.post_attention_layernorm
        layers.append(Layer(
            ln_attn_in=_t(ln_in.weight, device), ln_attn_in_b=_bias(ln_in, device),
            w_qkv=_t(qkv(a.query_key_value.weight), device),
            b_qkv=None if a.query_key_value.bias is None else _t(qkv(a.query_key_value.bias), device),
            w_o=_t(a.dense.weight, device), b_o=_bias(a.dense, device),
            ln_mlp_in=None if ln_mlp is None else _t(ln_mlp.weight, device),
            ln_mlp_in_b=None if ln_mlp is None else _bias(ln_mlp, device),
            w_gate_up=_t(mlp.dense_h_to_4h.weight, device), b_gate_up=_bias(mlp.dense_h_to_4h, device),
            w_down=_t(mlp.dense_4h_to_h.weight, device), b_down=_bias(mlp.dense_4h_to_h, device),
            parallel=parallel, branches_first=True))
    embed, lm_head = _embed_and_head(hf, m.word_embeddings.weight, device)
    n, alibi = max_positions(cfg), {}
    if cfg.alibi:  # (BLOOM's slopes, rounded to bfloat16 as transformers' Falcon takes them)
        from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

        slopes = _get_alibi_slopes(hq, torch.device("cpu")).bfloat16().float()
        alibi = dict(alibi=_t(slopes, device), alibi_kind="falcon")
    rope = (_identity_rope(n, d, embed.dtype, device) if cfg.alibi
            else _rope_table(m.rotary_emb, n, embed.dtype, device))
    return Weights(layers, embed, _t(m.ln_f.weight, device), lm_head, [rope], d,
                   activation=cfg.activation, layer_norm=True, norm_b=_bias(m.ln_f, device),
                   eps=cfg.layer_norm_epsilon, gated=False, bias_after=True, **alibi)


def _dbrx(hf, device) -> Weights:
    """DBRX: Llama's pre-norm block with LayerNorms without biases, q/k/v clamped to
    `clip_qkv` (`Layer.clip_qkv`), and experts whose router divides its top k by their p-norm
    (`Experts.norm_p`); an expert's rows of transformers' w1 (gate), v1 (up) and w2 (down,
    [I, H]: transposed here)."""
    cfg, m = hf.config, hf.transformer
    ac, fc = cfg.attn_config, cfg.ffn_config
    if fc.moe_normalize_expert_weights is None:
        raise ModelLoadError("DBRX without moe_normalize_expert_weights is not supported by the "
                             "runner")
    layers = []
    for b in m.blocks:
        nan, ffn = b.norm_attn_norm, b.ffn
        g = ffn.experts.mlp
        split = (fc.moe_num_experts, fc.ffn_hidden_size, cfg.hidden_size)
        w1, v1, w2 = (t.view(split) for t in (g.w1, g.v1, g.w2))
        experts = Experts(router=_t(ffn.router.layer.weight, device),
                          gate_up=[_t(torch.cat([w1[e], v1[e]]), device) for e in range(split[0])],
                          down=[_in_out(w2[e], device) for e in range(split[0])],
                          top_k=int(fc.moe_top_k), norm_topk=False, weights_in_dtype=True,
                          norm_p=float(fc.moe_normalize_expert_weights))
        layers.append(Layer(ln_attn_in=_t(nan.norm_1.weight, device), w_qkv=_t(nan.attn.Wqkv.weight, device),
                            b_qkv=_bias(nan.attn.Wqkv, device), w_o=_t(nan.attn.out_proj.weight, device),
                            ln_mlp_in=_t(nan.norm_2.weight, device), w_gate_up=None, w_down=None,
                            moe=experts, clip_qkv=ac.clip_qkv))
    embed, lm_head = _embed_and_head(hf, m.wte.weight, device)
    return Weights(layers, embed, _t(m.norm_f.weight, device), lm_head,
                   [_rope_table(m.rotary_emb, max_positions(cfg), embed.dtype, device)],
                   head_dim(cfg), activation=fc.ffn_act_fn.get("name", "silu"),
                   layer_norm=True, eps=m.norm_f.eps)


def _fairseq_layers(layers, device) -> list[Layer]:
    """The pre-norm blocks of OPT, BioGPT and XGLM (fairseq's decoder layer): LayerNorms with
    biases (self_attn_layer_norm, final_layer_norm), separate q/k/v and out_proj with biases,
    an MLP not gated (fc1, the activation, fc2)."""
    out = []
    for lyr in layers:
        a = lyr.self_attn
        w_qkv, b_qkv = _attention(a, device)
        out.append(Layer(
            ln_attn_in=_t(lyr.self_attn_layer_norm.weight, device),
            ln_attn_in_b=_bias(lyr.self_attn_layer_norm, device), w_qkv=w_qkv, b_qkv=b_qkv,
            w_o=_t(a.out_proj.weight, device), b_o=_bias(a.out_proj, device),
            ln_mlp_in=_t(lyr.final_layer_norm.weight, device),
            ln_mlp_in_b=_bias(lyr.final_layer_norm, device),
            w_gate_up=_t(lyr.fc1.weight, device), b_gate_up=_bias(lyr.fc1, device),
            w_down=_t(lyr.fc2.weight, device), b_down=_bias(lyr.fc2, device)))
    return out


def _opt(hf, device) -> Weights:
    """OPT: GPT-2's block (learned absolute positions, the table's first two rows skipped as
    OPT's offset skips them; LayerNorms with biases; an MLP not gated, ReLU) with separate
    q/k/v projections (`_fairseq_layers`). OPT and XGLM scale q by head_dim^-0.5 before the
    scores (`q_prescaled`), BioGPT the scores. BioGPT: the same block and positions, its
    embedding scaled by sqrt(hidden) where `scale_embedding`; XGLM: the same with a sinusoidal
    position table (offset by two as well). OPT checkpoints with
    project_in/out (OPT-350m), post-norm blocks or LayerNorms without weights are refused."""
    cfg = hf.config
    kind = cfg.model_type
    m = hf.biogpt if kind == "biogpt" else hf.model if kind == "xglm" else hf.model.decoder
    final = m.layer_norm if kind != "opt" else m.final_layer_norm
    if kind == "opt" and (m.project_in is not None or not cfg.do_layer_norm_before or final is None
                          or not cfg.layer_norm_elementwise_affine):
        raise ModelLoadError("OPT with project_in/out, post-norm blocks or LayerNorms without "
                             "weights is not supported by the runner")
    layers = _fairseq_layers(m.layers, device)
    embed = _t(m.embed_tokens.weight, device)
    lm_head = embed if cfg.tie_word_embeddings else _t(hf.get_output_embeddings().weight, device)
    d = cfg.hidden_size // cfg.num_attention_heads
    pos = m.embed_positions
    table = pos.weights if kind == "xglm" else pos.weight  # (XGLM's: a sinusoidal buffer)
    scale = getattr(m.embed_tokens, "embed_scale", 1.0)  # (BioGPT's, XGLM's: sqrt(hidden))
    return Weights(layers, embed, _t(final.weight, device), lm_head,
                   [_identity_rope(max_positions(cfg), d, embed.dtype, device)], d,
                   activation=getattr(cfg, "activation_function", None) or cfg.hidden_act,
                   layer_norm=True, norm_b=_bias(final, device), eps=final.eps, gated=False,
                   pos_embed=_t(table[pos.offset: pos.offset + max_positions(cfg)].to(embed.dtype),
                                device),
                   embed_scale=None if scale == 1.0 else float(scale), embed_scale_number=True,
                   q_prescaled=kind != "biogpt", attn_eager=kind == "xglm")


def _ctrl(hf, device) -> Weights:
    """CTRL: pre-norm blocks with LayerNorms (weights and biases), q/k/v and the output with
    biases, an MLP not gated (ReLU), the embedding scaled by sqrt(hidden), a sinusoidal
    position table (`pos_embed`, no offset) and the LM head's bias. Its layers' norms have
    eps 1e-6 whatever the config says, its final norm the config's (`Weights.final_eps`)."""
    cfg, m = hf.config, hf.transformer
    eps = {float(b.layernorm1.eps) for b in m.h} | {float(b.layernorm2.eps) for b in m.h}
    if len(eps) != 1:
        raise ModelLoadError(f"CTRL whose layers' norms take different epsilons {sorted(eps)} "
                             "is not supported by the runner")
    layers = []
    for b in m.h:
        a, up, down = b.multi_head_attention, b.ffn[0], b.ffn[2]
        layers.append(Layer(
            ln_attn_in=_t(b.layernorm1.weight, device), ln_attn_in_b=_bias(b.layernorm1, device),
            w_qkv=_t(torch.cat([a.Wq.weight, a.Wk.weight, a.Wv.weight]), device),
            b_qkv=_t(torch.cat([a.Wq.bias, a.Wk.bias, a.Wv.bias]), device),
            w_o=_t(a.dense.weight, device), b_o=_bias(a.dense, device),
            ln_mlp_in=_t(b.layernorm2.weight, device), ln_mlp_in_b=_bias(b.layernorm2, device),
            w_gate_up=_t(up.weight, device), b_gate_up=_bias(up, device),
            w_down=_t(down.weight, device), b_down=_bias(down, device)))
    embed, lm_head = _embed_and_head(hf, m.w.weight, device)
    d, n = cfg.n_embd // cfg.n_head, max_positions(cfg)
    return Weights(layers, embed, _t(m.layernorm.weight, device), lm_head,
                   [_identity_rope(n, d, embed.dtype, device)], d, activation="relu",
                   layer_norm=True, norm_b=_bias(m.layernorm, device), eps=eps.pop(),
                   final_eps=float(m.layernorm.eps),
                   gated=False, pos_embed=_t(m.pos_encoding[:n].to(embed.dtype), device),
                   embed_scale=math.sqrt(cfg.n_embd), embed_scale_number=True,
                   lm_head_b=_bias(hf.lm_head, device))


def _gpt_neox(hf, device) -> Weights:
    """GPT-NeoX (Pythia): LayerNorms with biases; the fused query_key_value in per-head
    interleaved order (`_heads_interleaved`); RoPE on each head's first `rotary_ndims` dims;
    biases on every product; an MLP not gated. With `use_parallel_residual` the attention
    and the MLP both read the layer's input, each through its own LayerNorm (`parallel`
    with `ln_mlp_in`). Persimmon: the sequential block (its own module names; ReLU²) with,
    where `qk_layernorm`, one LayerNorm (weight and bias) over each of q's heads and one over
    each of k's, before RoPE (`Layer.qk_layer_norm`). GPT-NeoX Japanese: the sequential
    block without biases but the last layer's `dense_bias`, added to its attention's output
    after the product (`bias_after`), its scores and their softmax in the model's dtype
    (`Weights.scores_baddbmm`)."""
    cfg = hf.config
    japanese = cfg.model_type == "gpt_neox_japanese"
    neox = cfg.model_type == "gpt_neox" or japanese
    m = (hf.gpt_neox if cfg.model_type == "gpt_neox" else hf.gpt_neox_japanese if japanese
         else hf.model)
    d, heads = cfg.hidden_size // cfg.num_attention_heads, cfg.num_attention_heads
    layers = []
    for lyr in m.layers:
        a, mlp = lyr.attention if neox else lyr.self_attn, lyr.mlp
        qk = {}
        if getattr(cfg, "qk_layernorm", False):  # (Persimmon's: one for every head)
            qk = dict(qk_layer_norm=True, qk_norm_shared=True, **{name: _t(torch.stack(
                [getattr(a.q_layernorm, p)] * heads + [getattr(a.k_layernorm, p)] * heads), device)
                for name, p in (("qk_norm", "weight"), ("qk_norm_b", "bias"))})
        layers.append(Layer(
            ln_attn_in=_t(lyr.input_layernorm.weight, device),
            ln_attn_in_b=_bias(lyr.input_layernorm, device),
            w_qkv=_heads_interleaved(_t(a.query_key_value.weight, device), heads, d),
            b_qkv=_heads_interleaved(_bias(a.query_key_value, device), heads, d),
            w_o=_t(a.dense.weight, device),
            b_o=_t(a.dense_bias, device) if getattr(a, "dense_bias", None) is not None
            else _bias(a.dense, device),
            ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device),
            ln_mlp_in_b=_bias(lyr.post_attention_layernorm, device),
            parallel=bool(getattr(cfg, "use_parallel_residual", False)), branches_first=True,
            w_gate_up=_t(mlp.dense_h_to_4h.weight, device), b_gate_up=_bias(mlp.dense_h_to_4h, device),
            w_down=_t(mlp.dense_4h_to_h.weight, device), b_down=_bias(mlp.dense_4h_to_h, device),
            **qk))
    embed, lm_head = _embed_and_head(hf, (m.embed_in if neox else m.embed_tokens).weight, device)
    final = m.final_layer_norm if neox else m.final_layernorm
    ropes = [_rope_table(m.rotary_emb, max_positions(cfg), embed.dtype, device)]
    return Weights(layers, embed, _t(final.weight, device), lm_head, ropes, d,
                   activation=cfg.hidden_act, layer_norm=True, scores_baddbmm=japanese,
                   bias_after=japanese,
                   attn_scale=1.0 / math.sqrt(d) if japanese else None,
                   norm_b=_bias(final, device), eps=cfg.layer_norm_eps, gated=False)


def _phi3(hf, device) -> Weights:
    """Phi-3: fused qkv_proj and gate_up_proj (gate first) already in the runner's layout;
    partial rotary comes with the RoPE table's width."""
    cfg = hf.config
    layers = []
    for i, lyr in enumerate(hf.model.layers):
        a, mlp = lyr.self_attn, lyr.mlp
        layers.append(Layer(
            ln_attn_in=_t(lyr.input_layernorm.weight, device), w_qkv=_t(a.qkv_proj.weight, device),
            b_qkv=_bias(a.qkv_proj, device), w_o=_t(a.o_proj.weight, device),
            ln_mlp_in=_t(lyr.post_attention_layernorm.weight, device),
            w_gate_up=_gate_up(mlp, device), w_down=_t(mlp.down_proj.weight, device),
            window=_window(cfg, i), **_output_biases(a, mlp, device)))
    return _common(hf, device, layers)


def _gemma_norm(w: torch.Tensor, device) -> torch.Tensor:
    """A Gemma RMSNorm's weight as the runner applies it (`norm_upcast`): x_norm * (1 +
    w.float()) in fp32, then cast; stored with the 1 added, in fp32."""
    return _t(1.0 + w.float(), device)


def _gemma(hf, device) -> Weights:
    """Gemma (the first): Llama's block with Gemma's norms (`_gemma_norm`), GeGLU and
    sqrt(hidden)-scaled embeddings."""
    w = _llama(hf, device)
    for lyr, src in zip(w.layers, hf.model.layers):
        lyr.ln_attn_in = _gemma_norm(src.input_layernorm.weight, device)
        lyr.ln_mlp_in = _gemma_norm(src.post_attention_layernorm.weight, device)
    w.norm = _gemma_norm(hf.model.norm.weight, device)
    w.embed_scale, w.norm_upcast = math.sqrt(hf.config.hidden_size), True
    return w


def _gemma3(hf, device) -> Weights:
    """Gemma 3 text: (1 + w) RMSNorms (stored here with the 1 added, in fp32), four norms per
    layer, q/k norms, GeGLU, sqrt(hidden)-scaled embeddings, query_pre_attn_scalar, local
    RoPE for sliding layers, optional final-logit soft-capping. `attn_logit_softcapping` is
    ignored, as transformers' Gemma 3 ignores it (unlike Gemma 2's).

    Gemma 2 is the same block without q/k norms, with one RoPE table for every layer and its
    attention scores soft-capped (`attn_softcap`: the runner's explicit attention path);
    VaultGemma is Gemma 2 without the norms on the branches' outputs."""
    cfg, m = hf.config, hf.model
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ModelLoadError("Gemma 3 with bidirectional attention is not a causal LM; not supported")
    gemma2 = cfg.model_type in ("gemma2", "vaultgemma")

    def g(norm):
        return None if norm is None else _gemma_norm(norm.weight, device)

    ropes, rope, _ = _ropes(cfg, m, device, per_kind=not gemma2)
    layers = [_block(lyr, device, ln_attn_in=g(lyr.input_layernorm),
                     ln_attn_out=g(getattr(lyr, "post_attention_layernorm", None)),
                     ln_mlp_in=g(lyr.pre_feedforward_layernorm),
                     ln_mlp_out=g(getattr(lyr, "post_feedforward_layernorm", None)),
                     qk_norm=_qk_norm(cfg, lyr.self_attn, device, offset=1.0),
                     window=_window(cfg, i), rope=rope[i])
              for i, lyr in enumerate(m.layers)]
    return _common(hf, device, layers, ropes=ropes, norm=g(m.norm),
                   attn_scale=cfg.query_pre_attn_scalar ** -0.5,
                   embed_scale=math.sqrt(cfg.hidden_size), norm_upcast=True,
                   final_softcap=cfg.final_logit_softcapping, activation=cfg.hidden_activation,
                   attn_softcap=cfg.attn_logit_softcapping if gemma2 else None)


FAMILIES: dict[str, Callable[..., Weights]] = {
    "llama": _llama,
    "mistral": _llama,
    "ministral": _llama,  # Mistral's block; its windows by `layer_types`
    "ministral3": _ministral3,
    "llama4_text": _llama4,  # chunked attention, layers without RoPE, a sigmoid router
    "internlm3": _llama,  # transformers runs these as Llama
    "iquestcoder": _llama,
    "qwen2": _llama,
    "qwen3": _llama,
    "mixtral": _llama,  # the MoE families: `Experts`
    "qwen2_moe": _llama,
    "qwen3_moe": _llama,
    "olmoe": _olmoe,
    "minimax_m2": _olmoe,  # OLMoE's q/k norms over whole projections; a sigmoid router
    "glm4_moe": _llama,  # DeepSeek-V3's router (`Experts.sigmoid`), shared experts
    "deepseek_v3": _deepseek,  # latent attention (`MLA`)
    "deepseek_v32": _deepseek,  # DeepSeek-V3's, up to its indexer's top k (`_DENSE_UP_TO_TOPK`)
    "glm_moe_dsa": _deepseek,  # GLM-5: the same
    "glm4_moe_lite": _deepseek,
    "youtu": _deepseek,
    "minicpm3": _deepseek,
    "mistral4": _deepseek,
    "dots1": _llama,
    "solar_open": _llama,
    "exaone_moe": _exaone_moe,
    "minicpm5_moe": _llama,  # an output gate (`Layer.out_gate`) in q_gate_proj
    "afmoe": _afmoe,
    "beam": _beam,
    "ergo": _ergo,  # residual gates a dimension, experts normed each by its own weight
    "gpt_oss": _gpt_oss,
    "granitemoehybrid": _granite_hybrid,  # Granite 4.0 whose layers are all attention
    "emu3_text_model": _llama,  # Emu3's language model: Llama's block
    "mllama_text_model": _mllama_text,  # Llama 3.2 Vision's, without its cross-attention layers
    "bitnet": _bitnet,  # norms inside the branches, ReLU² (plain-weight checkpoints)
    "longcat_flash": _longcat,  # two latent attentions a layer, a shortcut mixture
    "laguna": _laguna,  # a query head count a layer, a softplus output gate
    "mimo_v2_flash": _mimo,  # per-layer K/V heads, a narrower value, sinks on sliding layers
    "qwen2_vl_text": _llama,  # the Qwen VL models' language models (`_language_model`)
    "qwen2_5_vl_text": _llama,
    "qwen3_vl_text": _llama,
    "qwen3_vl_moe_text": _llama,  # Qwen3-VL-MoE's: Qwen3-MoE's block
    "smollm3": _smollm3,
    "granite": _granite,
    "granitemoe": _granite,
    "granitemoeshared": _granite,
    "olmo2": _olmo2,
    "olmo3": _olmo2,
    "flex_olmo": _olmo2,
    "exaone4": _exaone4,
    "phi3": _phi3,
    "phi4_multimodal": _phi3,  # Phi-4-multimodal: Phi-3's block (its image and audio towers not taken)
    "gemma": _gemma,
    "cohere": _cohere,
    "cohere2": _cohere,
    "cohere2_moe": _cohere,
    "cohere_compass_text": _cohere_compass,  # Cohere 2's block, RoPE over halves a layer type
    "jetmoe": _jetmoe,  # a mixture of attention heads (`Layer.moa`) and of MLP experts
    "diffllama": _diffllama,  # differential attention (`Layer.diff`)
    "modernbert-decoder": _modernbert_decoder,  # a prediction head before the LM head
    "starcoder2": _starcoder2,
    "phi": _phi,
    "gpt2": _gpt2,  # learned absolute positions (`pos_embed`)
    "openai-gpt": _openai_gpt,  # GPT-1: post-norm blocks
    "bloom": _bloom,  # ALiBi (`alibi`)
    "mpt": _mpt,
    "gpt_bigcode": _gpt2,
    "opt": _opt,
    "biogpt": _opt,  # OPT's block, a scaled embedding
    "xglm": _opt,  # OPT's block, a scaled embedding, sinusoidal positions
    "ctrl": _ctrl,
    "gptj": _gptj,
    "codegen": _gptj,  # GPT-J's block, its q/v/k in parts
    "gpt_neo": _gpt_neo,
    "falcon": _falcon,
    "dbrx": _dbrx,
    "gpt_neox": _gpt_neox,
    "persimmon": _gpt_neox,  # GPT-NeoX's sequential block with q/k LayerNorms
    "gpt_neox_japanese": _gpt_neox,  # the sequential block, one output bias (the last layer's)
    "seed_oss": _llama,  # Llama's block with biases
    "hunyuan_v1_dense": _hunyuan,  # q/k norms after RoPE
    "hunyuan_v1_moe": _hunyuan,
    "nanochat": _nanochat,
    "hy_v3": _llama,  # a sigmoid router with a bias (MiniMax-M2's) after dense layers
    "mellum": _llama,  # Qwen3-MoE's block, a RoPE table a layer type
    "granite_swa": _granite,  # sliding layers, attention sinks
    "granitemoe_swa": _granite,
    "hyperclovax": _granite,  # branch-output norms, logits multiplied
    "olmo": _olmo,
    "apertus": _apertus,
    "apertus1p5_text": _apertus,  # Apertus 1.5's language model: Apertus, its LM head pruned
    "flint": _flint,
    "aria_text": _llama,  # Aria's language model: Llama's block, experts on every layer
    "kolibri1": _kolibri,  # GLM-4's norms, EXAONE 4's attention, a router biased on its logits
    "cwm": _llama,  # Llama's block, sliding on the layers `layer_types` marks
    "deepseek_v2": _deepseek,
    "phimoe": _layer_norms,
    # configurations transformers runs with another family's model
    "exaone": _llama,  # EXAONE 3 and 3.5: Llama
    "sarvam_moe": _llama,  # GLM-4.5's MoE
    "param2moe": _llama,
    "sarvam_mla": _deepseek,  # DeepSeek-V3
    "axk1": _axk1,  # DeepSeek-V3's, a norm on the experts' output
    "arcee": _arcee,
    "stablelm": _layer_norms,  # LayerNorms (`_layer_norms`)
    "jais2": _layer_norms,
    "nemotron": lambda hf, device: _layer_norms(hf, device, one_plus=True),
    "helium": _interleaved,
    "ernie4_5": _interleaved,
    "ernie4_5_moe": _interleaved,  # a router with softmax scores and a bias (`Experts.scores`)
    "glm": _interleaved,
    "glm4": _interleaved,
    "gemma2": _gemma3,
    "vaultgemma": _gemma3,
    "gemma3_text": _gemma3,
    **{name: _language_model for name in VISION_LANGUAGE},
}
SUPPORTED = tuple(FAMILIES)


def extract(hf, device: torch.device) -> Weights:
    cfg = hf.config
    fn = FAMILIES.get(cfg.model_type)
    if fn is None:
        raise ModelLoadError(f"model_type {cfg.model_type!r} is not supported by the runner; "
                             f"supported: {', '.join(SUPPORTED)}")
    w = fn(hf, device)
    _pair_tables(w)
    if w.layer_norm and not w.torch_layer_norm:
        w.torch_layer_norm = "dtype" if _torch_layer_norms(hf) else ""
    _experts_implementation(hf, w)
    return w


def _experts_implementation(hf, w: Weights) -> None:
    """Each mixture's `Experts.sum_slots`: where the checkpoint's experts modules take
    transformers' experts implementations (they have its `is_concatenated`), one for each of
    the runner's mixtures, and the checkpoint's implementation is grouped_mm (transformers'
    default) or batched_mm; a family whose experts sum their slots in any implementation
    (Ergo's) has set it already."""
    ours = [e for lyr in w.layers for e in (lyr.moe, lyr.shortcut) if e is not None]
    theirs = [mod for mod in hf.modules() if hasattr(mod, "is_concatenated")]
    if ours and len(ours) == len(theirs):
        for e, mod in zip(ours, theirs):
            e.sum_slots = e.sum_slots or (not e.scale_input and mod.config._experts_implementation
                                          in ("grouped_mm", "batched_mm"))


def _pair_tables(w: Weights) -> None:
    """The RoPE tables of layers that rotate interleaved pairs in place (`Layer.rope_pairs`),
    from halves (c_0 .. c_{r/2-1}, twice) to pairs (c_0, c_0, c_1, c_1, ...)."""
    for i in sorted({lyr.rope for lyr in w.layers if lyr.rope_pairs}):
        cos, sin = w.ropes[i]
        half = cos.shape[-1] // 2
        w.ropes[i] = tuple(t[..., :half].repeat_interleave(2, -1) for t in (cos, sin))


def _torch_layer_norms(hf) -> bool:
    """Whether every norm of the checkpoint's language model is torch's nn.LayerNorm (its
    class exactly: Cohere's, OLMo's and per-head norms compute their own way)."""
    lm = hf.get_decoder() if hasattr(hf, "get_decoder") else hf
    if lm is hf.get_output_embeddings():  # (ModernBERT-decoder's LM head is its `decoder`)
        lm = hf
    norms = [mod for mod in lm.modules()  # (leaves: DBRX's blocks are "NormAttentionNorm"s)
             if "norm" in type(mod).__name__.lower() and not any(mod.children())]
    return bool(norms) and all(type(mod) is torch.nn.LayerNorm for mod in norms)
