"""The forward runner: forward(tokens, positions, cache) -> logits, for Llama-family models.

The runner owns the weights (taken once from the transformers model) and its own forward
over them, so that
- the KV cache is preallocated and written in place (`KVCache`), never concatenated;
- a pass of L > 1 new tokens (prefill, verification) reads each layer's cache once for all
  L queries and all query heads of a KV group (GQA folded into the query rows);
- several sequences run in one pass: projections and MLPs over the concatenated tokens,
  attention per sequence over its own cache (sequences of any length, no padding);
- a cache may hold any subset of a sequence's tokens: RoPE is applied by absolute position
  before keys are stored, so dropped tokens leave no gap to fix.

Shapes: T = tokens in the pass, L = a sequence's new tokens, H = hidden, Hq/Hkv = heads,
D = head dim, G = Hq // Hkv, n = tokens in a sequence's cache after the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vericache.errors import ModelLoadError
from vericache.model.kvcache import KVCache

SUPPORTED = ("llama", "mistral", "qwen2")
# A CPU pass of fewer tokens than this (decode, draft and small verify steps: skinny matrix
# products, bound by reading the weights) runs on one intra-op thread: measured on the 2-vCPU
# CI machine from a lane thread, 1 thread took 59 / 127 / 183 / 293 ms at 1 / 4 / 16 / 33
# tokens against 87 / 206 / 266 / 312 ms with 2, and 2 threads win from 64 tokens on.
SMALL_PASS_ROWS = 48


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
    attn_votes: torch.Tensor | None = field(default=None, repr=False)  # [layers, Hkv, n] out


@dataclass
class _Layer:
    ln_in: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    b_qkv: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    w_o: torch.Tensor  # [H, Hq D]
    ln_post: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 I, H]
    w_down: torch.Tensor  # [H, I]


class Runner:
    def __init__(self, cfg, embed: torch.Tensor, layers: list[_Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.intermediate = cfg.intermediate_size
        self.vocab_size = lm_head.shape[0]
        self.eps = cfg.rms_norm_eps
        self.max_positions = cos.shape[0]
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.cos, self.sin = cos, sin  # [P, D]
        self.dtype, self.device = embed.dtype, embed.device
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim ** -0.5

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf, device: torch.device | None = None) -> "Runner":
        cfg = hf.config
        if cfg.model_type not in SUPPORTED:
            raise ModelLoadError(f"model_type {cfg.model_type!r} is not supported by the runner; "
                                 f"supported: {', '.join(SUPPORTED)}")
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
                and cfg.sliding_window < cfg.max_position_embeddings:
            raise ModelLoadError("sliding-window attention models are not supported yet")
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type == "dynamic":
            raise ModelLoadError("dynamic NTK RoPE is not supported (positions must be static)")
        device = device or torch.device("cpu")
        m = hf.model

        def t(x):
            return x.detach().to(device).contiguous()

        layers = []
        for lyr in m.layers:
            a, mlp = lyr.self_attn, lyr.mlp
            bias = None
            if a.q_proj.bias is not None:
                bias = t(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            layers.append(_Layer(
                ln_in=t(lyr.input_layernorm.weight),
                w_qkv=t(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                b_qkv=bias, w_o=t(a.o_proj.weight), ln_post=t(lyr.post_attention_layernorm.weight),
                w_gate_up=t(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                w_down=t(mlp.down_proj.weight)))
        embed = t(m.embed_tokens.weight)
        lm_head = embed if cfg.tie_word_embeddings else t(hf.lm_head.weight)
        positions = torch.arange(cfg.max_position_embeddings).unsqueeze(0)
        probe = torch.zeros(1, dtype=embed.dtype)
        with torch.no_grad():
            cos, sin = m.rotary_emb(probe, positions)
        return cls(cfg, embed, layers, t(m.norm.weight), lm_head, t(cos[0]), t(sin[0]))

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, capacity,
                       self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.embed.element_size()

    # ---- the forward ----------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()  # as transformers' LlamaRMSNorm: normalise in fp32, scale in the model dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; cos, sin: [T, 1, D]
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _future_mask(self, L: int, past: int) -> torch.Tensor | None:
        """[G L, past + L] True where a new token must not see a key (its own future)."""
        if L == 1:
            return None
        row_pos = torch.arange(L, device=self.device).repeat(self.group) + past  # rows: (g, l)
        return torch.arange(past + L, device=self.device)[None, :] > row_pos[:, None]

    def _attend(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                future: torch.Tensor | None, votes: torch.Tensor | None = None) -> torch.Tensor:
        """q: [L, Hq, D]; k_all, v_all: [Hkv, past + L, D] -> [L, Hq D]. With `votes`
        ([Hkv, past + L] fp32), each key's attention mass summed over the rows is written there."""
        L = q.shape[0]
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        qg = q.view(L, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * L, d)  # rows: (g, l)
        qg = qg * self.scale
        out = qg.new_empty(hkv, g * L, d)
        # one GEMM per KV head: a batched GEMM over Hkv=3 heads splits badly across 2 threads
        for h in range(hkv):
            scores = torch.mm(qg[h], k_all[h].t())  # [G L, n]
            if future is not None:
                scores.masked_fill_(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
            if votes is not None:
                torch.sum(probs, dim=0, out=votes[h])
            torch.mm(probs.to(v_all.dtype), v_all[h], out=out[h])
        return out.view(hkv, g, L, d).permute(2, 0, 1, 3).reshape(L, hkv * g * d)

    def forward(self, items: list[SeqBatchItem]) -> list[torch.Tensor | None]:
        """Run one pass over every item's new tokens; returns each item's logits (fp32). On
        CPU a pass of fewer than SMALL_PASS_ROWS tokens runs on one intra-op thread."""
        rows = sum(int(it.tokens.shape[0]) for it in items)
        threads = torch.get_num_threads()  # this thread's setting (OpenMP's is per thread)
        if self.device.type != "cpu" or rows >= SMALL_PASS_ROWS or threads == 1:
            return self._forward(items)
        torch.set_num_threads(1)
        try:
            return self._forward(items)
        finally:
            torch.set_num_threads(threads)

    @torch.inference_mode()
    def _forward(self, items: list[SeqBatchItem]) -> list[torch.Tensor | None]:
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        lens = [int(it.tokens.shape[0]) for it in items]
        tokens = torch.cat([it.tokens for it in items]).to(self.device)  # [T]
        positions = torch.cat([it.positions for it in items]).to(self.device)  # [T]
        if int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} past the model's "
                             f"{self.max_positions}-token context")
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        pasts, masks = [], []
        for it, L in zip(items, lens):
            it.cache.reserve(L)
            pasts.append(it.cache.length)
            masks.append(self._future_mask(L, it.cache.length))
            if it.capture_q is not None:
                it.captured = torch.empty(self.num_layers, hq, it.capture_q.shape[0], d,
                                          dtype=self.dtype, device=self.device)
            if it.votes:
                it.attn_votes = torch.empty(self.num_layers, hkv, it.cache.length + L,
                                            dtype=torch.float32, device=self.device)
        h = self.embed[tokens]  # [T, H]
        for li, lyr in enumerate(self.layers):
            x = self._rms(h, lyr.ln_in)
            qkv = F.linear(x, lyr.w_qkv, lyr.b_qkv)  # [T, (Hq + 2 Hkv) D]
            qk = self._rope(qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
            v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
            outs = []
            start = 0
            for it, L, past, mask in zip(items, lens, pasts, masks):
                ck, cv = it.cache.k[li], it.cache.v[li]  # [Hkv, cap, D]
                ck[:, past: past + L] = k[start: start + L].transpose(0, 1)
                cv[:, past: past + L] = v[start: start + L].transpose(0, 1)
                qs = q[start: start + L]
                if it.capture_q is not None:
                    it.captured[li] = qs[it.capture_q].transpose(0, 1)
                outs.append(self._attend(qs, ck[:, : past + L], cv[:, : past + L], mask,
                                         it.attn_votes[li] if it.votes else None))
                start += L
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            h = h + F.linear(attn, lyr.w_o)
            x = self._rms(h, lyr.ln_post)
            gu = F.linear(x, lyr.w_gate_up)
            h = h + F.linear(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:], lyr.w_down)
        for it, L in zip(items, lens):
            it.cache.length += L
        # logits only for the rows asked for
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
        hs = self._rms(h[torch.cat(rows).to(self.device)], self.norm)
        logits = F.linear(hs, self.lm_head).float()
        out, start = [], 0
        for n in spans:
            out.append(logits[start: start + n] if n else None)
            start += n
        return out

    # ---- helpers for one sequence -------------------------------------------------
    def step(self, tokens, start_pos: int, cache: KVCache, logits: str = "last",
             capture_q: torch.Tensor | None = None) -> tuple[torch.Tensor | None, SeqBatchItem]:
        toks = torch.as_tensor(tokens, dtype=torch.long)
        pos = torch.arange(start_pos, start_pos + toks.shape[0], dtype=torch.long)
        item = SeqBatchItem(toks, pos, cache, logits, capture_q)
        return self.forward([item])[0], item
