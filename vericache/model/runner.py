"""The forward runner: forward(tokens, positions, cache) -> logits, for decoder-only models
(Llama, Mistral, Qwen2/3, Phi-3, Gemma 3 text; weights per family in `families`).

The runner owns the weights (taken once from the transformers model) and its own forward
over them, so that
- the KV cache is preallocated and written in place (`KVCache`), never concatenated;
- a pass of L > 1 new tokens (prefill, verification) reads each layer's cache once for all
  L queries and all query heads of a KV group (GQA folded into the query rows);
- several sequences run in one pass: projections and MLPs over the concatenated tokens, and
  one attention call per layer for all of them: their caches sit side by side in a `KVPool`
  (made there by `new_cache(arena=)`, or copied in once; requests that end free their slots
  and requests that join take free ones, see `vericache.model.kvcache`), each sequence's rows
  padded to the longest (decode 1, verify k + 1, a prefill chunk). The call is the native
  kernel (`vericache.model.kernels`: each row's keys as a range; float32 on CPU, passes of at
  most KERNEL_ROWS rows a sequence) or torch SDPA with masks for the ragged lengths;
- a drafter's caches may hold K/V in a narrower dtype than the model's (`draft_dtype`:
  bfloat16 for a float32 model on CPU, `vericache.model.kvcache.draft_kv_dtype`): written
  rounded, read widened, every sum in the model's dtype; its passes' products take a copy
  of the weights (`draft_weights`, `_draft_copy`, `_draft_linear`): the model's own
  quantized blocks where it came as them (a GGUF model's), else bfloat16. An item that
  asks for votes gets a kernel call of its own per layer that also sums each key's weights
  (`Attend.votes`: its rows' outputs are the bits they get without votes), or, where the
  kernel does not serve it, a call of its own and then the explicit-score path (`_votes`)
  for the votes alone: asking for votes never changes a row's bits, so a prefill chunk may
  give its question window's votes (`vote_from`); caches a pool cannot hold
  (the offloaded tier's working copies) a call of their own per layer;
- a fast pass of one batch group (decode, draft and verify steps of up to LINEAR_ROWS rows,
  ragged or not, over a family of pre-norm SiLU blocks, q/k norms allowed) runs all its
  layers in one native call (`_fused`, `linear.c`'s `vc_layers_f32`): the same kernel
  functions as the layer loop, in the same order, so the same bits, without the loop's
  Python and torch work between them;
- a cache may hold any subset of a sequence's tokens: RoPE is applied by absolute position
  before keys are stored, so dropped tokens leave no gap to fix;
- a sliding-window layer masks keys older than pos - window + 1, a chunked one (Llama 4's)
  those before its chunk's start (`first_seen`): by slot in a dense cache (slot = position;
  only the window's slots are read), by `KVCache.pos` in one that records positions (the
  drafter's subsets).

Shapes: T = tokens in the pass, L = a sequence's new tokens, H = hidden, Hq/Hkv = heads,
D = head dim, G = Hq // Hkv, n = tokens in a sequence's cache after the pass.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vericache.errors import InvalidArgument
from vericache.model import kernels, qweights
from vericache.model.families import (MLA, SUPPORTED, Chunk, Experts, Layer, Weights, extract,
                                       first_seen, kv_heads, q_heads, rowwise)
from vericache.model.kvcache import (KVCache, KVPool, draft_head_choice, draft_kv_dtype,
                                     draft_layers_choice,
                                     draft_weights_choice, draft_weights_dtype)

__all__ = ["SUPPORTED", "Runner", "SeqBatchItem"]
# A CPU pass of fewer tokens than this (decode, draft and small verify steps) runs torch's
# ops on one intra-op thread: measured on the 2-vCPU CI machine from a lane thread, 1 thread
# took 59 / 127 / 183 / 293 ms at 1 / 4 / 16 / 33 tokens against 87 / 206 / 266 / 312 ms
# with 2, and 2 threads won from 64 tokens on (MKL's products, which the native kernels now
# take where they serve: those run on the thread's own count, `Runner._threads`).
SMALL_PASS_ROWS = 48
# The invariant pass (items marked `bitwise`) runs every matrix product in calls of exactly
# this many rows, on one thread: a GEMM's reduction order is fixed by its call's shape and
# thread count, so a row's result is then the same whatever shares the pass (measured on
# this machine's MKL: a row's bits change with the rows in the call from 1 to 4 and from 15
# to 16, and with the thread count; benchmarks/row_invariance.py). Measured at 2k context
# (ms a pass, fast / invariant): with 16, 57 / 119 for a decode step (its row padded to 16),
# 190 / 452 for a 33-row verify pass, 296 / 320 for a batch-16 step; with 4, 58 / 92,
# 192 / 603 and 304 / 418. 16 serves batches and verify passes; 4 only batch-1 steps.
ROW_BLOCK = 16
# The native batch attention (`vericache.model.kernels`) serves passes of at most this many
# rows a sequence (decode, draft and verify steps); a prefill chunk's rows are a matrix
# product's work, which SDPA does better
KERNEL_ROWS = 64
# The native product (`vericache.model.kernels.linear`) serves a fast pass's projections,
# MLP and LM head up to this many rows (a prefill chunk's 256 included), on the caller's
# threads; F.linear (MKL) the rest. Measured on the 2-vCPU EPYC over one SmolLM2 layer's
# matrices and its LM head (ms, kernel on 2 threads / MKL on 1 / MKL on 2): 1 row
# 3.0 / 7.7 / 8.4, 33 rows 12.5 / 35.4 / 22.6, 256 rows 87 / 203 / 122, 512 rows
# 173 / 399 / 238 (/tmp probes; the kernel goes in panels of 128 rows). Only this CPU was
# measured: past 256 rows F.linear stays, where MKL's blocking may win on others.
LINEAR_ROWS = 256
# Products of at most BLOCK_ROWS rows read a GGUF model's weights in their quantized blocks
# (`vericache.model.qweights`, `linear.c`'s `vc_linear_qw`: the float32 kernel's bits, 5 or 9
# bits a weight read instead of 32); past it the widening costs more than the bytes saved.
# This CPU, a tenth of SmolLM2's layers' products on 2 threads, float32 / blocks (ms): 1 row
# 9.2 / 2.1, 16 rows 24.5 / 17.8, 33 rows 54.8 / 35.7, 64 rows 71.2 / 100.5 (thirtieth
# session, /tmp probe).
BLOCK_ROWS = 48
# a draft pass's LM head over weight blocks: the logits recomputed exactly after the int8 head
# (`kernels.Linear.draft_head`, `VERICACHE_DRAFT_HEAD`)
DRAFT_HEAD_TOP = 16
WEIGHT_BLOCKS = ("auto", "off")  # VERICACHE_WEIGHT_BLOCKS: find the blocks, or never
_outer = threading.local()  # .threads: a `_one_thread` pass's outer intra-op thread count


@dataclass
class SeqBatchItem:
    """One sequence's part of a forward pass."""

    tokens: torch.Tensor  # [L] int64, the new tokens
    positions: torch.Tensor  # [L] int64, their absolute positions
    cache: KVCache  # receives the new tokens' K/V at slots [cache.length, cache.length + L)
    logits: str = "last"  # "last" -> [1, V], "all" -> [L, V], "none" -> None
    capture_q: torch.Tensor | None = None  # [R] row indices whose post-RoPE queries to return
    captured: torch.Tensor | None = field(default=None, repr=False)  # [layers, Hq, R, D] out
    votes: bool = False  # return the attention mass each cached key gets from this pass
    vote_from: int = 0  # with votes: the first of its rows that votes (a prompt's question window)
    attn_votes: torch.Tensor | None = field(default=None, repr=False)  # [layers, Hkv, n] out
    bitwise: bool = False  # the invariant pass: a row's bits whatever shares it (Runner.forward)


@dataclass
class _Plan:
    """One attention call per layer for a group of a pass's sequences (`Runner._batch_plan`)."""

    group: list[int]  # the items, by index in the pass
    pool: KVPool | None  # several caches: their pool (batch row b = slot lo + b)
    cache: KVCache | None  # one cache: read directly
    lo: int  # the pool's first slot read
    B: int  # batch rows (the pool's slots [lo, lo + B))
    lq: int  # query rows per sequence, padded (the longest L)
    slots: torch.Tensor  # [n items] each item's batch row
    src: torch.Tensor  # [Tp] the group's rows in the pass
    pad: torch.Tensor  # [Tp] where each lands in the padded [B Lq] rows
    in_order: bool  # src and pad are both 0..T-1 (the pass's rows are the padded rows)
    hi: int  # keys read: slots [lo, hi), hi = the longest sequence's end
    masks: dict  # {window: (lo, mask [B, 1, G Lq, hi - lo] or None)}; None: causal only
    # (empty where `ranges` serve every layer)
    # {window: (lo, hi) [B, G Lq] int64}: each row's keys as a range, for the native kernel
    # (`vericache.model.kernels`); None: SDPA with `masks`
    ranges: dict | None
    positions: torch.Tensor | None  # [B, Lq] rows' positions (caches with positions)
    write_slot: torch.Tensor | None  # [Tp] the batch row each new K/V goes to (a pool)
    write_pos: torch.Tensor | slice  # [Tp] the cache slot it goes to (one cache: a slice)
    # one item that asks for votes, served by the kernel's votes (`Attend.votes`): its
    # layers' votes are written into the item's `attn_votes`
    votes: "SeqBatchItem | None" = None
    row_slot: torch.Tensor | None = None  # [B, Lq] each row's own slot (a dense cache's: position)
    # ALiBi for the native kernel: (slopes [Hkv, G Lq], each KV head's rows', the arithmetic)
    alibi: "tuple[torch.Tensor, int] | None" = None


def _activation(name: str):
    if name == "silu":
        return F.silu
    from transformers.activations import ACT2FN  # exactly transformers' function

    return ACT2FN[name]



def _tensors(obj) -> list[torch.Tensor]:
    """The tensors a layer holds: its fields', and those of the lists, tuples and dataclasses
    (`Experts`, `MLA`) among them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for x in vars(obj).values() for t in _tensors(x)]
    return []


def _chosen(idx: torch.Tensor):
    """A mixture's routing [T, top_k] by expert, ascending (the order transformers adds the
    experts' outputs in): (expert, its rows, their slots); a negative choice is none."""
    for expert in torch.unique(idx).tolist():
        if expert >= 0:
            yield (expert, *torch.where(idx == expert))


def _softcap(x: torch.Tensor, c: float) -> torch.Tensor:
    """Gemma's soft-cap, c * tanh(x / c), in transformers' order."""
    return torch.tanh(x / c) * c

class Runner:
    def __init__(self, cfg, w: Weights):
        self.num_layers = len(w.layers)  # (Mllama's cross-attention layers are not taken)
        self.num_heads = q_heads(cfg)
        self.num_kv_heads = kv_heads(cfg)
        self.head_dim = w.head_dim
        self.hidden = cfg.hidden_size
        self.layers: list[Layer] = w.layers
        # the dense MLP's width (the fused pass's; a mixture of experts' layers have none)
        self.intermediate = next((lyr.w_gate_up.shape[0] // 2 for lyr in w.layers
                                  if lyr.w_gate_up is not None), 0)
        self.vocab_size = w.lm_head.shape[0]
        self.eps = cfg.rms_norm_eps if w.eps is None else w.eps
        self.final_eps = w.final_eps  # the final norm's own (None: `eps`)
        self.layer_norm = w.layer_norm  # LayerNorms for the layers' and final norms
        self.torch_layer_norm = w.torch_layer_norm  # ... and they are torch's own
        self.norm_b = w.norm_b
        self.gated = w.gated
        self.embed, self.norm, self.lm_head = w.embed, w.norm, w.lm_head
        self.pos_embed = w.pos_embed
        self.embed_norm, self.embed_norm_b = w.embed_norm, w.embed_norm_b
        # ModernBERT-decoder's prediction head (dense, activation, norm) before the LM head
        self.head_dense, self.head_dense_b = w.head_dense, w.head_dense_b
        self.head_act = None if w.head_dense is None else _activation(w.head_activation)
        self.head_norm, self.head_norm_b = w.head_norm, w.head_norm_b
        self.q_scale, self.q_scale_from = w.q_scale, w.q_scale_from
        self.lm_head_b = w.lm_head_b
        self.ropes = w.ropes  # [(cos, sin) [P, R]]: a layer's table is ropes[layer.rope]
        self.max_positions = w.ropes[0][0].shape[0]
        # (a float32 residual stream keeps its embedding float32: the products' dtype then)
        self.dtype = w.layers[0].w_qkv.dtype if w.stream_float32 else w.embed.dtype
        self.device = w.embed.device
        self.stream_float32 = w.stream_float32
        self.group = self.num_heads // self.num_kv_heads
        self.scale = w.attn_scale or self.head_dim ** -0.5
        # (`Weights.q_prescaled`: q takes the scale, every attention call 1)
        self.q_prescale = self.scale if w.q_prescaled else None
        self.bias_after = w.bias_after
        self.residual_scale = w.residual_scale
        self.attn_eager = w.attn_eager
        self.sinks_lse = w.sinks_lse
        # (MiMo-V2-Flash's softmax in its dtype: outside float32, where it shows)
        self.softmax_in_dtype = w.softmax_in_dtype and self.dtype != torch.float32
        self.scores_baddbmm = w.scores_baddbmm and self.dtype != torch.float32
        self.glu_float32 = w.glu_float32
        self.attn_divisor = self.head_dim ** 0.5 if w.attn_divide else None
        if w.q_prescaled:
            self.scale = 1.0
        self.act = _activation(w.activation)
        self.embed_scale = (None if w.embed_scale is None else float(w.embed_scale)
                            if w.embed_scale_number else
                            torch.tensor(w.embed_scale, dtype=self.dtype, device=self.device))
        self.norm_upcast = w.norm_upcast
        self.final_softcap = w.final_softcap
        self.softcap_float32 = w.softcap_float32
        self.logit_divisor = w.logit_divisor
        self.logit_scale = w.logit_scale
        # Gemma 2's soft-capped scores: no fused kernel or SDPA computes them, so attention
        # takes the explicit path (`_sdpa`) and the native attention kernel is not used
        self.attn_softcap = w.attn_softcap
        # Flint's, GPT-Neo's, GPT-J's and CodeGen's scores in float32 (the explicit path) where
        # the model's are not
        # outside float32, where every rounding shows, the torch calls take transformers'
        # shapes and orders (SDPA's per-head call, windowed layers' masks and keys, Beam's
        # float32 GLU); float32 keeps the forms the kernels run faster
        self.narrow = self.dtype != torch.float32
        self.attn_float32 = w.attn_float32 and self.narrow
        # the layers' sliding windows and chunks (`first_seen`), each once
        self.windows = list(dict.fromkeys(lyr.window for lyr in w.layers if lyr.window))
        self.windowed = bool(self.windows)
        # ALiBi's slopes [Hq] (BLOOM's, MPT's, Falcon's): a score gets a bias from its key's
        # position (`_alibi`, each family's as transformers computes it); the explicit path
        self.alibi, self.alibi_kind = w.alibi, w.alibi_kind
        # a cache that holds a subset of a sequence's tokens records their positions only
        # where attention reads them
        self.positioned = self.windowed or self.alibi is not None
        # slots of each arena pool (`new_cache`); 0: caches of their own. An engine serving
        # batches sets it (`BatchEngine`: its max_batch)
        self.arena_slots = 0
        self._arenas: dict = {}  # (key, positions) -> the KVPool new caches of that key claim
        self._arena_lock = threading.Lock()  # the lanes' threads make caches
        # the fast path's batch attention for float32 on CPU (`vericache.model.kernels`;
        # None: SDPA with masks, as on other devices and dtypes)
        native = self.device.type == "cpu" and self.dtype == torch.float32
        # (nor GPT-OSS's attention sinks)
        sinks = any(lyr.sinks is not None for lyr in w.layers)
        # (`attn_float32` is off where it runs: a float32 model's scores are float32 already)
        self.attend_kernel = (kernels.attend() if native and not self.attn_softcap
                              and not sinks else None)
        # a drafter's caches' K/V (bfloat16 where this kernel reads them)
        self.draft_dtype = draft_kv_dtype(self.device, self.dtype, self.attend_kernel is not None)
        self.linear_kernel = kernels.linear() if native else None
        # the drafter's products: over a bfloat16 copy of the weights (`draft_weights`), made
        # at the first draft pass, so a process that never drafts (the verifier) holds none
        self.draft_weights = draft_weights_dtype(self.dtype, self.draft_dtype,
                                                 self.linear_kernel is not None)
        self._draft_w: dict[int, torch.Tensor] | None = None  # a weight's data_ptr -> its copy
        self._draft_head_int8 = False  # a draft pass's LM head is `draft_head`'s (`_draft_copy`)
        # a draft pass's layer products over blocks take x in two int8 parts (`_draft_copy`)
        self._draft_layers_x2 = False
        self._draft_fused_w = None
        self._draft_lock = threading.Lock()
        self.silu = w.activation == "silu"
        # the weights' pointers for `_fused` (None: the family's layers are not the pre-norm
        # block it runs, Gemma's extra norms and GeGLU, OLMo's post-norms, a mixture of
        # experts, or a kernel is missing)
        plain = all(lyr.ln_attn_out is None and lyr.ln_mlp_out is None and lyr.moe is None
                    and lyr.moa is None and lyr.diff is None
                    and lyr.qk_norm_wide is None and not lyr.parallel and lyr.mla is None
                    and not lyr.qk_norm_after_rope and not lyr.qk_layer_norm
                    and lyr.clip_qkv is None and lyr.act is None and not lyr.post_norms
                    and lyr.v_dim is None and lyr.v_scale is None and lyr.shortcut is None
                    and lyr.ln_attn_sub is None and lyr.ln_mlp_sub is None
                    and not lyr.out_gate and lyr.residual_mix is None
                    and lyr.b_o is None and lyr.b_gate_up is None and lyr.b_down is None
                    for lyr in w.layers) and not w.layer_norm and w.gated
        plain = plain and w.residual_scale is None and not w.q_prescaled and not w.bias_after
        plain = plain and len({c.shape[1] for c, _ in w.ropes}) == 1
        plain = plain and all(t is None or t.is_contiguous() for lyr in w.layers
                              for t in (lyr.ln_attn_in, lyr.w_qkv, lyr.b_qkv, lyr.qk_norm,
                                        lyr.w_o, lyr.ln_mlp_in, lyr.w_gate_up, lyr.w_down))
        self._fused_w = None
        if self.attend_kernel is not None and self.linear_kernel is not None and self.silu \
                and plain:
            self._fused_w = {name: kernels.pointers([getattr(lyr, attr) for lyr in w.layers])
                             for name, attr in (("ln_in", "ln_attn_in"), ("w_qkv", "w_qkv"),
                                                ("b_qkv", "b_qkv"), ("qk_norm", "qk_norm"),
                                                ("w_o", "w_o"),
                                                ("ln_mlp", "ln_mlp_in"), ("w_gu", "w_gate_up"),
                                                ("w_down", "w_down"))}
        # the products' weights in the blocks a GGUF model was quantized in, by the float32
        # matrix's data_ptr ({}: none, or VERICACHE_WEIGHT_BLOCKS=off): every pass's products
        # of at most BLOCK_ROWS rows read them, with the float32 kernel's bits
        self._blocks = self._find_blocks() if self.linear_kernel is not None else {}
        self._blocks_fused_w = None
        if self._fused_w is not None and all(w.data_ptr() in self._blocks
                                             for w in self._layer_mats()):
            self._blocks_fused_w = self._fused_with(self._blocks)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf, device: torch.device | None = None) -> "Runner":
        """Take the weights of a transformers causal LM of a SUPPORTED family (ModelLoadError
        otherwise, or for a RoPE type whose frequencies change with the length)."""
        # (a vision-language model's language part: its text config)
        return cls(hf.config.get_text_config(), extract(hf, device or torch.device("cpu")))

    def new_cache(self, capacity: int, positions: bool = False, arena=None,
                  dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache with room for `capacity` tokens (`positions`: one that records
        them; `dtype`: its K/V's, the model's by default, `draft_dtype` for a drafter's).
        `arena` (any hashable key; used on CPU once `arena_slots` is set): the cache is a
        slot of that key's pool (`KVPool.claim`), of `max_positions` tokens, so that the
        caches of one key, a batch, are pooled from their first token and its first pass
        copies nothing; a full pool starts another. Without: a cache of its own, which
        `KVPool.hold` copies into a pool at the first pass it shares (on this 2-core VM,
        writing fresh memory ran at 0.6 GB/s: 5.1 s for 16 caches of 2k tokens)."""
        dtype = dtype or self.dtype
        if arena is not None and self.arena_slots and self.device.type == "cpu":
            key = (arena, positions, dtype)
            with self._arena_lock:
                pool = self._arenas.get(key)
                c = None if pool is None else pool.claim(capacity)
                if c is None:
                    pool = self._arenas[key] = KVPool(
                        self.num_layers, self.num_kv_heads, self.head_dim, self.max_positions,
                        self.arena_slots, dtype, self.device, positions)
                    c = pool.claim(capacity)
            return c
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, capacity,
                       dtype, self.device, positions=positions)

    def cache_from(self, k: torch.Tensor, v: torch.Tensor, extra_capacity: int = 0,
                   pos: torch.Tensor | None = None, arena=None,
                   dtype: torch.dtype | None = None) -> KVCache:
        """`KVCache.from_tensors` in a cache of `new_cache` (with `arena`, a pool's slot;
        `dtype` as there)."""
        c = self.new_cache(k.shape[2] + extra_capacity, pos is not None, arena, dtype)
        c.append(k.to(self.device, c.k.dtype), v.to(self.device, c.k.dtype), pos)
        return c

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """K/V bytes a token takes in a cache of `dtype` (the model's by default)."""
        size = torch.empty(0, dtype=dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * size

    def draft_kv_bytes_per_token(self) -> int:
        """K/V bytes a token takes in a drafter's cache (`draft_dtype`)."""
        return self.kv_bytes_per_token(self.draft_dtype)

    # ---- the forward ----------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        """RMSNorm over the last dim; w: [x.shape[-1]] or broadcastable (per-head q/k norms);
        `eps`: the norm's own (else the model's). In float32 the native kernel's where it
        serves (a contiguous x), else torch's."""
        eps = self.eps if eps is None else eps
        if x.dtype == torch.float32 and w.dim() == 1:
            if self.linear_kernel is not None and x.is_contiguous():
                return self.linear_kernel.rms(x, w, eps)
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if self.norm_upcast:  # Gemma: scale in fp32 (w holds 1 + weight), then cast
            return (xf * w).to(x.dtype)
        return w * xf.to(x.dtype)  # Llama: normalise in fp32, scale in the model dtype

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
        """A layer's or the final norm: `_rms`, or where the family's norms are LayerNorms
        (`layer_norm`), `_layer_norm`; `eps`: the norm's own (else the model's)."""
        return self._layer_norm(x, w, b, eps) if self.layer_norm else self._rms(x, w, eps)

    def _layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                    eps: float | None = None) -> torch.Tensor:
        """A LayerNorm over the last dim: torch's (F.layer_norm, in the model's dtype or over a
        float32 copy) where the checkpoint's norms are (`Weights.torch_layer_norm`) and w is
        one vector; else in Cohere's order: centred, scaled by the variance's rsqrt and by w
        (plus b, StarCoder 2's), in float32, then cast; w and b [x.shape[-1]], or
        broadcastable (per-head q/k LayerNorms, `Layer.qk_layer_norm`); `eps`: the norm's
        own (else the model's)."""
        eps = self.eps if eps is None else eps
        if self.torch_layer_norm == "float32" and w.dim() == 1:
            return F.layer_norm(x.float(), (x.shape[-1],), w.float(),
                                None if b is None else b.float(), eps).to(x.dtype)
        if self.torch_layer_norm and w.dim() == 1:
            return F.layer_norm(x, (x.shape[-1],), w, b, eps)
        xf = x.float()
        xc = xf - xf.mean(-1, keepdim=True)
        var = xc.pow(2).mean(-1, keepdim=True)
        y = w.float() * (xc * torch.rsqrt(var + eps))
        return (y if b is None else y + b.float()).to(x.dtype)

    def _qk_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A pass's per-head q/k RMSNorm on x [T, heads, D] (a view of its qkv product), w
        [heads, D]: in place by the native kernel where it serves (float32 on CPU; the
        function `_fused` applies), else `_rms`."""
        if (self.linear_kernel is not None and x.dtype == torch.float32
                and w.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]):
            return self.linear_kernel.rms_heads(x, w, self.eps)
        return self._rms(x, w)

    def _rope_pass(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   pairs: bool = False, tail: bool = False) -> torch.Tensor:
        """A pass's RoPE on its fresh q/k rows x [T, heads, D] (a view of its qkv product, or
        its q/k norm's output; cos, sin [T, R]): in place by the native kernel where it
        serves (float32 on CPU), else `_rope`; over interleaved pairs where the layer's are
        (`Layer.rope_pairs`); over each head's last R dims with `tail` (latent attention's
        k_pe and q_pe, `MLA`), else its first."""
        if tail:  # the head's first D - R dims pass
            r = x.shape[-1] - cos.shape[-1]
            return torch.cat((x[..., :r], self._rope_pass(x[..., r:], cos, sin, pairs)), -1)
        if pairs:
            return self._rope(x, cos.unsqueeze(1), sin.unsqueeze(1), pairs=True)
        if self.linear_kernel is not None and x.dtype == torch.float32:
            return self.linear_kernel.rope(x, cos, sin)
        return self._rope(x, cos.unsqueeze(1), sin.unsqueeze(1))

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pairs: bool = False) -> torch.Tensor:
        # x: [T, heads, D]; cos, sin: [T, 1, R], R <= D (partial rotary: the rest passes);
        # the pairs (x[i], x[i + R/2]), or (x[2i], x[2i + 1]) with `pairs`
        r = cos.shape[-1]
        xr = x if r == x.shape[-1] else x[..., :r]
        half = r // 2
        rot = (torch.stack((-xr[..., 1::2], xr[..., ::2]), dim=-1).flatten(-2) if pairs
               else torch.cat((-xr[..., half:], xr[..., :half]), dim=-1))
        # (a float32 table for a narrower model, OLMo's: RoPE in float32, then cast back)
        out = (xr * cos + rot * sin).to(x.dtype)
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)

    def _future_mask(self, L: int, past: int) -> torch.Tensor | None:
        """[G L, past + L] True where a new token must not see a key (its own future)."""
        if L == 1:
            return None
        row_pos = torch.arange(L, device=self.device).repeat(self.group) + past  # rows: (g, l)
        return torch.arange(past + L, device=self.device)[None, :] > row_pos[:, None]

    def _masks(self, it: SeqBatchItem, L: int, past: int) -> dict:
        """{window: (lo, mask)} for one item: attention reads key slots [lo, past + L) with
        `mask` ([G L, past + L - lo], True: not seen) or None. The window None is the causal
        mask; a window's entry is made here for a dense cache only (one that records positions
        masks per layer and KV head, `_window_mask`)."""
        future = self._future_mask(L, past)
        out = {None: (0, future)}
        if getattr(it.cache, "pos", None) is not None:
            return out
        for w in self.windows:
            lo = max(0, first_seen(past, w))  # the first new token's oldest visible key
            if L == 1:
                out[w] = (lo, None)
                continue
            row_pos = torch.arange(L, device=self.device).repeat(self.group) + past
            keys = torch.arange(lo, past + L, device=self.device)[None, :]
            old = keys < first_seen(row_pos[:, None], w)
            out[w] = (lo, old | future[:, lo:])
        return out

    def _window_mask(self, kpos: torch.Tensor, positions: torch.Tensor, window: int,
                     future: torch.Tensor | None) -> torch.Tensor:
        """[Hkv, G L, n]: True where a row must not see a key, for a cache with positions
        (kpos: [Hkv, n] the slots' positions; positions: [L] the rows')."""
        row_pos = positions.to(self.device).repeat(self.group)  # rows: (g, l)
        old = kpos[:, None, :] < first_seen(row_pos, window)[None, :, None]
        return old if future is None else old | future

    def _votes(self, q: torch.Tensor, k_all: torch.Tensor, mask: torch.Tensor | None,
               votes: torch.Tensor, vote_from: int = 0, bias: torch.Tensor | None = None) -> None:
        """The explicit-score path's votes: q [L, Hq, D]; k_all [Hkv, n, D]; mask [G L, n] or
        per KV head [Hkv, G L, n], True where not seen; ALiBi's bias [Hkv, G L, n] (`_alibi`).
        Each key's attention mass summed over the rows from `vote_from` on (only they are
        scored) and the KV group's query heads is written into `votes` ([Hkv, n] fp32)."""
        L = q.shape[0]
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        qg = q.view(L, hkv, g, d).permute(1, 2, 0, 3)[:, :, vote_from:]  # [Hkv, G, rows, D]
        if mask is not None and vote_from:
            lead, n = mask.shape[:-2], mask.shape[-1]
            mask = mask.view(*lead, g, L, n)[..., vote_from:, :].reshape(*lead, -1, n)
        if bias is not None and vote_from:
            bias = bias.view(hkv, g, L, -1)[:, :, vote_from:].reshape(hkv, -1, bias.shape[-1])
        qg = qg.reshape(hkv, -1, d) * self.scale  # rows: (g, l)
        # one GEMM per KV head: a batched GEMM over Hkv=3 heads splits badly across 2 threads
        for h in range(hkv):
            scores = torch.mm(qg[h], k_all[h].t())  # [G rows, n]
            if self.attn_softcap:
                scores = _softcap(scores, self.attn_softcap)
            if bias is not None:
                scores = scores + bias[h]
            if mask is not None:
                scores.masked_fill_(mask if mask.dim() == 2 else mask[h], float("-inf"))
            torch.sum(torch.softmax(scores, dim=-1, dtype=torch.float32), dim=0, out=votes[h])

    def forward(self, items: list[SeqBatchItem]) -> list[torch.Tensor | None]:
        """Run one pass over every item's new tokens; returns each item's logits (fp32).

        Items marked `bitwise` run in the invariant pass (`_invariant_pass`): each of their
        rows gets the bits it gets in a pass of its own, so a verify pass's logits and the K/V
        it writes are those of the decode steps over the same tokens, and a batch's rows those
        of batch 1. Other items run in the fast pass, where a matrix product's reduction order
        depends on how many rows share it, and a row's low bits with it; except where the
        native kernels serve it (float32 on CPU, up to LINEAR_ROWS rows and KERNEL_ROWS rows a
        sequence, layers without a sliding window): their sums are placed by the row alone, so
        those passes are batch-invariant too (tests/test_exact.py), and `bitwise` items run
        in them (`_fast_is_invariant`)."""
        fast = [it for it in items if not it.bitwise]
        if len(fast) == len(items) or self._fast_is_invariant(items):
            return self._pass(items)
        bit = [it for it in items if it.bitwise]
        done = dict(zip(map(id, fast), self._pass(fast))) if fast else {}
        done.update(zip(map(id, bit), self._invariant_pass(bit)))
        return [done[id(it)] for it in items]

    def _find_blocks(self) -> dict:
        """The products' matrices (every layer's and the LM head) that have a lossless block
        form (`qweights.blocks_of`), by data_ptr. The first layer's qkv matrix decides: a
        model whose weights were not quantized (most checkpoints) is not searched further."""
        choice = os.environ.get("VERICACHE_WEIGHT_BLOCKS", "auto")
        if choice not in WEIGHT_BLOCKS:
            raise InvalidArgument("VERICACHE_WEIGHT_BLOCKS must be one of "
                                  f"{', '.join(WEIGHT_BLOCKS)} (got {choice!r})",
                                  "VERICACHE_WEIGHT_BLOCKS")
        mats = self._layer_mats() + [self.lm_head]
        first = None if choice == "off" else qweights.blocks_of(mats[0])
        if first is None:
            return {}
        found = {mats[0].data_ptr(): first,
                 **{w.data_ptr(): qweights.blocks_of(w) for w in mats[1:]}}
        return {p: q for p, q in found.items() if q is not None}

    def _layer_mats(self) -> list[torch.Tensor]:
        """Every layer's product matrices (`Layer.mats`), layer by layer; then the prediction
        head's dense product where the model has one (ModernBERT-decoder's)."""
        head = [] if self.head_dense is None else [self.head_dense]
        return [w for lyr in self.layers for w in lyr.mats()] + head

    def _fused_with(self, copies: dict) -> dict:
        """`_fused_w` with the products' pointers to `copies` (by the float32 matrix's
        data_ptr: tensors, or `QWeight`s by their C struct)."""
        def address(c) -> int:
            return c.address if isinstance(c, qweights.QWeight) else c.data_ptr()
        return {**self._fused_w, **{
            name: (ctypes.c_void_p * self.num_layers)(
                *[address(copies[getattr(lyr, attr).data_ptr()]) for lyr in self.layers])
            for name, attr in (("w_qkv", "w_qkv"), ("w_o", "w_o"), ("w_gu", "w_gate_up"),
                               ("w_down", "w_down"))}}

    def weight_bytes(self) -> int:
        """Bytes of the weights: the embedding, the norms and biases around the layers, the
        prediction head's and the LM head, and each layer's tensors, those of its mixtures
        of experts and latent attention too (each tensor once: a tied LM head counts once)."""
        seen, n = set(), 0
        tensors = [self.embed, self.norm, self.norm_b, self.lm_head, self.lm_head_b,
                   self.embed_norm, self.embed_norm_b, self.pos_embed, self.head_dense,
                   self.head_dense_b, self.head_norm, self.head_norm_b]
        tensors = [t for t in tensors if t is not None]
        for lyr in self.layers:
            tensors += _tensors(lyr)
        for t in tensors:
            if (t.data_ptr(), t.numel()) not in seen:
                seen.add((t.data_ptr(), t.numel()))
                n += t.numel() * t.element_size()
        return n

    def weight_block_bytes(self) -> int:
        """Bytes of the weights' block form (`_blocks`), which every pass shares."""
        return sum(q.nbytes for q in self._blocks.values())

    def draft_weight_bytes(self) -> int:
        """Bytes of the drafter's own weight copy (`draft_weights`; 0 until a draft pass made
        it, or where it is the blocks every pass shares: `weight_block_bytes`)."""
        return sum(t.nbytes for p, t in (self._draft_w or {}).items()
                   if self._blocks.get(p) is not t)

    def _draft_copy(self) -> dict:
        """The drafter's copies of the products' weights (every layer's and the LM head), by
        the model weight's data_ptr; made once, at the first draft pass. Each matrix in the
        blocks it was quantized in where they give it back exactly
        (`vericache.model.qweights`: a GGUF model's), else in bfloat16; the layers' matrices
        all one way (the native pass takes one weight type), the LM head its own
        (`VERICACHE_DRAFT_WEIGHTS=bfloat16`: bfloat16 always)."""
        with self._draft_lock:
            if self._draft_w is None:
                mats = self._layer_mats()
                blocks = draft_weights_choice() == "auto"
                found = [self._blocks.get(w.data_ptr()) for w in mats] if blocks else [None]
                if any(q is None for q in found):
                    found = [w.to(torch.bfloat16).contiguous() for w in mats]
                head = self._blocks.get(self.lm_head.data_ptr()) if blocks else None
                if head is None:
                    head = self.lm_head.to(torch.bfloat16).contiguous()
                self._draft_w = {w.data_ptr(): c for w, c in zip(mats + [self.lm_head],
                                                                  found + [head])}
                self._draft_head_int8 = (self.linear_kernel is not None and self.linear_kernel.q8x
                                         and draft_head_choice() == "auto")
                self._draft_layers_x2 = (self.linear_kernel is not None
                                         and self.linear_kernel.q8x_vnni
                                         and isinstance(found[0], qweights.QWeight)
                                         and draft_layers_choice() == "auto")
            return self._draft_w

    def draft_weight_form(self) -> str:
        """How the drafter's layers hold their weights: "blocks" (the model's own quantized
        blocks, exact), "bfloat16", or "model" (no copy); "" until a draft pass made it."""
        if self.draft_weights is None:
            return "model"
        if self._draft_w is None:
            return ""
        first = self._draft_w[self.layers[0].w_qkv.data_ptr()]
        return "blocks" if isinstance(first, qweights.QWeight) else "bfloat16"

    def draft_head_form(self) -> str:
        """How a draft pass computes its LM head: "int8" (`kernels.Linear.draft_head`: x
        rounded to int8, the largest DRAFT_HEAD_TOP logits exact) or "exact"; "" until a
        draft pass made the copy."""
        if self._draft_w is None:
            return ""
        return "int8" if self._draft_head_int8 else "exact"

    def draft_layers_form(self) -> str:
        """How a draft pass computes its layers' products: "int8x2" (over the model's weight
        blocks with x in two int8 parts, `vc_linear_qw_q8x2`) or "exact"; "" until a draft pass
        made the copy."""
        if self._draft_w is None:
            return ""
        return "int8x2" if self._draft_layers_x2 else "exact"

    def _draft_fused(self) -> dict:
        """`_fused_w` with the products' pointers to the drafter's copies (`_draft_copy`)."""
        copies = self._draft_copy()
        with self._draft_lock:
            if self._draft_fused_w is None:
                self._draft_fused_w = self._fused_with(copies)
            return self._draft_fused_w

    def _drafts(self, items: list[SeqBatchItem]) -> bool:
        """Whether a pass is a drafter's, whose products take the drafter's weight copy
        (`draft_weights`, `_draft_copy`): every cache holds the drafter's narrower K/V."""
        return self.draft_weights is not None and self.linear_kernel is not None and all(
            getattr(getattr(it.cache, "k", None), "dtype", None) == self.draft_dtype
            for it in items)

    def _draft_linear(self, x: torch.Tensor, w: torch.Tensor,
                      b: torch.Tensor | None = None) -> torch.Tensor:
        """A draft pass's product: over w's copy (`_draft_copy`: blocks, `vc_linear_qw`, or
        bfloat16, `vc_linear_bf16w`) up to LINEAR_ROWS rows, else `_linear`'s. The LM head's
        blocks: `kernels.Linear.draft_head` (x rounded to int8, the largest DRAFT_HEAD_TOP
        logits exact) where `_draft_head_int8` (`VERICACHE_DRAFT_HEAD`, AVX512-VNNI or AVX2)."""
        if x.shape[0] <= LINEAR_ROWS:
            c = self._draft_copy()[w.data_ptr()]
            head = w.data_ptr() == self.lm_head.data_ptr()
            if self._draft_head_int8 and head and isinstance(c, qweights.QWeight):
                return self.linear_kernel.draft_head(x, c, b, self._threads(), DRAFT_HEAD_TOP)
            return self.linear_kernel(x, c, b, self._threads(),
                                      int8_x=2 if self._draft_layers_x2 and not head else 0)
        return self._linear(x, w, b)

    def _native_block(self) -> bool:
        """Whether the native library runs this runner's layers whole (`_fused_w`: the
        pre-norm SiLU block) and both kernels are in place (tests may take one away)."""
        return (self._fused_w is not None and self.attend_kernel is not None
                and self.linear_kernel is not None)

    def _fast_is_invariant(self, items: list[SeqBatchItem]) -> bool:
        """Whether the fast pass over `items` gives each row the bits of a pass of its own, by
        construction: the native kernels serve every product (at most LINEAR_ROWS rows) and
        every attention call (at most KERNEL_ROWS rows a sequence, no sliding window: a
        window's keys start inside a part), over the pre-norm block whose norms (q/k norms
        too), RoPE and silu * up are the library's row-wise functions (`_native_block`), and
        no `bitwise` item captures queries (the invariant pass refuses them). Votes do not
        stop it: the kernel's votes leave a row's bits as they are."""
        if not self._native_block():
            return False
        lens = [int(it.tokens.shape[0]) for it in items]
        return (not self.windowed and sum(lens) <= LINEAR_ROWS and max(lens) <= KERNEL_ROWS
                and not any(it.bitwise and it.capture_q is not None for it in items))

    def _invariant_pass(self, items: list[SeqBatchItem]) -> list[torch.Tensor | None]:
        """The pass with every row's reduction order fixed by that row's operands alone:
        - on one intra-op thread (a GEMM's split across threads changes its sums);
        - projections, MLP and LM head in GEMM calls of exactly ROW_BLOCK rows
          (`_block_linear`), whatever the rows' number;
        - attention row by row (`_attend_rows`): each row one SDPA call over exactly the keys
          it sees, the call a decode step makes, so the KV length's split is the row's own;
        - norms, RoPE and activations are per-row elementwise or last-dim reductions.
        Its cost against the fast pass: small GEMMs (no blocking across more rows) and one
        attention call per row and layer (benchmarks/exactness.py measures both)."""
        return self._one_thread(lambda: self._forward(items, invariant=True))

    @staticmethod
    def _one_thread(run):
        """run() on one intra-op thread. The setting is this thread's (OpenMP's and MKL's are
        per thread), so passes of other threads keep theirs; the native kernels still run on
        the thread's own count (`_threads`)."""
        threads = torch.get_num_threads()
        if threads == 1:
            return run()
        torch.set_num_threads(1)
        _outer.threads = threads
        try:
            return run()
        finally:
            _outer.threads = None
            torch.set_num_threads(threads)

    @staticmethod
    def _threads() -> int:
        """The calling thread's intra-op thread count (the one before a `_one_thread`): the
        native kernels' threads, in every pass (OpenMP's hand-off costs microseconds; batch-1
        decode attention at 7k, SmolLM2 layer: 0.35 ms on two threads, 0.59 on one)."""
        return getattr(_outer, "threads", None) or torch.get_num_threads()

    def _linear(self, x: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None = None) -> torch.Tensor:
        """A fast pass's product: the native kernel for at most LINEAR_ROWS rows (on all of
        the caller's threads: reading the weights is the cost; up to BLOCK_ROWS rows over the
        weights' blocks where they have them, the same bits), else F.linear."""
        if self.linear_kernel is not None and x.shape[0] <= LINEAR_ROWS:
            q = self._blocks.get(w.data_ptr()) if x.shape[0] <= BLOCK_ROWS else None
            return self.linear_kernel(x, w if q is None else q, b, self._threads())
        return F.linear(x, w, b)

    @staticmethod
    def _then_bias(lin):
        """`lin` without its bias, the bias added to the product (`Weights.bias_after`)."""
        def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            y = lin(x, w)
            return y if b is None else y + b
        return run

    @staticmethod
    def _block_linear(x: torch.Tensor, w: torch.Tensor,
                      b: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, w, b) in calls of exactly ROW_BLOCK rows (the last padded with zeros)."""
        m = x.shape[0]
        n = -(-m // ROW_BLOCK) * ROW_BLOCK
        if n != m:
            x = torch.cat([x, x.new_zeros(n - m, x.shape[1])])
        out = x.new_empty(n, w.shape[0])
        wt = w.t()
        for s in range(0, n, ROW_BLOCK):
            if b is None:
                torch.mm(x[s: s + ROW_BLOCK], wt, out=out[s: s + ROW_BLOCK])
            else:
                torch.addmm(b, x[s: s + ROW_BLOCK], wt, out=out[s: s + ROW_BLOCK])
        return out[:m]

    def _pass(self, items: list[SeqBatchItem]) -> list[torch.Tensor | None]:
        """One pass over every item's rows. On CPU a pass of fewer than SMALL_PASS_ROWS
        tokens runs on one intra-op thread."""
        rows = sum(int(it.tokens.shape[0]) for it in items)
        if self.device.type != "cpu" or rows >= SMALL_PASS_ROWS:
            return self._forward(items)
        return self._one_thread(lambda: self._forward(items))

    def _batch_plan(self, group: list[int], items: list[SeqBatchItem], lens: list[int],
                    pasts: list[int], starts: list[int]) -> "_Plan":
        """The attention of the items `group` (indices into items) as one call per layer.

        Caches: one cache read directly, several held in one `KVPool` (slot b = batch row b;
        a slot of the pool with no cache in this pass has only padding rows).
        Queries: each sequence's rows padded to the longest, GQA folded into the rows (rows
        (g, l) of KV head h), so K/V are read once per KV head, never repeated per query head.
        Masks ([B, 1 or Hkv, G Lq, Lk], True: seen; None where nothing is hidden) hide a row's
        future, the slots past its sequence's end, and keys outside a sliding window (by slot
        in a dense cache, by recorded position per layer in one with positions); a padding row
        sees every key (its output is dropped)."""
        dev, g = self.device, self.group
        caches = [items[i].cache for i in group]
        lq = max(lens[i] for i in group)
        with_pos = getattr(caches[0], "pos", None) is not None
        # the kernel reads only each row's own keys; SDPA reads every slot up to `hi`, masked
        kernel = (self.attend_kernel is not None and lq <= KERNEL_ROWS
                  and not (with_pos and self.positioned))
        if len(group) == 1:
            pool, first, slots, B = None, 0, [0], 1
        else:
            pool, first, top = KVPool.hold(caches, sparse=kernel)
            slots, B = [c.slot - first for c in caches], top - first
            if not kernel:
                pool.ready(first, top, max(pasts[i] + lens[i] for i in group))
        slot_t = torch.tensor(slots, device=dev)
        L_t = torch.zeros(B, dtype=torch.long, device=dev)
        past_t = torch.zeros(B, dtype=torch.long, device=dev)
        L_t[slot_t] = torch.tensor([lens[i] for i in group], device=dev)
        past_t[slot_t] = torch.tensor([pasts[i] for i in group], device=dev)
        # the pass's rows of this group, and where each lands in the padded [B Lq] rows
        src = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in group]).to(dev)
        pad = torch.cat([torch.arange(lens[i]) + s * lq for i, s in zip(group, slots)]).to(dev)
        dense_rows = bool(torch.equal(pad, torch.arange(B * lq, device=dev)))
        l_idx = torch.arange(lq, device=dev)
        real = l_idx[None, :] < L_t[:, None]  # [B, Lq]
        row_slot = past_t[:, None] + l_idx[None, :]  # [B, Lq] a row's own slot
        hi = int((past_t + L_t).max())
        positions = None
        if getattr(caches[0], "pos", None) is not None:  # rows' absolute positions (padding: never "old")
            positions = torch.full((B, lq), -(1 << 40), dtype=torch.long, device=dev)
            positions.view(-1)[pad] = torch.cat([items[i].positions for i in group]).to(dev)
            for i, c in zip(group, caches):
                c.pos[:, :, pasts[i]: pasts[i] + lens[i]] = items[i].positions.to(c.pos.device)

        def mask_for(lo: int, window: int | None) -> torch.Tensor | None:
            keys = torch.arange(lo, hi, device=dev)[None, None, :]  # [1, 1, Lk]
            seen = keys <= row_slot[:, :, None]  # causal, and no slot past the sequence's end
            if window is not None:
                seen &= keys >= first_seen(row_slot[:, :, None], window)
            seen |= ~real[:, :, None]
            # (outside float32 a windowed layer's mask stays once its keys span the window,
            # seen or not, as transformers keeps it there: `_sdpa` then takes its grouped call)
            span = None if window is None else getattr(window, "size", window)
            if bool(seen.all()) and (span is None or not self.narrow or hi - lo < span):
                return None
            return seen[:, None].expand(B, g, lq, hi - lo).reshape(B, 1, g * lq, hi - lo)

        masks, ranges = {}, None
        if kernel:  # each row's keys as a range, [window start, own slot], for every layer
            hi_rows = torch.where(real, row_slot + 1, 0)  # padding rows: no keys
            ranges = {w: (torch.where(real, first_seen(row_slot, w).clamp(min=0), 0).repeat(1, g)
                          if w else torch.zeros_like(hi_rows).repeat(1, g), hi_rows.repeat(1, g))
                      for w in [None, *self.windows]}
        else:  # SDPA's masks
            masks[None] = (0, mask_for(0, None))
            if positions is None:
                for w in self.windows:
                    # (a chunked layer's keys outside float32 as transformers' cache holds
                    # them: from `size` - 1 positions before the pass's first row, those
                    # before a row's chunk masked; a verify pass takes the same start as a
                    # decode step at its first row)
                    lo = max(0, int(past_t[slot_t].min()) - w.size + 1
                             if isinstance(w, Chunk) and self.narrow
                             else int(first_seen(past_t[slot_t], w).min()))
                    masks[w] = (lo, mask_for(lo, w))
        total = sum(lens)
        in_order = dense_rows and B * lq == total and torch.equal(src, torch.arange(total, device=dev))
        return _Plan(group, pool, caches[0] if pool is None else None, first, B, lq, slot_t, src, pad,
                     in_order, hi, masks, ranges, positions,
                     slot_t.repeat_interleave(L_t[slot_t]) if pool is not None else None,
                     torch.cat([torch.arange(pasts[i], pasts[i] + lens[i]) for i in group]).to(dev)
                     if pool is not None else slice(pasts[group[0]], pasts[group[0]] + lens[group[0]]),
                     row_slot=row_slot, alibi=self._alibi_rows(lq) if kernel else None)

    def _attend_batch(self, p: "_Plan", li: int, lyr: Layer, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, written: bool = False) -> torch.Tensor | None:
        """One layer of a plan: write the rows' K/V into their caches, then one attention call
        over every sequence (the native kernel where the plan has ranges, else SDPA).
        q: [T, Hq, D], k, v: [T, Hkv, D] (the pass's rows) -> [Tp, Hq D], the group's rows in
        pass order. A plan with `votes` also writes its item's votes of the layer;
        `written` (such a plan only): the K/V are in the cache already, and the call gives
        the votes only (None)."""
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        qg, kg, vg = (q, k, v) if p.in_order else (q[p.src], k[p.src], v[p.src])
        if p.pool is None:
            ck, cv = p.cache.k[li], p.cache.v[li]  # [Hkv, cap, D]
            if not written:
                ck[:, p.write_pos] = kg.transpose(0, 1)
                cv[:, p.write_pos] = vg.transpose(0, 1)
            ck, cv = ck[None], cv[None]
        else:
            span = slice(p.lo, p.lo + p.B)
            ck, cv = p.pool.k[li, span], p.pool.v[li, span]  # [B, Hkv, cap, D]
            # (a drafter's narrower cache: rounded as written, as `_fused`'s kernel rounds)
            ck[p.write_slot, :, p.write_pos] = kg.to(ck.dtype)
            cv[p.write_slot, :, p.write_pos] = vg.to(cv.dtype)
        if p.in_order:
            qp = qg
        else:
            qp = qg.new_zeros(p.B * p.lq, self.num_heads, d)
            qp[p.pad] = qg
        qp = qp.view(p.B, p.lq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(p.B, hkv, g * p.lq, d)
        if p.ranges is not None and lyr.window in p.ranges:
            lo_r, hi_r = p.ranges[lyr.window]
            if p.votes is None:
                out = self.attend_kernel(qp, ck, cv, lo_r, hi_r, self.scale, self._threads(),
                                         p.alibi)
            else:  # one item: its rows over keys [lo, hi), hi <= its length
                out = self.attend_kernel.votes(qp, ck, None if written else cv, lo_r, hi_r,
                                               self.scale, self._threads(),
                                               p.votes.attn_votes[li][None],
                                               (p.lq, p.votes.vote_from), p.alibi)
                if written:
                    return None
        else:
            out = self._attend_sdpa(p, li, lyr, qp, ck, cv)
        out = out.view(p.B, hkv, g, p.lq, d).permute(0, 3, 1, 2, 4).reshape(p.B * p.lq, hkv * g * d)
        return out if p.in_order else out[p.pad]

    def _attend_sdpa(self, p: "_Plan", li: int, lyr: Layer, qp: torch.Tensor, ck: torch.Tensor,
                     cv: torch.Tensor) -> torch.Tensor:
        """SDPA over the plan's slots up to `p.hi`, with its masks: [B, Hkv, G Lq, D]."""
        hkv, g = self.num_kv_heads, self.group
        kpos = None  # caches with positions: the slots' [B, Hkv, hi]
        if p.positions is not None:
            kpos = (p.cache.pos[li][None] if p.pool is None
                    else p.pool.pos[li, p.lo: p.lo + p.B])[:, :, :p.hi]
        if lyr.window in p.masks:
            lo, mask = p.masks[lyr.window]
        else:  # a windowed layer over caches with positions: per layer and KV head
            lo = 0
            start = first_seen(p.positions, lyr.window)  # each row's first key [B, Lq]
            old = kpos[:, :, None, None, :] < start[:, None, None, :, None]
            old = old.expand(-1, -1, g, -1, -1).reshape(p.B, hkv, g * p.lq, p.hi)
            base = p.masks[None][1]
            mask = ~old if base is None else base & ~old
        bias = None
        if self.alibi is not None:  # (a dense cache: slot = position)
            bias = (self._alibi(torch.arange(lo, p.hi, device=self.device)[None, None], p.row_slot)
                    if kpos is None else self._alibi(kpos[:, :, lo:], p.positions))
        # (a drafter's narrower cache: widened to the queries' dtype for SDPA; latent
        # attention's and MiMo-V2-Flash's values without their padding, as transformers' SDPA
        # call takes them)
        mv = lyr.value_width or qp.shape[-1]
        out = self._sdpa(qp, ck[:, :, lo: p.hi].to(qp.dtype),
                         cv[:, :, lo: p.hi, :mv].to(qp.dtype), mask, lyr.sinks, bias)
        return out if mv == qp.shape[-1] else F.pad(out, (0, qp.shape[-1] - mv))

    def _item_alibi(self, it: SeqBatchItem, li: int, lo: int, hi: int,
                    qpos: torch.Tensor) -> torch.Tensor:
        """ALiBi's bias for one item's rows at positions qpos [L] over its cache's keys
        [lo, hi) in layer li (a dense cache's slots are positions; else `KVCache.pos`):
        [Hkv, G L, hi - lo]."""
        pos = getattr(it.cache, "pos", None)
        kpos = torch.arange(lo, hi, device=self.device)[None] if pos is None else pos[li, :, lo:hi]
        return self._alibi(kpos, qpos.to(self.device))

    def _alibi_rows(self, lq: int) -> "tuple[torch.Tensor, int] | None":
        """The native kernel's ALiBi (`Attend.__call__`'s `alibi`) for rows of lq tokens a
        sequence: each KV head's rows' slopes [Hkv, G lq] (rows (g, l)), and the arithmetic."""
        if self.alibi is None:
            return None
        hkv, g = self.num_kv_heads, self.group
        slopes = self.alibi.float().view(hkv, g, 1).expand(hkv, g, lq).reshape(hkv, g * lq)
        return slopes.contiguous(), ("relative", "bloom", "falcon").index(self.alibi_kind)

    def _alibi(self, kpos: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """ALiBi's bias on the scores, [..., Hkv, G Lq, Lk] (rows (g, l), as the queries), for
        the keys' positions kpos [..., Hkv or 1, Lk] and the rows' qpos [..., Lq], as
        transformers computes each family's (`alibi_kind`). MPT's ("relative"): slope (key's
        position - row's position) in float32, an exact integer times the slope, so rounded
        once at any context length (transformers' MPT takes the key's less the last key's: one
        number a row apart, which softmax ignores). BLOOM's: slope x the key's position in
        float32, rounded to the model's dtype. Falcon's: the slope rounded to bfloat16 times
        the key's position, rounded to bfloat16, then over sqrt(D) in float32."""
        hkv, g = self.num_kv_heads, self.group
        if self.alibi_kind != "relative":
            if self.alibi_kind == "falcon":
                key = self.alibi.bfloat16().view(hkv, g, 1, 1) * kpos[..., :, None, None, :]
                key = key.float() / math.sqrt(self.head_dim)
            else:  # BLOOM's
                key = (self.alibi.view(hkv, g, 1, 1) * kpos[..., :, None, None, :]).to(self.dtype)
            b = key.expand(*key.shape[:-2], qpos.shape[-1], key.shape[-1])
            return b.reshape(*b.shape[:-4], hkv, g * qpos.shape[-1], kpos.shape[-1])
        rel = (kpos[..., :, None, None, :] - qpos[..., None, None, :, None]).float()
        b = self.alibi.view(hkv, g, 1, 1) * rel  # [..., Hkv, G, Lq, Lk]
        return b.reshape(*b.shape[:-4], hkv, g * qpos.shape[-1], kpos.shape[-1])

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """SDPA (q [B, Hkv, G L, D], rows by query head then row; mask: True where a key is
        seen; without a mask, outside float32, as transformers calls it: q [B, Hq, L, D]
        with `enable_gqa`), or the explicit path transformers' eager attention computes:
        with soft-capped scores (Gemma 2), scores times the scale, capped, masked, softmax
        in fp32, then cast back; with attention sinks (GPT-OSS, `sinks` [Hq]), each row's
        scores and its head's sink logit less their maximum, softmax in the model's dtype,
        the sink's share dropped (Granite-SWA's, `sinks_lse`: the plain output times
        sigmoid(logsumexp of the row's scores less the sink), in float32, cast back; outside
        float32, MiMo-V2-Flash's every layer so, a sink or not: `softmax_in_dtype`); with
        `attn_float32` (Flint's, GPT-Neo's, and GPT-J's and CodeGen's where loaded eager),
        those scores and that softmax in float32, the weights cast back; with `attn_eager`
        (GPT-1's, XGLM's), the explicit path as it is (GPT-1's scores divided by sqrt(D),
        `attn_divisor`); with `scores_baddbmm` (GPT-NeoX Japanese's) the scores in one
        baddbmm and their softmax in the model's dtype; with ALiBi's `bias` (`_alibi`), the
        scaled scores plus it (float32, MPT's order; BLOOM's: bias + scale q k^T in one
        baddbmm, in the model's dtype), softmax in float32, the weights cast back; Falcon's
        bias is SDPA's mask, as transformers passes it. A row that sees no key (a padding
        row) gives zeros, not NaN (Falcon's: finite values, discarded)."""
        explicit = (self.attn_softcap or sinks is not None or self.attn_float32 or self.attn_eager
                    or self.softmax_in_dtype or self.scores_baddbmm)
        if not explicit:
            if bias is None and mask is None and self.group > 1 and self.narrow:
                # (transformers' call without a mask, outside float32, where its order shows:
                # each query head its own rows, [.., Hq, L, D], K/V shared by `enable_gqa`;
                # float32 keeps the grouped rows, which torch's CPU kernel reads faster)
                *lead, hkv, rows, d = q.shape
                qh = q.reshape(*lead, hkv * self.group, rows // self.group, d)
                o = F.scaled_dot_product_attention(qh, k, v, scale=self.scale, enable_gqa=True)
                return o.reshape(q.shape)
            if bias is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            if self.alibi_kind == "falcon":  # transformers' SDPA with the bias as its mask
                low = torch.finfo(q.dtype).min
                m = bias.to(q.dtype) if mask is None else bias.to(q.dtype).masked_fill(~mask, low)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=self.scale)
        if self.attn_float32:
            q, k = q.float(), k.float()
        if bias is not None and self.alibi_kind == "bloom":
            *lead, rows, d = q.shape
            n = k.shape[-2]
            kt = k.transpose(-1, -2).expand(*lead, d, n).reshape(-1, d, n)
            s = torch.baddbmm(bias.expand(*lead, rows, n).reshape(-1, rows, n),
                              q.reshape(-1, rows, d), kt, alpha=self.scale).view(*lead, rows, n)
            bias = None
        elif self.scores_baddbmm:  # (GPT-NeoX Japanese's)
            *lead, rows, d = q.shape
            n = k.shape[-2]
            kt = k.transpose(-1, -2).expand(*lead, d, n).reshape(-1, d, n)
            s = torch.baddbmm(q.new_zeros(kt.shape[0], rows, n), q.reshape(-1, rows, d), kt,
                              alpha=self.scale).view(*lead, rows, n)
        else:
            s = torch.matmul(q, k.transpose(-1, -2))
            s = s * self.scale if self.attn_divisor is None else s / self.attn_divisor
        if self.attn_softcap:
            s = _softcap(s, self.attn_softcap)
        if bias is not None:
            s = s + bias
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # each row's head's sink [..., Hkv, G L, 1]
            hkv, rows = s.shape[-3], s.shape[-2]
            g = sinks.shape[0] // hkv
            col = sinks.to(s.dtype).view(hkv, g, 1, 1).expand(hkv, g, rows // g, 1)
            col = col.reshape(hkv, rows, 1).expand(*s.shape[:-1], 1)
        if self.scores_baddbmm:
            w = torch.softmax(s, dim=-1).nan_to_num_(0.0)
            return torch.matmul(w.to(v.dtype), v)
        if (sinks is None and not self.softmax_in_dtype) or self.sinks_lse:
            w = torch.softmax(s, dim=-1, dtype=torch.float32).nan_to_num_(0.0).to(v.dtype)
            out = torch.matmul(w, v)
            if sinks is None:
                return out
            scale = (torch.logsumexp(s, dim=-1, keepdim=True) - col).float().sigmoid()
            return out * scale.to(out.dtype)
        if sinks is not None:
            s = torch.cat([s, col], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        w = torch.softmax(s, dim=-1, dtype=s.dtype)
        w = w[..., :-1] if sinks is not None else w.nan_to_num_(0.0)  # (a row with no key)
        return torch.matmul(w.to(v.dtype), v)

    @torch.inference_mode()
    def _forward(self, items: list[SeqBatchItem],
                 invariant: bool = False) -> list[torch.Tensor | None]:
        """The pass. Attention: the items whose caches one pool can hold (plain caches, no
        votes asked) in one call per layer (`_batch_plan`); any other cache (the offloaded
        tier's working copies) in a call of its own per layer; an item that asks for votes in
        a kernel call of its own that also sums each key's attention mass (where the kernel
        serves it; else a call of its own, then its votes on the explicit-score path,
        `_votes`). So asking for votes never changes a row's bits. `invariant`: the
        invariant pass's products and attention (`_invariant_pass`); the votes then come
        from a votes-only call."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        lens = [int(it.tokens.shape[0]) for it in items]
        tokens = torch.cat([it.tokens for it in items]).to(self.device)  # [T]
        positions = torch.cat([it.positions for it in items]).to(self.device)  # [T]
        if int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} past the model's "
                             f"{self.max_positions}-token context")
        ropes = [(cos[positions], sin[positions]) for cos, sin in self.ropes]  # [T, R]
        pasts, starts, explicit, start = [], [], [], 0
        for i, (it, L) in enumerate(zip(items, lens)):
            it.cache.reserve(L)
            past = it.cache.length
            pasts.append(past)
            starts.append(start)
            start += L
            if invariant and it.capture_q is not None:
                raise ValueError("an invariant pass cannot capture queries "
                                 "(prefill is not bitwise)")
            if invariant and self.windowed and getattr(it.cache, "pos", None) is not None:
                raise ValueError("an invariant pass needs dense caches for sliding-window layers")
            if it.capture_q is not None:
                it.captured = torch.empty(self.num_layers, hq, it.capture_q.shape[0], d,
                                          dtype=self.dtype, device=self.device)
            if it.votes:
                explicit.append(i)
                if getattr(it.cache, "pos", None) is not None:
                    it.cache.pos[:, :, past: past + L] = it.positions.to(it.cache.pos.device)
                it.attn_votes = torch.empty(self.num_layers, hkv, past + L,
                                            dtype=torch.float32, device=self.device)
        rest = [] if invariant else [i for i in range(len(items)) if not items[i].votes]
        groups = [rest] if rest and KVPool.poolable([items[i].cache for i in rest]) else [[i] for i in rest]
        plans = [self._batch_plan(gr, items, lens, pasts, starts) for gr in groups]
        voted = {}  # item index -> its plan, where the kernel serves its votes
        for i in explicit:
            vp = self._batch_plan([i], items, lens, pasts, starts)
            if vp.ranges is not None and all(lyr.window in vp.ranges for lyr in self.layers):
                vp.votes = items[i]
                voted[i] = vp
            elif not invariant:  # its rows as without votes; its votes after (`written`)
                plans.append(vp)
        explicit = [i for i in explicit if i not in voted]
        if not invariant:
            plans += voted.values()
        masks = {i: self._masks(items[i], lens[i], pasts[i]) for i in explicit}
        captures = [(it, s0, L) for it, s0, L in zip(items, starts, lens) if it.capture_q is not None]
        one = len(plans) == 1 and not explicit and plans[0].in_order  # the common case
        drafts = not invariant and self._drafts(items)
        lin = self._block_linear if invariant else self._draft_linear if drafts else self._linear
        if self.bias_after:
            lin = self._then_bias(lin)
        h = self.embed[tokens]  # [T, H]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if self.pos_embed is not None:
            h = h + self.pos_embed[positions]
        if self.embed_norm is not None:
            h = self._norm(h, self.embed_norm, self.embed_norm_b)
        fused = (len(plans) == 1 and not explicit and not invariant and not captures
                 and plans[0].votes is None and self._native_block()
                 and plans[0].ranges is not None and h.shape[0] <= LINEAR_ROWS
                 # (q scaled by its position from there on: Ministral 3's)
                 and (self.q_scale is None or int(positions.max()) < self.q_scale_from)
                 # a cache whose layers arrive during the pass (the offloaded tier's
                 # `StreamedKV`) is read layer by layer, by the loop
                 and (plans[0].pool is not None or isinstance(plans[0].cache.k, torch.Tensor)))
        if fused:
            self._fused(plans[0], h, ropes, drafts)
        for li, lyr in enumerate([] if fused else self.layers):
            x = (h if lyr.ln_attn_in is None or lyr.post_norms
                 else self._norm(h, lyr.ln_attn_in, lyr.ln_attn_in_b))
            if self.stream_float32:  # (Ergo's: the stream float32, the branch in the dtype)
                x = x.to(self.dtype)
            qkv = lin(x, lyr.w_qkv, lyr.b_qkv)  # [T, (Hq + 2 Hkv) D]
            if lyr.moa is not None:  # (JetMoE's: the queries its experts give, then K/V)
                q_moa, route = self._moa_queries(x, lyr.moa, lin)
                qkv = torch.cat([q_moa, qkv], 1)
            if lyr.clip_qkv is not None:
                qkv = qkv.clamp(-lyr.clip_qkv, lyr.clip_qkv)
            if lyr.mla is not None:
                qkv = self._mla(qkv, lyr.mla, lin)
            qk = qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d)
            if lyr.qk_norm_wide is not None:  # one norm over q's heads, one over k's
                # (each slice made contiguous, so that every pass takes the same norm: a
                # one-row slice is contiguous, and `_rms` takes the native one for it)
                wq, wk = lyr.qk_norm_wide[: hq * d], lyr.qk_norm_wide[hq * d:]
                qk = torch.cat([self._rms(qkv[:, : hq * d].contiguous(), wq),
                                self._rms(qkv[:, hq * d: (hq + hkv) * d].contiguous(), wk)], 1)
                qk = qk.view(-1, hq + hkv, d)
            if lyr.qk_layer_norm and self.torch_layer_norm:  # torch's, a call a norm
                w_, b_ = lyr.qk_norm, lyr.qk_norm_b
                cuts = ([0, hq, hq + hkv] if lyr.qk_norm_shared  # (one for q's heads, one k's)
                        else list(range(hq + hkv + 1)))  # (StableLM's: one a head)
                qk = torch.cat([self._layer_norm(qk[:, a:z], w_[a], None if b_ is None else b_[a])
                                for a, z in zip(cuts, cuts[1:])], 1)
            elif lyr.qk_layer_norm:
                qk = self._layer_norm(qk, lyr.qk_norm, lyr.qk_norm_b)
            elif lyr.qk_norm is not None and not lyr.qk_norm_after_rope:
                qk = self._qk_norm(qk, lyr.qk_norm)
            qk = self._rope_pass(qk, *ropes[lyr.rope], pairs=lyr.rope_pairs,
                                 tail=lyr.mla is not None)
            if lyr.qk_norm_after_rope:
                qk = self._qk_norm(qk, lyr.qk_norm)
            if lyr.qk_scale is not None:  # (Ergo's global layers)
                qk = qk * lyr.qk_scale
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
            if self.q_scale is not None and lyr.q_scaled:
                q = (q * self.q_scale[positions].view(-1, 1, 1)).to(q.dtype)
            v = qkv[:, (hq + hkv) * d: (hq + 2 * hkv) * d].view(-1, hkv, d)
            if lyr.v_scale is not None:
                v = v * lyr.v_scale
            for it, s0, L in captures:
                it.captured[li] = q[s0: s0 + L][it.capture_q].transpose(0, 1)
            if self.q_prescale is not None:
                q = q * self.q_prescale
            if invariant:
                attn = q.new_empty(q.shape[0], hq * d)
                for i, it in enumerate(items):
                    s0, L = starts[i], lens[i]
                    attn[s0: s0 + L] = self._attend_rows(it, li, lyr, q, k, v, s0, L, pasts[i])
                    if i in voted:  # the votes only: the rows' output is the SDPA calls'
                        self._attend_batch(voted[i], li, lyr, q, k, v, written=True)
                    elif it.votes:
                        self._votes_explicit(it, li, lyr, q, s0, L, pasts[i], masks[i])
            elif one:
                attn = self._attend_batch(plans[0], li, lyr, q, k, v)
            else:
                attn = q.new_empty(q.shape[0], hq * d)
                for p in plans:
                    attn[p.src] = self._attend_batch(p, li, lyr, q, k, v)
                for i in explicit:  # the votes only: their plans gave the rows
                    self._votes_explicit(items[i], li, lyr, q, starts[i], lens[i], pasts[i],
                                         masks[i])
            vd = lyr.value_width
            if vd is not None:  # each head's value, without the padding
                attn = attn.view(-1, hq, d)[..., :vd].reshape(-1, hq * vd)
            if lyr.diff is not None:  # (DiffLlama's: each head's two values' output, 2D)
                lam, init = lyr.diff
                o = attn.view(-1, hq, d)
                o = o[:, : hq // 2] - lam * o[:, hq // 2:]
                attn = ((1 - init) * F.rms_norm(o, (d,), eps=self.eps)).reshape(o.shape[0], -1)
            if lyr.q_heads is not None:  # the layer's own heads (Laguna's), not the padding
                attn = attn.view(attn.shape[0], hq, -1)[:, lyr.q_heads].reshape(attn.shape[0], -1)
            if lyr.out_gate:  # sigmoid(g), g the first product's last rows (+ Beam's bias)
                g = qkv[:, (hq + 2 * hkv) * d:]
                g = g if lyr.out_gate_b is None else g + lyr.out_gate_b
                if lyr.gate_softplus:  # (Laguna's: in float32, then cast)
                    gate = self._each(lambda t: F.softplus(t.float()).to(attn.dtype), g, invariant)
                else:
                    gate = self._each(torch.sigmoid, g, invariant)
                if lyr.gate_heads:  # one a head, over its width
                    attn = (attn.view(*gate.shape, -1) * gate[..., None]).view(attn.shape)
                else:
                    attn = attn * gate
            if lyr.ln_attn_sub is not None:  # (BitNet's)
                attn = self._rms(attn.contiguous(), lyr.ln_attn_sub)
            attn = (lin(attn, lyr.w_o, lyr.b_o) if lyr.moa is None
                    else self._moa_output(attn, lyr.moa, route, lin))
            if lyr.ln_attn_out is not None:
                attn = self._norm(attn.float() if self.stream_float32 else attn, lyr.ln_attn_out)
            if lyr.parallel and lyr.ln_mlp_in is not None:  # GPT-NeoX: the input, its own norm
                x = self._norm(h, lyr.ln_mlp_in, lyr.ln_mlp_in_b)
            if self.residual_scale is not None:
                attn = attn * self.residual_scale
            both = lyr.parallel and lyr.branches_first  # h + (attn + mlp), below
            mix = lyr.residual_mix
            if mix is not None:  # Beam's depth-scaled sums
                h = attn * mix[0] + h * mix[1]
            elif not both:
                h = h + attn
            if lyr.post_norms:  # GPT-1: the sums normed, the MLP on the attention's
                h = x = self._norm(h, lyr.ln_attn_in, lyr.ln_attn_in_b)
            elif not lyr.parallel:  # (parallel: the MLP reads the attention's input, x)
                x = h if lyr.ln_mlp_in is None else self._norm(h, lyr.ln_mlp_in, lyr.ln_mlp_in_b)
                if self.stream_float32:
                    x = x.to(self.dtype)
            if lyr.shortcut is not None:  # (LongCat-Flash's: added after the next layer's MLP)
                shortcut = self._experts(x, lyr.shortcut, lin, invariant)
            if lyr.moe is None:
                y = self._mlp(x, lyr.w_gate_up, lyr.w_down, lin, invariant, lyr.b_gate_up,
                              lyr.b_down, act=lyr.act, sub_norm=lyr.ln_mlp_sub)
            else:
                y = self._experts(x, lyr.moe, lin, invariant)
            if lyr.ln_mlp_out is not None:
                y = self._norm(y.float() if self.stream_float32 else y, lyr.ln_mlp_out)
            if self.residual_scale is not None:
                y = y * self.residual_scale
            h = y * mix[2] + h * mix[3] if mix is not None else h + (attn + y if both else y)
            if lyr.add_shortcut:
                h = h + shortcut
            if lyr.post_norms:
                h = self._norm(h, lyr.ln_mlp_in, lyr.ln_mlp_in_b)
        for it, L in zip(items, lens):
            it.cache.length += L
        return self._logits(items, lens, h, lin, invariant)

    def _mlp(self, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, lin,
             invariant: bool, b_gate_up: torch.Tensor | None = None,
             b_down: torch.Tensor | None = None,
             swiglu: tuple[float, float] | None = None, act=None,
             sub_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The gated MLP: down(act(gate x) * up x), gate and up one product; or, where the
        family's is not gated (`gated`), down(act(up x)); `act`: the layer's own activation
        (`Layer.act`), else the model's; `swiglu` (alpha, limit): GPT-OSS's
        experts' clamped SwiGLU (`Experts.swiglu`); `sub_norm`: BitNet's RMSNorm on the
        product's input before down. In the invariant pass activations run
        through `rowwise` (`_each`), but SiLU over the gate's slice: a slice's rows cannot
        merge into one run, so each row's run is the one a row alone gets, vector code and
        tail alike (exact GELU's is not: torch takes its vector code for contiguous input
        only)."""
        gu = lin(x, w_gate_up, b_gate_up)
        if swiglu is not None:
            alpha, limit = swiglu
            i = gu.shape[1] // 2
            gate = gu[:, :i].clamp(max=limit)
            glu = gate * self._each(torch.sigmoid, gate * alpha, invariant)
            a = (gu[:, i:].clamp(min=-limit, max=limit) + 1) * glu
        elif not self.gated:
            a = self._each(act or self.act, gu, invariant)
        elif self.glu_float32 and self.narrow:  # (Beam's)
            i = gu.shape[1] // 2
            a = (self._each(act or self.act, gu[:, :i].float(), invariant)
                 * gu[:, i:].float()).to(gu.dtype)
        elif (not invariant and self.silu and act is None and self.linear_kernel is not None
                and gu.shape[0] <= LINEAR_ROWS):
            a = self.linear_kernel.silu_mul(gu)  # the function `_fused` applies
        else:
            i = gu.shape[1] // 2
            a = self._each(act or self.act, gu[:, :i],
                           invariant and (act is not None or not self.silu)) * gu[:, i:]
        if sub_norm is not None:
            a = self._rms(a.contiguous(), sub_norm)
        return lin(a, w_down, b_down)

    @staticmethod
    def _each(fn, x: torch.Tensor, invariant: bool) -> torch.Tensor:
        """fn, elementwise, over x: through `rowwise` in the invariant pass, so that each row's
        bits are those it gets alone."""
        return rowwise(fn, x) if invariant else fn(x)

    def _mla(self, first: torch.Tensor, m: MLA, lin) -> torch.Tensor:
        """A latent attention's q, k and v in the layout of a qkv product [T, (Hq + 2 Hq) D]
        (`MLA`), from its first product: q (through its low-rank norm and q_b), each head's
        key (its k_nope from the normed latent, then the shared k_pe, rotated after) and value
        (padded with zeros to D)."""
        T, hq, d = first.shape[0], self.num_heads, m.nope + m.pe
        q = first[:, : m.q_rows]
        if m.q_b is not None:
            q = lin(self._rms(q.contiguous(), m.q_norm, m.eps), m.q_b)
        if m.q_scale is not None:
            q = q * m.q_scale
        latent, k_pe = first[:, m.q_rows: m.q_rows + m.rank], first[:, m.q_rows + m.rank:]
        latent = self._rms(latent.contiguous(), m.kv_norm, m.eps)
        if m.kv_scale is not None:
            latent = latent * m.kv_scale
        kv = lin(latent, m.kv_b).view(T, hq, m.nope + m.v)
        k = torch.cat([kv[..., : m.nope], k_pe.unsqueeze(1).expand(T, hq, m.pe)], -1)
        v = torch.cat([kv[..., m.nope:], kv.new_zeros(T, hq, d - m.v)], -1)
        return torch.cat([q.reshape(T, hq * d), k.reshape(T, hq * d), v.reshape(T, hq * d)], 1)

    def _experts(self, x: torch.Tensor, e: Experts, lin, invariant: bool) -> torch.Tensor:
        """A mixture of experts (`Experts`, in transformers' order): each expert's MLP over the
        rows that chose it, in one product, so a row's bits are those its own pass gives
        wherever `lin` is row-invariant (the native kernel, `_block_linear`)."""
        top, idx = e.route(lin(x.to(e.router.dtype), e.router, e.router_b), x.dtype)
        identity = None
        if e.zero_experts:  # (LongCat-Flash's: a zero-computation expert passes its row on)
            zero = idx >= len(e.gate_up)
            identity = x * top.masked_fill(~zero, 0.0).sum(dim=-1, keepdim=True)
            idx = idx.masked_fill(zero, -1)  # (transformers' weight 0 there: nothing to add)
        out = torch.zeros_like(x)
        # (`Experts.sum_slots`: each row's weighted outputs by slot, summed, then cast)
        slots = (x.new_zeros(*idx.shape, x.shape[1], dtype=torch.promote_types(x.dtype, top.dtype))
                 if e.sum_slots else None)
        elin = lin if slots is None else self._then_bias(lin)  # (grouped: biases added after)
        for expert, rows, slot in _chosen(idx):  # each row's sum in expert order
            weight = top[rows, slot, None]
            y = self._mlp((x[rows] * weight).to(x.dtype) if e.scale_input else x[rows],
                          e.gate_up[expert], e.down[expert], elin, invariant,
                          None if e.gate_up_b is None else e.gate_up_b[expert],
                          None if e.down_b is None else e.down_b[expert], e.swiglu)
            if e.out_norm is not None:  # (Ergo's: each expert's output normed by its own weight)
                y = (F.rms_norm(y.float(), (y.shape[-1],), eps=e.out_norm_eps)
                     * e.out_norm[expert]).to(x.dtype)
            if slots is not None:
                slots[rows, slot] = y * weight
            else:
                out.index_add_(0, rows, y if e.scale_input else (y * weight).to(out.dtype))
        if slots is not None:
            out = slots.sum(dim=1).to(x.dtype)
        if e.scale_after:
            out = out * e.scale
        if e.out_b is not None:  # (JetMoE's)
            out = out + e.out_b
        if identity is not None:
            out = out + identity.to(out.dtype)
        if e.shared_down is not None:
            shared = self._mlp(x, e.shared_gate_up, e.shared_down, lin, invariant,
                               e.shared_gate_up_b, e.shared_down_b)
            if e.shared_norm is not None:  # (Ergo's)
                shared = self._rms(shared.contiguous(), e.shared_norm)
            if e.shared_gate is not None:
                shared = rowwise(torch.sigmoid, lin(x, e.shared_gate)) * shared
            out = out + shared
        return out

    def _moa_queries(self, x: torch.Tensor, e: Experts, lin) -> tuple[torch.Tensor, tuple]:
        """A mixture of attention heads' queries (`Layer.moa`, JetMoE's) [T, Hq D]: each row's
        top_k experts' query products over the rows that chose them, laid out a K/V head's
        group at a time (head h's slots 0..top_k-1), and the route (weights, experts)."""
        top, idx = e.route(lin(x.to(e.router.dtype), e.router, e.router_b), x.dtype)
        hkv, d = self.num_kv_heads, self.head_dim
        q = x.new_empty(*idx.shape, hkv * d)  # [T, top_k, Hkv D]
        for expert, rows, slot in _chosen(idx):
            q[rows, slot] = lin(x[rows], e.gate_up[expert])
        return q.view(-1, e.top_k, hkv, d).transpose(1, 2).reshape(q.shape[0], -1), (top, idx)

    def _moa_output(self, attn: torch.Tensor, e: Experts, route: tuple, lin) -> torch.Tensor:
        """A mixture of attention heads' output: each slot's heads' output [T, Hkv D] through
        its expert's output product, times the row's weight, added in the experts' order
        (as transformers' index_add over the rows sorted by expert), plus the bias."""
        top, idx = route
        hkv, d = self.num_kv_heads, self.head_dim
        slots = attn.view(-1, hkv, e.top_k, d).transpose(1, 2)  # [T, top_k, Hkv, D]
        out = attn.new_zeros(attn.shape[0], e.down[0].shape[0])
        for expert, rows, slot in _chosen(idx):
            y = lin(slots[rows, slot].reshape(rows.shape[0], -1), e.down[expert])
            out.index_add_(0, rows, (y * top[rows, slot, None]).to(out.dtype))
        return out if e.out_b is None else out + e.out_b

    def _fused(self, p: "_Plan", h: torch.Tensor, ropes: list, drafts: bool = False) -> None:
        """Every layer of a fast pass in one native call (`kernels.Linear.layers`), on h
        [T, H] in place: the pass's products, norms, RoPE, K/V writes and attention, each the
        kernel function the layer loop calls, in the same order, so a row gets the same bits
        either way; what is left out is the loop's Python and torch work between them (about
        0.1 ms a layer). For one plan over all the pass's rows (in item order; `p.pad` places
        them among the padded rows), served by the native kernels (decode, draft and verify
        steps of up to LINEAR_ROWS rows) over a family whose layers
        are the pre-norm SiLU block, q/k norms allowed (`_native_block`), and caches held
        whole (not the offloaded tier's, whose layers land while the pass runs). `drafts`: a
        drafter's pass, over the drafter's weight copy (`_draft_linear`'s products)."""
        T, n = h.shape[0], self.num_layers
        if p.pool is None:
            K, V, base = p.cache.k, p.cache.v, 0
            sb, sh, sn = 0, K.stride(1), K.stride(2)
            wslot = torch.zeros(T, dtype=torch.long)
            wpos = torch.arange(p.write_pos.start, p.write_pos.stop)
        else:
            K, V, base = p.pool.k, p.pool.v, p.lo * p.pool.k.stride(1)
            sb, sh, sn = K.stride(1), K.stride(2), K.stride(3)
            wslot, wpos = p.write_slot, p.write_pos
        es = K.element_size()
        ck, cv = ((ctypes.c_void_p * n)(*[t.data_ptr() + (li * t.stride(0) + base) * es
                                          for li in range(n)]) for t in (K, V))
        cos = kernels.pointers([ropes[lyr.rope][0] for lyr in self.layers])
        sin = kernels.pointers([ropes[lyr.rope][1] for lyr in self.layers])
        lo = kernels.pointers([p.ranges[lyr.window][0] for lyr in self.layers])
        hi = kernels.pointers([p.ranges[lyr.window][1] for lyr in self.layers])
        if drafts:
            weights = self._draft_fused()
            w_type = (kernels.W_BFLOAT16 if self.draft_weight_form() != "blocks"
                      else kernels.W_BLOCKS_X2 if self._draft_layers_x2 else kernels.W_BLOCKS)
        elif self._blocks_fused_w is not None and T <= BLOCK_ROWS:
            weights, w_type = self._blocks_fused_w, kernels.W_BLOCKS
        else:
            weights, w_type = self._fused_w, kernels.W_FLOAT32
        arrays = {**weights, "cos": cos, "sin": sin, "ck": ck, "cv": cv, "lo": lo, "hi": hi}
        args = kernels.Pass(
            T=T, H=self.hidden, hq=self.num_heads, hkv=self.num_kv_heads, D=self.head_dim,
            I=self.intermediate, R=ropes[0][0].shape[1], layers=n, B=p.B, lq=p.lq,
            threads=self._threads(), eps=self.eps, scale=self.scale, h=h.data_ptr(),
            sb=sb, sh=sh, sn=sn, wslot=wslot.data_ptr(), wpos=wpos.data_ptr(),
            pad=None if p.in_order else p.pad.data_ptr(),
            attend=self.attend_kernel.address[K.dtype], kv_bf16=int(K.dtype == torch.bfloat16),
            w_type=w_type,
            **{name: ctypes.addressof(a) for name, a in arrays.items()})
        self.linear_kernel.layers(args)

    def _attend_rows(self, it: SeqBatchItem, li: int, lyr: Layer, q, k, v, s0: int, L: int,
                     past: int) -> torch.Tensor:
        """One item's layer in the invariant pass: write its rows' K/V, then each row one SDPA
        call over the keys it sees (slots [lo, its own + 1), a window's start lo), shaped as
        a one-row decode step's: [L, Hq D]."""
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        ck, cv = self._write_kv(it, li, k, v, s0, L, past)
        out = q.new_empty(L, hkv * g * d)
        for j in range(L):
            hi = past + j + 1
            lo = 0 if lyr.window is None else max(0, first_seen(hi - 1, lyr.window))
            qj = q[s0 + j: s0 + j + 1].view(1, 1, hkv, g, d).permute(0, 2, 3, 1, 4)
            # (a copy: torch's CPU SDPA gives other bits for a q that starts off 64 bytes, as
            # a row of a pass's product does where its width is not a multiple of 16 floats)
            qj = qj.reshape(1, hkv, g, d).clone()
            bias = (None if self.alibi is None
                    else self._item_alibi(it, li, lo, hi, it.positions[j: j + 1])[None])
            o = self._sdpa(qj, ck[None, :, lo:hi], cv[None, :, lo:hi], sinks=lyr.sinks, bias=bias)
            out[j] = o.reshape(-1)
        return out

    @staticmethod
    def _write_kv(it: SeqBatchItem, li: int, k, v, s0: int, L: int, past: int):
        """Write an item's rows' K/V (pass rows [s0, s0 + L)) into its cache's layer `li` at
        slots [past, past + L); returns that layer's K, V ([Hkv, cap, D])."""
        ck, cv = it.cache.k[li], it.cache.v[li]
        ck[:, past: past + L] = k[s0: s0 + L].transpose(0, 1)
        cv[:, past: past + L] = v[s0: s0 + L].transpose(0, 1)
        return ck, cv

    def _votes_explicit(self, it: SeqBatchItem, li: int, lyr: Layer, q, s0: int, L: int,
                        past: int, item_masks: dict) -> None:
        """One item's layer's votes on the explicit-score path (`_votes`), into its
        `attn_votes`: its rows' K/V are in the cache already (their plan or the invariant
        pass wrote them, and gave their outputs)."""
        ck = it.cache.k[li]  # [Hkv, cap, D]
        if lyr.window in item_masks:
            lo, mask = item_masks[lyr.window]
        else:  # a windowed layer over a cache with positions: per layer and KV head
            lo, mask = 0, self._window_mask(it.cache.pos[li, :, : past + L], it.positions,
                                            lyr.window, item_masks[None][1])
        votes = it.attn_votes[li]
        votes[:, :lo] = 0  # keys outside the window get no attention
        bias = None if self.alibi is None else self._item_alibi(it, li, lo, past + L, it.positions)
        self._votes(q[s0: s0 + L], ck[:, lo: past + L], mask, votes[:, lo:], it.vote_from, bias)

    def _logits(self, items: list[SeqBatchItem], lens: list[int], h: torch.Tensor, lin,
                invariant: bool = False):
        """Logits (fp32) only for the rows asked for; `lin` the pass's products (`invariant`:
        the invariant pass's, whose activations run row by row, `_each`)."""
        rows, spans, start = [], [], 0
        for it, L in zip(items, lens):
            if it.logits == "all":
                rows.append(torch.arange(start, start + L))
                spans.append(L)
            elif it.logits == "last":
                rows.append(torch.tensor([start + L - 1]))
                spans.append(1)
            else:
                spans.append(0)
            start += L
        if not rows:
            return [None] * len(items)
        hs = h[torch.cat(rows).to(self.device)]
        if self.norm is not None:  # (GPT-1's layers end in their own norm)
            hs = self._norm(hs, self.norm, self.norm_b, self.final_eps)
        if self.head_dense is not None:  # (ModernBERT-decoder's prediction head)
            hs = self._each(self.head_act, lin(hs, self.head_dense, self.head_dense_b), invariant)
            hs = self._norm(hs, self.head_norm, self.head_norm_b)
        if self.stream_float32:  # (Ergo's head: its input in the dtype, the product float32)
            hs = hs.to(self.dtype).float()
        logits = lin(hs, self.lm_head, self.lm_head_b)
        if self.logit_divisor:
            logits = logits / self.logit_divisor
        if self.logit_scale:
            logits = logits * self.logit_scale
        if self.final_softcap:
            logits = _softcap(logits.float() if self.softcap_float32 else logits,
                              self.final_softcap)
        logits = logits.float()
        out, start = [], 0
        for n in spans:
            out.append(logits[start: start + n] if n else None)
            start += n
        return out

    # ---- helpers for one sequence -------------------------------------------------
    def step(self, tokens, start_pos: int, cache: KVCache, logits: str = "last",
             capture_q: torch.Tensor | None = None, vote_from: int | None = None
             ) -> tuple[torch.Tensor | None, SeqBatchItem]:
        """One sequence's pass; `vote_from`: its rows from there on vote (`attn_votes`)."""
        toks = torch.as_tensor(tokens, dtype=torch.long)
        pos = torch.arange(start_pos, start_pos + toks.shape[0], dtype=torch.long)
        item = SeqBatchItem(toks, pos, cache, logits, capture_q, votes=vote_from is not None,
                            vote_from=vote_from or 0)
        return self.forward([item])[0], item
