"""Every supported model family, as a tiny random-weight model built from transformers' own
config class and loaded through the project's loader: the runner's logits are transformers'
(prefill, one-token and multi-token decode continuing a cache), `full` mode is
`hf.generate(do_sample=False)`, and `vericache` mode is `full` for every registered
compressor. Prompts are longer than the sliding windows (16 tokens) so windows slide, and the
chunk size is small so every compressor compresses chunks (some drop tokens: the drafter's
window then masks by recorded positions)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

N_NEW = 40
N_VERICACHE = 24  # a vericache case's tokens (`full`'s first): with a random model's few
# accepted drafts, a case is about that many rounds
PROMPT = 80
WINDOW = 16
CHUNK = 16
L4_CHUNK = 24  # Llama 4's attention chunk (`families.Chunk`)
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=2, eos_token_id=1,
              pad_token_id=0, tie_word_embeddings=False)
# (config class, config overrides); every model fp32, seed 0
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "llama-rope-llama3": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Llama's attention_bias (q, k, v and o_proj) and mlp_bias; the biases randomised by `build`
    "llama-biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    # Llama's block: Seed-OSS with biases everywhere; Arcee's MLP not gated (ReLU²); Helium
    # and ERNIE 4.5 with RoPE over interleaved pairs (ERNIE's in float32, Helium's norms too)
    "seed_oss": ("SeedOssConfig", dict(attention_bias=True, attention_out_bias=True,
                                       mlp_bias=True)),
    "arcee": ("ArceeConfig", dict(hidden_act="relu2")),
    "helium": ("HeliumConfig", dict(head_dim=32, attention_bias=True)),
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=32, use_bias=True)),
    # Ministral 3: YaRN, and q scaled by position past the original context (32 here)
    "ministral3": ("Ministral3Config", dict(head_dim=32, rope_parameters=dict(
        rope_type="yarn", rope_theta=1_000_000.0, factor=16.0, original_max_position_embeddings=32,
        beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1))),
    # run as Llama by transformers
    "internlm3": ("InternLM3Config", dict(head_dim=32)),
    "iquestcoder": ("IQuestCoderConfig", dict(head_dim=32)),
    # ERNIE 4.5's MoE: its block with experts on layers 1 and 2, a router with softmax scores and
    # a correction bias, a shared expert, biases everywhere (the LM head's too)
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(
        head_dim=32, use_bias=True, moe_num_experts=4, moe_k=2, moe_intermediate_size=64,
        moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral-sliding": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-sliding": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                          max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=64)),  # head_dim != hidden / heads
    "ministral": ("MinistralConfig", dict(head_dim=32, sliding_window=WINDOW, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"])),
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),  # layer 1 has no RoPE
    # SmolLM3 slides only on its NoPE layers
    "smollm3-sliding": ("SmolLM3Config", dict(no_rope_layers=[0, 1, 0], use_sliding_window=True,
                                              sliding_window=WINDOW)),
    # the residual multiplier is folded into o_proj and down_proj; not a power of two, so the
    # folded products round differently from transformers' and the margins are checked
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.09, logits_scaling=3.0)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=WINDOW)),
    # longrope is static up to its original context: the runner serves that much
    "phi3-longrope": ("Phi3Config", dict(original_max_position_embeddings=128, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=128,
        short_factor=[1.0 + 0.1 * i for i in range(16)], long_factor=[2.0 + i for i in range(16)]))),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", dict(
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    # OLMo 2's post-norms with per-head q/k norms; the global layer 2 has no RoPE
    "exaone4": ("Exaone4Config", dict(head_dim=32, sliding_window=WINDOW,
                                      layer_types=["sliding_attention", "sliding_attention",
                                                   "full_attention"])),
    "gemma": ("GemmaConfig", dict(head_dim=64, tie_word_embeddings=True)),
    # a low cap, so that the soft-capped scores differ from the plain ones
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, head_dim=64, sliding_window=WINDOW,
                                    query_pre_attn_scalar=48, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # Gemma 2 without the branches' output norms
    "vaultgemma": ("VaultGemmaConfig", dict(num_hidden_layers=4, head_dim=64, sliding_window=WINDOW,
                                            query_pre_attn_scalar=48, attn_logit_softcapping=2.0,
                                            final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, head_dim=64, sliding_window=WINDOW, query_pre_attn_scalar=48,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        # transformers' Gemma 3 ignores attn_logit_softcapping; set, it checks the runner does too
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True)),
    # LayerNorms with biases, biases on every projection, an MLP not gated, every layer sliding
    "starcoder2": ("Starcoder2Config", dict(sliding_window=WINDOW, use_bias=True,
                                            norm_epsilon=1e-5)),
    # LayerNorms with biases over Llama's block: StableLM (RoPE on a quarter of each head, q/k/v
    # biases; or parallel on one norm), Jais 2 (biases everywhere, ReLU² not gated), Nemotron
    # (1 + w LayerNorms, RoPE on half of each head, ReLU² not gated)
    "stablelm": ("StableLmConfig", dict(use_qkv_bias=True, layer_norm_eps=1e-5)),
    "stablelm-parallel": ("StableLmConfig", dict(use_parallel_residual=True, layer_norm_eps=1e-5)),
    # StableLM 2 12B's per-head q/k LayerNorms; Persimmon's one LayerNorm (with a bias) over
    # each of q's heads and one over k's, in GPT-NeoX's block with ReLU², RoPE on half a head
    "stablelm-qk": ("StableLmConfig", dict(qk_layernorm=True, use_qkv_bias=True,
                                           layer_norm_eps=1e-5)),
    "persimmon": ("PersimmonConfig", dict(qk_layernorm=True, partial_rotary_factor=0.5,
                                          layer_norm_eps=1e-5)),
    "jais2": ("Jais2Config", dict(layer_norm_eps=1e-5)),
    "nemotron": ("NemotronConfig", dict(norm_eps=1e-5, attention_bias=True, mlp_bias=True)),
    # Phi (2): parallel blocks on one LayerNorm, biases everywhere (the LM head's too), partial
    # rotary, an MLP not gated
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5, layer_norm_eps=1e-5)),
    # GLM: RoPE over interleaved pairs of each head's first half, q/k/v bias; GLM-4's norms on
    # each branch's output
    "glm": ("GlmConfig", dict(head_dim=32)),
    "glm4": ("Glm4Config", dict(head_dim=32)),
    # parallel blocks on LayerNorms, RoPE over interleaved pairs, scaled logits; Cohere 2's
    # full-attention layer has no RoPE
    "cohere": ("CohereConfig", dict(logit_scale=0.5, layer_norm_eps=1e-5)),
    "cohere2": ("Cohere2Config", dict(logit_scale=0.5, layer_norm_eps=1e-5, sliding_window=WINDOW,
                                      layer_types=["sliding_attention", "full_attention",
                                                   "sliding_attention"])),
    # Cohere Compass's language model: Cohere 2's block, RoPE over halves with a table a layer
    # type, none on a type whose parameters are None (here the full layer's); and with RoPE on
    # both types (their own thetas) and no logit scale
    "cohere_compass_text": ("CohereCompassTextConfig", dict(
        logit_scale=0.5, layer_norm_eps=1e-5, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": None})),
    "cohere_compass_text-rope": ("CohereCompassTextConfig", dict(
        layer_norm_eps=1e-5, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})),
    # ModernBERT-decoder: a LayerNorm on the embedding, none before the first layer's attention,
    # biases everywhere, sliding layers with their own RoPE, a prediction head (dense, GELU,
    # LayerNorm) before the LM head and its bias (its own init, scaled from initializer_range:
    # at 0.1 greedy output repeats one token within 8, so 0.3)
    "modernbert-decoder": ("ModernBertDecoderConfig", dict(
        initializer_range=0.3, norm_eps=1e-5, norm_bias=True, attention_bias=True, mlp_bias=True,
        local_attention=2 * WINDOW, layer_types=["sliding_attention", "full_attention",
                                                 "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    # DiffLlama: differential attention (each query head's scores weigh its K/V head's pair's
    # two values: heads 0 and 2, 1 and 3), the halves' difference RMS-normed
    "diffllama": ("DiffLlamaConfig", dict(num_attention_heads=8, num_key_value_heads=4,
                                          head_dim=32, lambda_std_dev=0.3)),
    # JetMoE: a mixture of attention heads (each row's 2 of 4 experts give its queries, one a
    # K/V head, and take their output back) and of MLP experts, each with an output bias; the
    # final norm's eps the config's, the layers' 1e-6
    "jetmoe": ("JetMoeConfig", dict(num_key_value_heads=2, kv_channels=32, num_local_experts=4,
                                    num_experts_per_tok=2, intermediate_size=64,
                                    rms_norm_eps=0.05)),
    # mixtures of experts: 4 experts, 2 a token (`Experts`); Mixtral's weights stay float32,
    # the others' are cast; Qwen2-MoE adds a gated shared expert and renormalises none;
    # Qwen3-MoE's layer 1 is a dense MLP (`mlp_only_layers`)
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
    "mixtral-sliding": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                              sliding_window=WINDOW)),  # every layer slides
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64,
                                         shared_expert_intermediate_size=96)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, head_dim=64,
                                         moe_intermediate_size=64, norm_topk_prob=True,
                                         mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    # OLMo 2's post-norm block with OLMoE's experts
    "flex_olmo": ("FlexOlmoConfig", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    # Granite's multipliers (the residual one folded into each expert's down_proj) over
    # Mixtral's block, whose router softmaxes its top-k float32 logits
    "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                            embedding_multiplier=12.0, residual_multiplier=0.22,
                                            attention_multiplier=0.09, logits_scaling=3.0)),
    # Granite-MoE with a shared MLP beside the experts (its residual multiplier folded too)
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=96,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.09,
        logits_scaling=3.0)),
    # DeepSeek-V3's router: sigmoid scores, a correction bias (randomised by `build`) in the
    # choice, the best of 2 groups of 4 experts (GLM-4.5, Solar Open), scaled weights, an
    # ungated shared expert; GLM-4.5's layer 0 is dense, its q/k norms on and RoPE on half of
    # each head; dots.llm1 slides on layers 1 and 2; EXAONE-MoE's global layer has no RoPE;
    # MiniMax-M2's router has no groups and its q/k norms span the whole projections
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                       topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1,
                                       moe_intermediate_size=64, use_qk_norm=True,
                                       attention_bias=True)),
    "dots1": ("Dots1Config", dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                  moe_intermediate_size=64, first_k_dense_replace=0,
                                  norm_topk_prob=True, sliding_window=WINDOW, max_window_layers=1)),
    "solar_open": ("SolarOpenConfig", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                           topk_group=1, n_shared_experts=1,
                                           moe_intermediate_size=64, routed_scaling_factor=1.5)),
    "exaone_moe": ("ExaoneMoeConfig", dict(num_experts=4, num_experts_per_tok=2, head_dim=32,
                                           num_shared_experts=1, moe_intermediate_size=64,
                                           sliding_window=WINDOW, layer_types=[
                                               "sliding_attention", "sliding_attention",
                                               "full_attention"])),
    "minimax_m2": ("MiniMaxM2Config", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=32,
                                           rotary_dim=16)),
    # learned absolute positions, no RoPE, LayerNorms and biases, MLPs not gated: GPT-2
    # (Conv1D products), GPT-BigCode (one K/V head; or each head's q, k, v in turn) and OPT
    # (its position table offset by 2)
    "gpt2": ("GPT2Config", {}),
    # GPT-1: GPT-2's products, a post-norm block (each sum normed), no final norm
    "openai-gpt": ("OpenAIGPTConfig", dict(layer_norm_epsilon=1e-5)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(multi_query=True)),
    "gpt_bigcode-mha": ("GPTBigCodeConfig", dict(multi_query=False)),
    "opt": ("OPTConfig", dict(ffn_dim=256, word_embed_proj_dim=128)),
    # BioGPT and XGLM: OPT's block with the embedding scaled by sqrt(hidden); XGLM's positions
    # a sinusoidal table
    "biogpt": ("BioGptConfig", dict(intermediate_size=256)),
    "xglm": ("XGLMConfig", dict(ffn_dim=256)),
    # CTRL: pre-LayerNorm blocks, a scaled embedding, a sinusoidal table, the LM head's bias
    "ctrl": ("CTRLConfig", dict(dff=256, layer_norm_epsilon=1e-6)),
    # ALiBi: BLOOM (a LayerNorm on the embedding, per-head interleaved q/k/v, its tanh GELU) and
    # MPT (LayerNorms without biases, q/k/v clamped, its own slopes); 4 heads' slopes, and 6's
    # (not a power of two: BLOOM's extra slopes between, MPT's interleaved)
    "bloom": ("BloomConfig", dict(layer_norm_epsilon=1e-5)),
    "bloom-6": ("BloomConfig", dict(num_attention_heads=6, hidden_size=192,
                                    layer_norm_epsilon=1e-5)),
    "mpt": ("MptConfig", dict(attn_config=dict(clip_qkv=0.6), layer_norm_epsilon=1e-5,
                              max_seq_len=512)),
    "mpt-6": ("MptConfig", dict(num_attention_heads=6, hidden_size=192, layer_norm_epsilon=1e-5,
                                max_seq_len=512)),
    # GPT-Neo: GPT-2's block, q/k/v without biases, scores not scaled, a local layer sliding
    "gpt_neo": ("GPTNeoConfig", dict(attention_types=[[["global", "local", "global"], 1]],
                                     window_size=WINDOW, layer_norm_epsilon=1e-5)),
    # GPT-NeoX: per-head interleaved q/k/v, RoPE on a quarter of each head, the MLP beside the
    # attention on a LayerNorm of its own (or after it)
    "gpt_neox": ("GPTNeoXConfig", {}),
    "gpt_neox-sequential": ("GPTNeoXConfig", dict(use_parallel_residual=False)),
    # GPT-NeoX Japanese: the sequential block, one bias (the last layer's attention output),
    # RoPE on half a head (at initializer_range 0.1 greedy output is one token: 0.5)
    "gpt_neox_japanese": ("GPTNeoXJapaneseConfig", dict(
        initializer_range=0.5, intermediate_multiple_size=2, layer_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    # latent attention (`MLA`): q through a low-rank norm (or one product), each head's key and
    # value from a normed latent beside one rotated k_pe (interleaved pairs, or halves), a value
    # narrower than the key, YaRN's mscale in the scale; DeepSeek-V3's experts after a dense
    # layer 0
    "deepseek_v3": ("DeepseekV3Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=24,
        num_key_value_heads=4, rope_interleave=True, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
            mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))),
    # DeepSeek-V3.2: DeepSeek-V3's block with a sparse attention's indexer, which keeps every
    # key up to its top k (300 here): served up to there
    "deepseek_v32": ("DeepseekV32Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=24,
        num_key_value_heads=4, index_topk=300, index_n_heads=2, index_head_dim=32,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=1.0,
                             beta_fast=32.0, beta_slow=1.0))),
    # GLM-MoE-DSA (GLM-5): the same, its later layers sharing an earlier one's indexer
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=24,
        head_dim=16, num_key_value_heads=4, index_topk=300, index_n_heads=2, index_head_dim=32,
        indexer_types=["full", "shared", "full"])),
    # the same attention: GLM-4.7-Flash, Youtu (dense), MiniCPM3 (dense, halves RoPE, its
    # embedding, branch and logit scales)
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
        num_key_value_heads=4, routed_scaling_factor=1.8)),
    "youtu": ("YoutuConfig", dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=48,
                                  qk_rope_head_dim=16, v_head_dim=32, num_key_value_heads=4)),
    "minicpm3": ("MiniCPM3Config", dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=48,
                                        qk_rope_head_dim=16, v_head_dim=32, num_key_value_heads=4,
                                        scale_emb=12, scale_depth=1.4, dim_model_base=32)),
    "deepseek_v3-q": ("DeepseekV3Config", dict(
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32, num_key_value_heads=4,
        rope_interleave=False, attention_bias=True)),
    # an output gate, sigmoid(g) on the attention's output: MiniCPM5-MoE (each head's q, then
    # its gate, in one projection; DeepSeek-V3's experts after a dense layer 0) and AFMoE
    # (norms before and after each branch, q/k norms, RoPE on the sliding layers only, muP's
    # embedding scale, a sigmoid router with a bias)
    "minicpm5_moe": ("MiniCPM5MoeConfig", dict(head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                                               n_group=2, topk_group=1, moe_intermediate_size=64,
                                               routed_scaling_factor=2.0)),
    # Beam: sandwich norms, a gated attention with a bias a head, RoPE on the sliding layers
    # only (q scaled by position on the others), depth-scaled residual sums, a grouped sigmoid
    # router after a dense layer, soft-capped logits
    # Ergo: Gemma 2's four norms, per-head q/k norms, global layers without RoPE and with q and
    # k scaled, a learned residual gate a dimension on each branch, a dense ReLU² MLP, then a
    # sigmoid router over ReLU² experts each normed by its own weight, a shared expert normed
    "ergo": ("ErgoConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_intermediate_size=64,
        first_dense_intermediate_size=256, sliding_window=WINDOW, global_attention_scale=2.0,
        moe_routed_scaling_factor=1.7, layer_types=["sliding_attention", "full_attention",
                                                    "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"])),
    "beam": ("BeamConfig", dict(
        head_dim=32, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64, n_group=2,
        topk_group=2, routed_scaling_factor=2.5, sliding_window=WINDOW, attention_bias=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": None})),
    "afmoe": ("AfmoeConfig", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                  num_shared_experts=1, moe_intermediate_size=64, route_scale=1.5,
                                  sliding_window=WINDOW, mup_enabled=True, layer_types=[
                                      "sliding_attention", "sliding_attention", "full_attention"])),
    # attention sinks, biases on q/k/v/o, alternating sliding layers, YaRN RoPE (its default);
    # experts with biases and the clamped SwiGLU, a router bias, softmax over the top-k logits
    # q/k norms after RoPE: HunYuan (its "dynamic" RoPE with a fixed alpha is static NTK-alpha;
    # the MoE's float32 router beside a shared MLP), nanochat (norms without weights, one on the
    # embedding, RoPE's rotation flipped, ReLU², soft-capped logits)
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(head_dim=32, rope_parameters=dict(
        rope_type="dynamic", alpha=1000.0, rope_theta=10000.0, factor=1.0))),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(head_dim=32, num_experts=4, moe_topk=2)),
    "nanochat": ("NanoChatConfig", dict(final_logit_softcapping=3.0)),
    # Mellum: Qwen3-MoE's block with sliding layers whose RoPE is their own, dense and sparse
    # MLPs
    "mellum": ("MellumConfig", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention",
                                            "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], rope_parameters={
            "full_attention": dict(rope_type="default", rope_theta=500000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
    # HY-V3: per-head q/k norms; a sigmoid router with a correction bias after a dense layer
    "hy_v3": ("HYV3Config", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=64, num_shared_experts=1,
                                 router_scaling_factor=2.5)),
    # DeepSeek-V2: latent attention with RoPE as complex pairs; its router's softmax scores,
    # the top 2 of the best group (a group scored by its best), scaled, not normalised
    "deepseek_v2": ("DeepseekV2Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        topk_method="group_limited_greedy", n_shared_experts=1, moe_intermediate_size=64,
        first_k_dense_replace=1, routed_scaling_factor=2.0, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32, num_key_value_heads=4)),
    "deepseek_v2-greedy": ("DeepseekV2Config", dict(
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=64,
        first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=48, qk_rope_head_dim=16,
        v_head_dim=32, num_key_value_heads=4)),
    # Phi-MoE: LayerNorms with biases, biases on the attention and the LM head, the sparse
    # mixer's two choices
    "phimoe": ("PhimoeConfig", dict(num_local_experts=4, attention_bias=True, lm_head_bias=True,
                                    router_jitter_noise=0.3)),
    # OLMo (the first): LayerNorms without weights, q/k/v clamped; Apertus: xIELU (learned, a
    # layer's own) in an MLP not gated, q/k norms; CWM: Llama's block with sliding layers
    "olmo": ("OlmoConfig", dict(clip_qkv=0.5)),
    "apertus": ("ApertusConfig", dict(head_dim=32)),
    # Apertus 1.5's language model: Apertus with its LM head pruned to the first 250 ids
    "apertus1p5_text": ("Apertus1p5TextConfig", dict(head_dim=32, output_vocab_size=250)),
    "cwm": ("CwmConfig", dict(head_dim=32, sliding_window=WINDOW, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"], rope_parameters=dict(
        rope_type="llama3", rope_theta=1_000_000.0, factor=16.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Granite's multipliers with sliding layers and attention sinks (Granite-SWA, its MoE), or
    # with norms on each branch's output and logits multiplied (HyperCLOVAX)
    "granite_swa": ("GraniteSWAConfig", dict(
        sliding_window=WINDOW, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.1, logits_scaling=2.0)),
    "granitemoe_swa": ("GraniteMoeSWAConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
        sliding_window=WINDOW, residual_multiplier=0.5, attention_multiplier=0.1)),
    "hyperclovax": ("HyperCLOVAXConfig", dict(
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1,
        logits_scaling=0.5)),
    # configurations transformers runs with another family's model: EXAONE 3 (Llama), Sarvam-MoE
    # and Param2-MoE (GLM-4.5's), Sarvam-MLA (DeepSeek-V3's)
    "exaone": ("ExaoneConfig", {}),
    "sarvam_moe": ("SarvamMoEConfig", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                           topk_group=1, moe_intermediate_size=64, head_dim=32)),
    "param2moe": ("Param2MoeConfig", dict(n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=64, head_dim=32)),
    # A.X-K1: DeepSeek-V3's layers with a low-rank q and a norm on the experts' output
    "axk1": ("AXK1Config", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, kv_lora_rank=32,
        qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32, num_key_value_heads=4,
        q_lora_rank=48, first_k_dense_replace=1, n_group=1, topk_group=1)),
    "sarvam_mla": ("SarvamMLAConfig", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, kv_lora_rank=32,
        qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32, num_key_value_heads=4)),
    # GPT-J: a parallel block on one LayerNorm, RoPE over interleaved pairs of a quarter of each
    # head, biases on the MLP and the LM head
    "gptj": ("GPTJConfig", dict(rotary_dim=8, n_inner=256)),
    # CodeGen: GPT-J's block, its q, v and k in four parts of one product (8 heads of 32: two
    # a part)
    "codegen": ("CodeGenConfig", dict(rotary_dim=8, n_inner=256, num_attention_heads=8,
                                      hidden_size=256)),
    # Falcon: the new architecture (each K/V group's queries, key and value in one product; a
    # norm for each parallel branch), multi-query with one norm (7B's), and per-head q/k/v in a
    # sequential block with biases
    "falcon": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2,
                                    ffn_hidden_size=256)),
    "falcon-mq": ("FalconConfig", dict(multi_query=True, parallel_attn=True, ffn_hidden_size=256)),
    "falcon-seq": ("FalconConfig", dict(multi_query=False, parallel_attn=False, bias=True,
                                        num_kv_heads=4, ffn_hidden_size=256)),
    # Falcon-RW's: that block with ALiBi, 16 heads (slopes 2^(-k/2), not exact in bfloat16, and
    # transformers' Falcon rounds each bias to it)
    "falcon-rw": ("FalconConfig", dict(multi_query=False, parallel_attn=False, bias=True,
                                       alibi=True, num_attention_heads=16, num_kv_heads=16,
                                       hidden_size=512, ffn_hidden_size=256)),
    # DBRX: LayerNorms without biases, q/k/v clamped, experts whose weights are divided by
    # their p-norm
    "dbrx": ("DbrxConfig", dict(d_model=128, n_heads=4, n_layers=3, max_seq_len=512,
                                attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=10000.0),
                                ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2,
                                                moe_normalize_expert_weights=2.0))),
    # Flint: Qwen3-MoE's block with sinks, RoPE on the sliding layers only, a sigmoid router
    # without a bias, a shared expert not gated, a dense layer 0
    "flint": ("FlintConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=96, head_dim=32,
                                  sliding_window=WINDOW, mlp_only_layers=[0], layer_types=[
                                      "full_attention", "sliding_attention", "sliding_attention"])),
    # Cohere 2 MoE: a dense prefix layer (full attention, RoPE), then experts; the second full
    # layer has no RoPE; the shared expert averaged in (LayerNorms), or summed (RMSNorms)
    # Aria's language model: Llama's block, experts on every layer (stored transposed), the
    # softmax of the top k logits in their dtype, a shared MLP
    "aria_text": ("AriaTextConfig", dict(moe_num_experts=4, moe_topk=2, head_dim=32)),
    # Kolibri-1: GLM-4's four norms, EXAONE 4's attention (RoPE on the sliding layers), a router
    # that chooses by its logits plus a bias
    "kolibri1": ("Kolibri1Config", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, head_dim=32, sliding_window=WINDOW,
        norm_topk_prob=True, layer_types=["sliding_attention", "full_attention",
                                          "sliding_attention"])),
    "cohere2_moe": ("Cohere2MoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
        prefix_dense_intermediate_size=96, sliding_window=WINDOW, sliding_window_pattern=2,
        logit_scale=0.5, layer_norm_eps=1e-5, rms_norm_eps=None)),
    "cohere2_moe-rms": ("Cohere2MoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
        shared_expert_combination_strategy="sum", rms_norm_eps=1e-6, sliding_window=WINDOW,
        logit_scale=0.5)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=32,
                                     sliding_window=WINDOW, swiglu_limit=2.0,
                                     layer_types=["sliding_attention", "full_attention",
                                                  "sliding_attention"])),
    # Granite 4.0 whose layers are all attention (Granite 4.0 Micro's kind): Granite's
    # multipliers, its shared MLP; with RoPE, and with experts and no positions (NoPE)
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        layer_types=["attention"] * 3, num_local_experts=0, shared_intermediate_size=96,
        position_embedding_type="rope", embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.09, logits_scaling=3.0)),
    "granitemoehybrid-moe": ("GraniteMoeHybridConfig", dict(
        layer_types=["attention"] * 3, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=96, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.09, logits_scaling=3.0)),
    # Phi-4-multimodal: Phi-3's block (partial rotary) beside tiny image and audio towers
    "phi4_multimodal": ("Phi4MultimodalConfig", dict(
        rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.5, rope_type="default"),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                          nemo_conv_channels=16, depthwise_seperable_out_channel=32,
                          ext_pw_out_channel=32))),
    # BitNet b1.58 (its plain-weight checkpoints): norms inside both branches, ReLU²
    "bitnet": ("BitNetConfig", {}),
    # LongCat-Flash: two of its layers (four of the runner's), each two latent attentions and
    # dense MLPs, the first's MLP input also through a mixture (two zero-computation experts
    # among six) added after the second's MLP
    "longcat_flash": ("LongcatFlashConfig", dict(
        num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=48,
        qk_rope_head_dim=16, head_dim=16, v_head_dim=32, n_routed_experts=4, zero_expert_num=2,
        moe_topk=2,
        expert_ffn_hidden_size=64, routed_scaling_factor=2.0)),
    # Laguna: layer 1 with half the query heads (the runner's padded groups), a softplus
    # output gate a head (an element: `laguna-element`), per-head q/k norms, sliding layers,
    # partial RoPE on the full layer, a sigmoid router with a bias and soft-capped logits
    # (the experts' sum scaled, a shared expert) after a dense layer 0
    "laguna": ("LagunaConfig", dict(
        head_dim=32, num_attention_heads_per_layer=[4, 2, 4], sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5,
        moe_router_logit_softcapping=3.0)),
    "laguna-element": ("LagunaConfig", dict(
        head_dim=32, num_attention_heads_per_layer=[2, 4, 2], gating="per-element",
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64)),
    # MiMo-V2-Flash: its full layer 0 with half the sliding layers' K/V heads, a value narrower
    # than the key and scaled, sinks on the sliding layers, partial RoPE a table a layer type,
    # DeepSeek-V3's router in groups (no shared expert) after a dense layer 0
    "mimo_v2_flash": ("MiMoV2FlashConfig", dict(
        head_dim=96, v_head_dim=64, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=64,
        routed_scaling_factor=2.5, sliding_window=WINDOW)),
    # Llama 4: chunked attention on its RoPE layers (chunks of L4_CHUNK start inside the
    # prompt, among the decode steps and inside verify passes), RoPE over interleaved pairs,
    # q/k norms without weights after it; layer 1 without RoPE, attending to every key, q
    # scaled from position floor_scale - 1 = 31 on; experts on layer 1 (step 2), the sigmoid
    # of the top logit scaling the chosen expert's input, beside a shared expert
    "llama4_text": ("Llama4TextConfig", dict(
        head_dim=32, num_local_experts=4, num_experts_per_tok=1, intermediate_size=64,
        intermediate_size_mlp=256, interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1],
        attention_chunk_size=L4_CHUNK, floor_scale=32, attn_scale=0.1)),
}
# Gemma 3's vision-language checkpoints (4B and up): the same text model inside, a tiny vision
# tower beside it (`build` puts COMMON into the text config)
ARCHS["gemma3"] = ("Gemma3Config", dict(
    text_config=ARCHS["gemma3_text"][1], mm_tokens_per_image=4,
    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, image_size=28, patch_size=14)))
# Mistral 3 and LLaVA: transformers loads them as image-text-to-text models only
ARCHS["mistral3"] = ("Mistral3Config", dict(
    text_config=dict(model_type="mistral", sliding_window=None),
    vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, head_dim=8,
                       num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)))
# Mistral 4: latent attention, a router with softmax scores, q scaled by position past 32;
# transformers loads it inside Mistral 3's image-text-to-text model only
ARCHS["mistral3-mistral4"] = ("Mistral3Config", dict(
    text_config=dict(
        model_type="mistral4", n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=64, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=48,
        qk_rope_head_dim=16, v_head_dim=32, head_dim=64, num_key_value_heads=4,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0,
                             beta_fast=32.0, beta_slow=1.0, llama_4_scaling_beta=0.1,
                             partial_rotary_factor=0.25)),
    vision_config=ARCHS["mistral3"][1]["vision_config"]))
ARCHS["llava"] = ("LlavaConfig", dict(
    text_config=dict(model_type="llama"),
    vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                       projection_dim=16, num_hidden_layers=1, num_attention_heads=2,
                       image_size=28, patch_size=14)))
# Apertus 1.5: its language model (the LM head pruned) beside tiny image and audio tokenizers,
# their codes' ids within the 300-token vocabulary
ARCHS["apertus1p5"] = ("Apertus1p5Config", dict(
    text_config=dict(ARCHS["apertus1p5_text"][1], model_type="apertus1p5_text"),
    vision_config=dict(codebook_size=40, base_channels=32, latent_channels=32, embed_dim=8,
                       num_res_blocks=1, channel_multiplier=[1, 2]),
    audio_config=dict(model_type="wavtokenizer_encoder", codebook_size=50, hidden_size=32,
                      codebook_dim=32, num_filters=4, num_lstm_layers=1),
    image_token_offset=200, audio_token_offset=240, image_token_id=250, audio_token_id=251))
# Aria: its language model beside a tiny vision tower (the image token outside the vocabulary)
ARCHS["aria"] = ("AriaConfig", dict(
    text_config=dict(ARCHS["aria_text"][1], model_type="aria_text"), image_token_id=VOCAB,
    projector_patch_to_query_dict={4: 4}, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14)))
# Llama 4's checkpoints (Scout, Maverick): its language model beside a tiny vision tower,
# here with the top two experts (the released ones take one), experts on every layer; the
# loader reads the language model alone (transformers' Llama4ForCausalLM takes its weights)
ARCHS["llama4"] = ("Llama4Config", dict(
    text_config=dict(ARCHS["llama4_text"][1], num_experts_per_tok=2, interleave_moe_layer_step=1),
    boi_token_index=VOCAB, eoi_token_index=VOCAB, image_token_index=VOCAB, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
        projector_output_dim=16)))
# Llama 3.2 Vision (`mllama`): Llama's blocks with Llama 3's RoPE scaling and a cross-attention
# layer (1), which transformers skips on text prompts and the runner does not take
ARCHS["mllama"] = ("MllamaConfig", dict(
    text_config=dict(ARCHS["llama-rope-llama3"][1], cross_attention_layers=[1]),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_global_layers=1, attention_heads=2, image_size=32, patch_size=16,
                       vision_output_dim=64, intermediate_layers_indices=[0])))
# Emu3: Llama's block beside a tiny image tokenizer (its visual tokens' ids in the vocabulary)
ARCHS["emu3"] = ("Emu3Config", dict(
    text_config=dict(model_type="emu3_text_model"), vq_config=dict(
        codebook_size=16, embed_dim=4, base_channels=32, channel_multiplier=[1, 1],
        num_res_blocks=1, attn_resolutions=[], hidden_size=32, num_attention_heads=1),
    vocabulary_map={f"<|visual token {i:06d}|>": 200 + i for i in range(16)}))
# the class that builds a checkpoint where the loader's is another (Llama 4's causal LM loads
# a checkpoint that its image-text-to-text model saved)
BUILD_CLASS = {"llama4": "Llama4ForConditionalGeneration"}
# Fuyu: Persimmon beside a linear embedding of image patches
ARCHS["fuyu"] = ("FuyuConfig", dict(text_config=dict(ARCHS["persimmon"][1], model_type="persimmon"),
                                    hidden_size=128, vocab_size=VOCAB, patch_size=4))
# Qwen2-VL, Qwen2.5-VL and Qwen3-VL: on text prompts their multimodal RoPE's three position
# ids are equal, so each section of the head reads the same frequencies as one RoPE would
# (sections in halves of the 32-wide heads; Qwen3-VL's interleaved)
_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=128)
ARCHS["qwen2_vl"] = ("Qwen2VLConfig", dict(
    text_config=dict(model_type="qwen2_vl_text", rope_parameters=dict(
        rope_type="default", rope_theta=1_000_000.0, mrope_section=[4, 6, 6])),
    vision_config=dict(depth=1, embed_dim=16, hidden_size=128, num_heads=2)))
ARCHS["qwen2_5_vl"] = ("Qwen2_5_VLConfig", dict(
    text_config=dict(model_type="qwen2_5_vl_text", rope_parameters=dict(
        rope_type="default", rope_theta=1_000_000.0, mrope_section=[4, 6, 6])),
    vision_config=dict(_VISION, fullatt_block_indexes=[0])))
ARCHS["qwen3_vl"] = ("Qwen3VLConfig", dict(
    text_config=dict(model_type="qwen3_vl_text", head_dim=32, rope_parameters=dict(
        rope_type="default", rope_theta=5_000_000.0, mrope_section=[6, 5, 5],
        mrope_interleaved=True)),
    vision_config=dict(_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16)))

# Vision-language checkpoints whose language model is a family above, checked by their logits
# alone (`test_a_vision_language_checkpoints_logits`): the runner takes the language model by
# its own family's function, which the tests above run in full. Tiny vision towers, text
# configs as above; config classes by model_type (transformers' CONFIG_MAPPING)
_CLIP = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
             projection_dim=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
             patch_size=14)
_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
               num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
_SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
_COHERE2 = dict(model_type="cohere2", sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"])
_QWEN3 = dict(model_type="qwen3", head_dim=32)
VL_LOGITS = {
    "llava_next": dict(text_config=dict(model_type="llama"), vision_config=_CLIP,
                       image_grid_pinpoints=[[28, 28]]),
    "llava_next_video": dict(text_config=dict(model_type="llama"), vision_config=_CLIP,
                             image_grid_pinpoints=[[28, 28]]),
    "llava_onevision": dict(text_config=dict(model_type="qwen2"), vision_config=_SIGLIP,
                            image_grid_pinpoints=[[28, 28]]),
    "vipllava": dict(text_config=dict(model_type="llama"), vision_config=_CLIP,
                     vision_feature_layers=[-1]),
    "video_llava": dict(text_config=dict(model_type="llama"), vision_config=_CLIP),
    "internvl": dict(text_config=dict(model_type="qwen2"), vision_config=dict(
        _SMALL, image_size=[28, 28], patch_size=[14, 14])),
    # Aya Vision scales its logits as Cohere 2 does; Cohere 2 Vision does not
    "aya_vision": dict(text_config=_COHERE2, vision_config=_SIGLIP),
    "cohere2_vision": dict(text_config=_COHERE2, vision_config=_SIGLIP),
    # Idefics 2 and 3 and SmolVLM: the language model is the model's `text_model`
    "idefics2": dict(text_config=dict(model_type="mistral", sliding_window=None),
                     vision_config=dict(_SMALL, image_size=28, patch_size=14),
                     perceiver_config=dict(hidden_size=128, resampler_depth=1, resampler_n_heads=2,
                                           resampler_head_dim=8, num_key_value_heads=1)),
    "idefics3": dict(text_config=dict(model_type="llama"),
                     vision_config=dict(_SMALL, image_size=28, patch_size=14)),
    "smolvlm": dict(text_config=dict(model_type="llama"),
                    vision_config=dict(_SMALL, image_size=28, patch_size=14)),
    "deepseek_vl": dict(text_config=dict(model_type="llama"), vision_config=_SIGLIP),
    "got_ocr2": dict(text_config=dict(model_type="qwen2"), vision_config=dict(
        _SMALL, mlp_dim=32, output_channels=16, image_size=32, patch_size=16, window_size=2,
        global_attn_indexes=[0])),
    "video_llama_3": dict(text_config=dict(model_type="qwen2"),
                          vision_config=dict(_SMALL, patch_size=14)),
    "ovis2": dict(text_config=dict(model_type="qwen2"), vision_config=dict(_SMALL, vocab_size=64)),
    "lighton_ocr": dict(text_config=_QWEN3, vision_config=dict(
        model_type="pixtral", hidden_size=16, intermediate_size=32, head_dim=8,
        num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)),
    "qianfan_ocr": dict(text_config=_QWEN3,
                        vision_config=dict(_SMALL, image_size=28, patch_size=14)),
    "exaone4_5": dict(text_config=dict(ARCHS["exaone4"][1], model_type="exaone4"),
                      vision_config=dict(_VISION, num_key_value_heads=2)),
    "hyperclovax_vision_v2": dict(text_config=dict(model_type="hyperclovax"), vision_config=dict(
        _VISION, model_type="qwen2_5_vl_vision", fullatt_block_indexes=[0])),
    "ovis2_5": dict(text_config=_QWEN3, vision_config=dict(
        _SMALL, vocab_size=64, image_size=28, patch_size=14, max_position_embeddings=16)),
    "janus": dict(text_config=dict(model_type="llama"),
                  vision_config=dict(_SMALL, image_size=32, patch_size=16, projection_dim=16,
                                     num_image_tokens=4),
                  vq_config=dict(embed_dim=8, num_embeddings=32, latent_channels=32,
                                 base_channels=32, channel_multiplier=[1, 1], num_res_blocks=1,
                                 num_patches=2, projection_dim=16, image_token_embed_dim=16)),
    # Cohere Compass (North Vision): its language model, with the deepstack tower unused on text
    "cohere_compass": dict(text_config=dict(ARCHS["cohere_compass_text"][1],
                                            model_type="cohere_compass_text"),
                           vision_config=dict(_VISION, deepstack_visual_indexes=[0],
                                              num_position_embeddings=16)),
    # Kimi K2.5: DeepSeek-V3 inside
    "kimi_k25": dict(text_config=dict(ARCHS["deepseek_v3"][1], model_type="deepseek_v3"),
                     vision_config=dict(_SMALL, pos_emb_height=4, pos_emb_width=4),
                     projection_hidden_size=16, tie_word_embeddings=False),
    "qwen3_vl_moe": dict(
        text_config=dict(model_type="qwen3_vl_moe_text", head_dim=32, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, rope_parameters=dict(
                             rope_type="default", rope_theta=5_000_000.0, mrope_section=[6, 5, 5],
                             mrope_interleaved=True)),
        vision_config=dict(_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16)),
}


def auto_class(name: str):
    """transformers' class that loads a model of `name` (the loader's choice)."""
    import transformers

    from vericache.model.loader import transformers_class

    return transformers_class(getattr(transformers, ARCHS[name][0]).model_type)


QWEN_VL = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
ABSOLUTE = {"gpt2", "gpt_bigcode", "gpt_bigcode-mha", "opt", "gpt_neo", "biogpt", "xglm", "ctrl",
            "openai-gpt"}
MLA_ARCHS = {"deepseek_v32", "glm_moe_dsa", "deepseek_v3", "deepseek_v3-q", "glm4_moe_lite",
             "youtu", "minicpm3", "mistral3-mistral4",
             "deepseek_v2", "deepseek_v2-greedy", "sarvam_mla", "axk1", "longcat_flash"}
MOE = {"mixtral", "mixtral-sliding", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe",
       "granitemoeshared", "glm4_moe", "dots1", "solar_open", "exaone_moe", "minimax_m2",
       "flex_olmo", "deepseek_v3", "deepseek_v3-q", "glm4_moe_lite", "mistral3-mistral4",
       "ernie4_5_moe", "minicpm5_moe", "afmoe", "hunyuan_v1_moe", "deepseek_v2", "deepseek_v2-greedy",
       "phimoe", "granitemoe_swa", "sarvam_moe", "param2moe", "sarvam_mla", "dbrx", "hy_v3",
       "mellum", "flint", "cohere2_moe", "cohere2_moe-rms", "kolibri1", "aria_text", "aria",
       "axk1", "beam", "mimo_v2_flash", "laguna", "laguna-element", "granitemoehybrid-moe",
       "jetmoe", "deepseek_v32", "glm_moe_dsa", "ergo"}
# DeepSeek-V3's router (`Experts.sigmoid`): its groups, each expert's weight's scale
SIGMOID = {"glm4_moe": ((2, 1), 2.5), "solar_open": ((2, 1), 1.5), "dots1": (None, 1.0),
           "deepseek_v32": ((2, 1), 2.5), "glm_moe_dsa": ((2, 1), 2.5),
           "deepseek_v3": ((2, 1), 2.5), "deepseek_v3-q": (None, 2.5), "glm4_moe_lite": (None, 1.8),
           "minicpm5_moe": ((2, 1), 2.0), "afmoe": (None, 1.5),
           "exaone_moe": (None, 2.5), "minimax_m2": (None, 1.0), "sarvam_moe": ((2, 1), 2.5),
           "param2moe": (None, 2.5), "sarvam_mla": (None, 2.5), "hy_v3": (None, 2.5),
           "kolibri1": (None, 1.0), "axk1": (None, 2.5), "beam": ((2, 2), 2.5),
           "mimo_v2_flash": ((2, 1), 2.5), "laguna": (None, 2.5), "laguna-element": (None, 1.0),
           "ergo": (None, 1.7)}
WINDOWED = {"mistral-sliding", "mixtral-sliding", "cohere2", "cohere_compass_text",
            "modernbert-decoder",
            "cohere_compass_text-rope", "starcoder2", "exaone4", "gpt_oss",
            "dots1", "exaone_moe", "afmoe", "cwm", "granite_swa", "granitemoe_swa", "mellum",
            "qwen2-sliding", "ministral", "smollm3-sliding", "phi3", "olmo3", "gemma2",
            "gemma3_text", "gemma3", "vaultgemma", "flint", "cohere2_moe", "cohere2_moe-rms",
            "gpt_neo", "kolibri1", "beam", "mimo_v2_flash", "laguna", "ergo"}
CHUNKED = {"llama4_text", "llama4"}  # chunked attention (`families.Chunk`)
ALIBI = {"bloom", "bloom-6", "mpt", "mpt-6", "falcon-rw"}
# smaller exact tails than the defaults, so an 80-token prompt has compressed chunks
SPEC_PARAMS = {"kivi": "kivi:residual=16", "snapkv": "snapkv:recent=16,window=8",
               "snapkv-kivi": "snapkv-kivi:residual=16,window=8", "streamingllm": "streamingllm:ratio=4"}
REPORT: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def report():
    """Prints the per-architecture table when the module ends (run with -s to see it)."""
    yield
    lines = [f"{'arch':<20} {'logit max-abs':>14} {'scale':>7}  full=generate  vericache=full"]
    for name, r in REPORT.items():
        vc = r.get("vericache=full", {})
        lines.append(f"{name:<20} {r.get('logit_maxabs', float('nan')):>14.3g} "
                     f"{r.get('logit_scale', float('nan')):>7.3g}  {str(r.get('full=generate')):<13}  "
                     + ", ".join(f"{k}:{'ok' if ok else 'DIFF'}(acc {a})" for k, (ok, a) in vc.items()))
    print("\n" + "\n".join(lines))


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0",
                                   eos_token="t1", bos_token="t2")


def build(name: str, folder, **config) -> None:
    """Save a tiny random model of `name` (every norm weight and bias randomised too, and
    xIELU's parameters, so a wrong norm offset, a missing q/k norm, a dropped bias or one
    layer's activation for another shows) with a word-level tokenizer;
    `config` overrides its config's fields (benchmarks/gpu_identity.py: a longer context)."""
    import transformers

    cls, over = ARCHS[name]
    if "text_config" in over:  # a vision-language model: the text fields are its text model's
        ids = {k: COMMON[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        text = {**COMMON, **over["text_config"], **config}
        cfg = getattr(transformers, cls)(**{**over, **ids, "text_config": text})
    else:
        cfg = getattr(transformers, cls)(**{**COMMON, **over, **config})
    torch.manual_seed(0)
    if name in BUILD_CLASS:
        hf = getattr(transformers, BUILD_CLASS[name])(cfg)  # (float32: torch's default)
    else:
        hf = auto_class(name).from_config(cfg, dtype=torch.float32)
    _save_randomised(hf, folder)


def prefill_and_steps(lm, hf, ids: list[int], steps: int):
    """The runner's and transformers' logits over `ids` in one prefill pass each, then over
    `steps` decode steps (each side one token a step over its own cache, both fed
    transformers' argmax; GPT-1, which has no cache in transformers, its whole sequence
    again): (the runner's prefill logits, transformers', how many steps' logits are equal
    bit for bit, the first that is not or None). benchmarks/bf16_logits.py reports it."""
    import inspect

    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    n, seq, equal, first = len(ids), list(ids), 0, None
    with torch.inference_mode():
        cache = lm.runner.new_cache(n + steps)
        mine = lm.runner.step(ids, 0, cache, logits="all")[0]
        out = hf(torch.tensor([ids]), use_cache=True)
        ref = out.logits[0]
        for s in range(steps):
            t = int(out.logits[0, -1].argmax())
            seq.append(t)
            got = lm.runner.step([t], n + s, cache, logits="last")[0][-1]
            past = getattr(out, "past_key_values", None)
            out = (hf(torch.tensor([seq])) if past is None else
                   hf(torch.tensor([[t]]), use_cache=True, **{cache_kw: past}))
            if torch.equal(got, out.logits[0, -1].float()):
                equal += 1
            elif first is None:
                first = s
    return mine, ref, equal, first


def _save_randomised(hf, folder) -> None:
    """Save `hf` (its random weights, every norm weight and bias, xIELU's parameters and
    DeepSeek-V3's router bias randomised further) with a word-level tokenizer."""
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname or "residual_gate" in pname or pname.endswith((
                    ".bias", "_bias", ".sinks", ".alpha_p", ".alpha_n")):  # (xIELU's, Apertus's;
                # Ergo's residual gates, zeros as initialised)
                p.copy_(p + 0.3 * torch.randn_like(p))
        for bname, b in hf.named_buffers():  # DeepSeek-V3's router bias is a buffer
            if bname.endswith("e_score_correction_bias"):
                b.copy_(b + 0.3 * torch.randn_like(b))
    hf.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    from vericache.model.loader import load_model

    name = request.param
    folder = tmp_path_factory.mktemp(name.replace("_", "-"))
    build(name, folder)
    lm = load_model(str(folder), dtype="float32")
    hf = auto_class(name).from_pretrained(str(folder), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (PROMPT,), generator=g).tolist()
    REPORT.setdefault(name, {})
    return name, lm, hf, prompt


def test_family_config(arch):
    from vericache.model.families import Chunk

    name, lm, hf, _ = arch
    assert hf.config.model_type == {"llama-rope-llama3": "llama", "mistral-sliding": "mistral",
                                    "qwen2-sliding": "qwen2", "phi3-longrope": "phi3",
                                    "smollm3-sliding": "smollm3",
                                    "mixtral-sliding": "mixtral",
                                    "gpt_bigcode-mha": "gpt_bigcode",
                                    "gpt_neox-sequential": "gpt_neox",
                                    "stablelm-parallel": "stablelm", "stablelm-qk": "stablelm",
                                    "deepseek_v3-q": "deepseek_v3",
                                    "deepseek_v2-greedy": "deepseek_v2",
                                    "falcon-mq": "falcon", "falcon-seq": "falcon",
                                    "falcon-rw": "falcon",
                                    "cohere2_moe-rms": "cohere2_moe",
                                    "mistral3-mistral4": "mistral3",
                                    "llama4": "llama4_text",  # (its causal LM's config)
                                    "bloom-6": "bloom", "mpt-6": "mpt",
                                    "llama-biases": "llama",
                                    "laguna-element": "laguna",
                                    "granitemoehybrid-moe": "granitemoehybrid",
                                    "cohere_compass_text-rope":
                                        "cohere_compass_text"}.get(name, name)
    r = lm.runner
    windows = [lyr.window for lyr in r.layers]
    if name in WINDOWED:
        assert WINDOW in windows and r.windowed
    elif name in CHUNKED:
        assert windows == [Chunk(L4_CHUNK), None, Chunk(L4_CHUNK)] and r.windowed
    else:
        assert windows == [None] * r.num_layers and not r.windowed
    if name.startswith("gemma3"):
        assert windows == [WINDOW, None, WINDOW, WINDOW]
        assert len(r.ropes) == 2 and not torch.equal(r.ropes[0][0], r.ropes[1][0])
    if name == "phi3":
        assert r.ropes[0][0].shape[-1] == r.head_dim // 2  # partial rotary
    if name == "phi3-longrope":
        assert hf.config.rope_parameters["rope_type"] == "longrope"
        assert r.max_positions == lm.max_context == 128 < hf.config.max_position_embeddings
    if name == "ministral":
        assert windows == [WINDOW, None, WINDOW]
    if name in ("olmo2", "olmo3"):  # post-norms only, q/k norms over whole projections
        assert all(lyr.ln_attn_in is None and lyr.ln_mlp_in is None and lyr.qk_norm is None
                   for lyr in r.layers)
        assert r.layers[0].qk_norm_wide.shape == ((4 + 2) * 32,) and r._fused_w is None
        if name == "olmo3":
            assert windows == [WINDOW, WINDOW, None] and len(r.ropes) == 2
            assert [lyr.rope for lyr in r.layers] == [1, 1, 0]
    if name == "gemma2":  # soft-capped scores: the explicit attention path, one RoPE table
        assert windows == [WINDOW, None, WINDOW, None] and len(r.ropes) == 1
        assert r.attn_softcap == 2.0 and r.attend_kernel is None
    if name == "granitemoe":  # the residual multiplier in each expert's down_proj
        down = hf.model.layers[0].block_sparse_moe.experts.down_proj[1]
        assert torch.equal(r.layers[0].moe.down[1], down * 0.22) and r.logit_divisor == 3.0
    if name == "granite":
        assert (r.scale, r.logit_divisor, float(r.embed_scale)) == (0.09, 3.0, 12.0)
        o = hf.model.layers[0].self_attn.o_proj.weight
        assert torch.equal(r.layers[0].w_o, o * 0.22) and not torch.equal(r.layers[0].w_o, o)
    if name.startswith("smollm3"):
        nope = [i for i, use in enumerate(hf.config.no_rope_layers) if not use]
        assert nope == ([1] if name == "smollm3" else [0, 2])
        assert [lyr.rope for lyr in r.layers] == [int(i in nope) for i in range(r.num_layers)]
        cos, sin = r.ropes[1]
        assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
        if name == "smollm3-sliding":
            assert windows == [WINDOW, None, WINDOW]
    if name in ("deepseek_v32", "glm_moe_dsa"):  # up to the indexer's top k: every key kept
        assert lm.max_context == r.max_positions == 300 < hf.config.max_position_embeddings
    if name == "diffllama":  # a head in the cache: its key padded to 2D, its pair's two values
        assert (r.num_heads, r.num_kv_heads, r.head_dim, r.scale) == (8, 4, 64, 32 ** -0.5)
        a, w = hf.model.layers[1].self_attn, r.layers[1].w_qkv.view(-1, 64, 128)  # [heads, 2D, H]
        assert torch.equal(w[1, :32], a.q_proj.weight[32:64]) and not w[:12, 32:].any()
        assert torch.equal(w[8 + 3, :32], a.k_proj.weight[96:128])
        v = a.v_proj.weight.view(4, 32, 128)  # K/V head 3's values: heads 1 and 3
        assert torch.equal(w[12 + 3], torch.cat([v[1], v[3]]))
        assert all(lyr.diff is not None for lyr in r.layers) and r._fused_w is None
        assert r.layers[2].diff[1] == pytest.approx(0.8 - 0.6 * math.exp(-0.6))
    if name == "modernbert-decoder":  # torch's LayerNorms; a prediction head before the LM head
        assert r.layer_norm and r.torch_layer_norm == "dtype" and r.embed_norm_b is not None
        assert r.layers[0].ln_attn_in is None and r.layers[1].ln_attn_in is not None
        assert torch.equal(r.head_dense, hf.lm_head.dense.weight) and r.head_norm is not None
        assert torch.equal(r.lm_head, hf.decoder.weight) and r.lm_head_b is not None
    if name == "jetmoe":  # the attention's experts: 2 a row of 4, each its queries for 2 K/V heads
        assert (r.num_heads, r.num_kv_heads, r.head_dim) == (4, 2, 32)
        src = hf.model.layers[1].self_attention
        a = r.layers[1].moa
        assert all(lyr.w_o is None and lyr.moa is not None for lyr in r.layers)
        assert (len(a.gate_up), a.top_k) == (4, 2) and a.gate_up[3].shape == (64, 128)
        assert torch.equal(a.down[2], src.experts.output_linear.weight[2])
        assert torch.equal(a.out_b, src.experts.bias)
        assert torch.equal(r.layers[1].w_qkv, src.kv_proj.weight)
        assert (r.eps, r.final_eps) == (1e-6, 0.05)
    if name == "ergo":  # gates a dimension; q and k scaled on the global layer; normed experts
        src = hf.model.layers[1]
        s = src.attention_residual_gate.weight.sigmoid()
        mix = r.layers[1].residual_mix
        assert torch.equal(mix[0], s) and not torch.equal(mix[0], mix[2])
        assert torch.allclose(mix[1], torch.sqrt(1 + s) * torch.exp(-0.5 * F.softplus(
            src.attention_residual_gate.weight)))
        assert [lyr.rope for lyr in r.layers] == [0, 1, 0] and not r.gated
        # (RoPE over interleaved pairs: a head's rows, and its norm's weights, evens then odds)
        order = torch.cat([torch.arange(0, 32, 2), torch.arange(1, 32, 2)])
        assert torch.equal(r.layers[1].qk_norm[0], src.self_attn.q_norm.weight[order])
        assert torch.equal(r.layers[1].qk_scale, src.self_attn.qk_scale)
        assert r.layers[0].qk_scale is None
        e = r.layers[1].moe
        assert torch.equal(e.out_norm, src.mlp.experts.post_expert_norm.weight) and e.sum_slots
        assert torch.equal(e.shared_norm, src.mlp.shared_experts.norm.weight)
        assert torch.equal(e.gate_up[3], src.mlp.experts.up_proj[3].t())
    if name in MOE:  # a mixture of experts for every MLP but Qwen3-MoE's layer 1, GLM-4.5's
        moe = [lyr.moe is not None for lyr in r.layers]  # and EXAONE-MoE's layer 0
        assert moe == ([False, True, True] if name.startswith(("glm4_moe", "glm_moe_dsa",
                                                               "exaone_moe", "deepseek",
                                                               "ernie4_5_moe", "minicpm5_moe", "afmoe",
                                                               "sarvam", "param2moe", "hy_v3",
                                                               "mellum", "flint", "cohere2_moe",
                                                               "axk1", "beam", "mimo_v2_flash",
                                                               "laguna", "ergo"))
                       else [True, False, True] if name == "qwen3_moe" else [True] * 3)
        e = r.layers[-1].moe
        assert (len(e.gate_up), e.top_k) == (
            8 if name in ("glm4_moe", "solar_open", "deepseek_v3", "deepseek_v32", "glm_moe_dsa",
                          "mistral3-mistral4", "minicpm5_moe",
                          "deepseek_v2", "sarvam_moe", "beam", "mimo_v2_flash", "laguna")
            else 4, 4 if name == "beam" else 2)
        # (float32 weights: Mixtral's, DeepSeek-V2's, and HunYuan's from its float32 router)
        assert e.weights_in_dtype == ((name not in SIGMOID or name.startswith("laguna"))
                                      and not name.startswith(("mixtral", "deepseek_v2",
                                                               "hunyuan", "flint")))
        assert e.norm_topk == (name not in ("qwen2_moe", "gpt_oss", "granitemoe", "granitemoeshared",
                                            "granitemoe_swa", "granitemoehybrid-moe", "deepseek_v2", "deepseek_v2-greedy",
                                            "dbrx", "aria_text", "aria", "jetmoe"))
        assert r._fused_w is None and e.softmax_after_topk == name.startswith((
            "gpt_oss", "granitemoe", "cohere2_moe", "aria", "jetmoe"))
        # the top k's softmax in float32 (Granite-MoE's, Cohere 2 MoE's, JetMoE's), or in their
        # dtype
        assert e.router_float32 == name.startswith(("granitemoe", "cohere2_moe", "jetmoe"))
        assert (e.out_b is not None) == (name == "jetmoe")
        if name.startswith("aria"):  # experts stored [E, H, 2I]: the runner's [2I, H]
            src = (hf.model.language_model if name == "aria" else hf.model).layers[-1].mlp.experts
            assert torch.equal(e.gate_up[1], src.gate_up_proj[1].t()) and e.gate_up[1].shape == (512, 128)
        assert (e.shared_down is not None) == (name not in ("mixtral", "mixtral-sliding", "qwen3_moe",
                                                            "olmoe", "gpt_oss", "granitemoe",
                                                            "minimax_m2", "flex_olmo", "phimoe",
                                                            "dbrx", "mellum", "beam", "jetmoe",
                                                            "mimo_v2_flash"))
        assert (e.shared_gate is not None) == (name == "qwen2_moe")
        assert e.scores == ("sigmoid" if name in SIGMOID or name == "flint" else "softmax"
                            if name.startswith(("mistral3-mistral4", "ernie4_5_moe", "deepseek_v2"))
                            else "sparsemixer" if name == "phimoe" else None)
        if name.startswith("deepseek_v2"):  # a group scored by its best; scaled, not normalised
            assert (e.groups, e.group_top, e.scale) == (
                ((2, 1), 1, 2.0) if name == "deepseek_v2" else (None, 1, 1.0))
        if name == "dbrx":  # weights divided by their 2-norm; q/k/v clamped; LayerNorms
            assert e.norm_p == 2.0 and r.layer_norm and r.layers[0].clip_qkv == 0.5
        if name == "phimoe":  # LayerNorms with biases, the LM head's bias
            assert e.jitter == 0.3 and r.layer_norm and r.gated and r.lm_head_b is not None
        if name == "hunyuan_v1_moe":  # the router float32, as transformers builds it
            assert e.router.dtype == torch.float32 and e.shared_down is not None
        if name == "ernie4_5_moe":  # softmax scores, a bias in the choice, a clamped sum
            assert e.norm_min == 1e-12 and e.score_bias.shape == (4,) and e.weights_in_dtype
            assert e.shared_gate_up_b is not None and r.lm_head_b is not None
        if name == "mistral3-mistral4":  # softmax scores, 2 groups, no bias
            assert (e.groups, e.scale, e.norm_eps, e.score_bias) == ((2, 1), 1.0, 1e-20, None)
        if name in SIGMOID:  # the correction bias as loaded (randomised by `build`)
            groups, scale = SIGMOID[name]
            assert (e.groups, e.scale, e.norm_eps) == (groups, scale, 0.0 if name in (
                "minimax_m2", "kolibri1", "laguna", "laguna-element") else 1e-20)
            assert e.score_bias.shape == (len(e.gate_up),) and float(e.score_bias.abs().min()) > 0
        assert all(lyr.out_gate == (name in ("minicpm5_moe", "afmoe", "beam", "laguna",
                                             "laguna-element")) for lyr in r.layers)
        if name == "beam":  # RoPE on the sliding layers, q scaled on the other; depth-scaled sums
            assert windows == [WINDOW, None, WINDOW] and [lyr.q_scaled for lyr in r.layers] == [
                False, True, False] and r.q_scale.dtype == torch.float32
            assert r.layers[1].residual_mix == (0.5, 0.75 ** 0.5, 5 ** -0.5, 0.8 ** 0.5)
            gate = hf.model.layers[0].self_attn.gate_bias  # each head's, on its rows of g
            assert torch.equal(r.layers[0].out_gate_b.view(4, 32), gate[:, None].expand(4, 32))
            assert r.norm_upcast and r.final_softcap == 30.0 and r.softcap_float32 and r.glu_float32
            assert r.layers[1].moe.scale_after and r.layers[1].moe.choice_sorted
            from transformers.models.beam.modeling_beam import compute_attention_scaling
            p = torch.arange(r.q_scale.shape[0])[None]  # q's factor, as transformers computes it
            assert torch.equal(r.q_scale, compute_attention_scaling(p).flatten())
        if name == "afmoe":  # norms around both branches; RoPE on the sliding layers only
            assert windows == [WINDOW, WINDOW, None] and [lyr.rope for lyr in r.layers] == [0, 0, 1]
            assert r.layers[0].ln_mlp_out is not None and abs(float(r.embed_scale) - 128 ** 0.5) < 1e-5
        if name == "minimax_m2":
            assert r.layers[0].qk_norm_wide.shape == ((4 + 2) * 32,) and r.ropes[0][0].shape[-1] == 16
        if name == "glm4_moe":  # per-head q/k norms, RoPE on each head's first half
            assert r.layers[0].qk_norm is not None and r.ropes[0][0].shape[-1] == r.head_dim // 2
        if name == "dots1":
            assert windows == [None, WINDOW, WINDOW]
        if name == "exaone_moe":  # RoPE on the sliding layers only
            assert windows == [WINDOW, WINDOW, None] and [lyr.rope for lyr in r.layers] == [0, 0, 1]
        if name in ("olmoe", "flex_olmo"):
            assert r.layers[0].qk_norm_wide.shape == ((4 + 2) * 32,)
            assert (r.layers[0].ln_attn_in is None) == (name == "flex_olmo")  # post-norms
        assert e.bias_on_logits == (name == "kolibri1")
        if name == "axk1":  # a norm on the experts' output, none on the dense layer's
            assert [lyr.ln_mlp_out is not None for lyr in r.layers] == [False, True, True]
        if name == "kolibri1":  # GLM-4's norms after each branch; RoPE on the sliding layers
            assert windows == [WINDOW, None, WINDOW] and [lyr.rope for lyr in r.layers] == [0, 1, 0]
            assert all(lyr.ln_attn_out is not None and lyr.ln_mlp_out is not None
                       and lyr.qk_norm is not None for lyr in r.layers)
        if name == "flint":  # sinks; RoPE on the sliding layers; sigmoid scores, no bias
            assert windows == [None, WINDOW, WINDOW] and [lyr.rope for lyr in r.layers] == [1, 0, 0]
            assert all(lyr.sinks.shape == (4,) for lyr in r.layers) and r.attend_kernel is None
            assert (e.score_bias, e.groups, e.norm_eps) == (None, None, 0.0) and e.norm_topk
        if name.startswith("cohere2_moe"):  # the prefix layer dense, full, with RoPE
            average = name == "cohere2_moe"
            assert windows == [None, WINDOW, None if average else WINDOW]
            assert [lyr.rope for lyr in r.layers] == [0, 0, int(average)]
            shared = hf.model.layers[1].mlp.shared_experts.down_proj.weight
            assert e.scale == r.layers[1].moe.scale == (0.5 if average else 1.0)
            assert torch.equal(r.layers[1].moe.shared_down, shared * e.scale)
        if name == "gpt_oss":  # sinks: the explicit attention path, not the native kernel
            assert e.softmax_after_topk and e.swiglu == (1.702, 2.0) and len(e.down_b) == 4
            assert r.layers[0].sinks.shape == (4,) and r.attend_kernel is None
            assert windows == [WINDOW, None, WINDOW] and r.ropes[0][0].shape[-1] == r.head_dim
    if name.startswith("granitemoehybrid"):  # Granite's multipliers; NoPE without "rope"
        assert (r.scale, r.logit_divisor, float(r.embed_scale)) == (0.09, 3.0, 12.0)
        cos, sin = r.ropes[0]
        assert torch.equal(cos, torch.ones_like(cos)) == (name == "granitemoehybrid-moe")
        assert [lyr.moe is not None for lyr in r.layers] == [name == "granitemoehybrid-moe"] * 3
        src = hf.model.layers[0].shared_mlp
        mlp = r.layers[0].w_gate_up if r.layers[0].moe is None else r.layers[0].moe.shared_gate_up
        assert torch.equal(mlp, src.input_linear.weight)
    if name == "phi4_multimodal":  # Phi-3's block: partial rotary, the fused native pass
        assert r.ropes[0][0].shape[-1] == r.head_dim // 2 and r._fused_w is not None
    if name == "mllama":  # its self-attention layers only: the cache holds two of three
        assert r.num_layers == 2 and lm.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
        lang = hf.model.language_model
        assert torch.equal(r.layers[1].w_o, lang.layers[2].self_attn.o_proj.weight)
    if name == "bitnet":  # a norm on the attention's output and one on the MLP's product's input
        assert all(lyr.ln_attn_sub.shape == (128,) and lyr.ln_mlp_sub.shape == (256,)
                   for lyr in r.layers) and r._fused_w is None
        assert torch.equal(r.layers[1].ln_mlp_sub, hf.model.layers[1].mlp.ffn_sub_norm.weight)
    if name == "longcat_flash":  # its two layers as four: the mixture on the first of each pair
        assert r.num_layers == 4 and all(lyr.mla is not None and lyr.moe is None for lyr in r.layers)
        assert [lyr.shortcut is not None for lyr in r.layers] == [True, False, True, False]
        assert [lyr.add_shortcut for lyr in r.layers] == [False, True, False, True]
        e, a = r.layers[2].shortcut, hf.model.layers[1].self_attn[0]
        assert (len(e.gate_up), e.zero_experts, e.router.shape[0], e.scores, e.scale) == (
            4, 2, 6, "softmax", 2.0)
        assert (r.layers[2].mla.q_scale, r.layers[2].mla.kv_scale) == (
            a.mla_scale_q_lora, a.mla_scale_kv_lora) == ((128 / 48) ** 0.5, 2.0)
    if name.startswith("laguna"):  # the most query heads of any layer; the others padded
        heads = hf.config.num_attention_heads_per_layer
        assert r.num_heads == 4 and [lyr.q_heads is None for lyr in r.layers] == [
            n == 4 for n in heads]
        fewer = next(lyr for lyr, n in zip(r.layers, heads) if n == 2)
        assert fewer.q_heads.tolist() == [0, 2]  # one a KV head's group of two
        q = fewer.w_qkv[: 4 * 32].view(4, 32, -1)
        assert not q[[1, 3]].any() and q[[0, 2]].all(-1).any()
        assert all(lyr.out_gate and lyr.gate_softplus for lyr in r.layers)
        assert [lyr.gate_heads for lyr in r.layers] == [name == "laguna"] * 3
        e = r.layers[-1].moe
        assert (e.scale_after, e.weights_in_dtype, e.choice_sorted, e.norm_eps) == (True, True, True, 0.0)
        assert e.logit_softcap == (3.0 if name == "laguna" else None)
        if name == "laguna":
            assert windows == [None, WINDOW, WINDOW] and [lyr.rope for lyr in r.layers] == [0, 1, 1]
            assert (r.ropes[0][0].shape[-1], r.ropes[1][0].shape[-1]) == (16, 32)  # partial, full
    if name == "mimo_v2_flash":  # the full layer's K/V heads doubled: the sliding layers' 4
        d, vd, hq, hkv = 96, 64, 4, 4
        assert (r.num_kv_heads, r.head_dim, r.attend_kernel) == (hkv, d, None)
        assert windows == [None, WINDOW, WINDOW] and len(r.ropes) == 2
        assert [lyr.rope for lyr in r.layers] == [0, 1, 1] and r.ropes[0][0].shape[-1] == 32
        assert [lyr.sinks is None for lyr in r.layers] == [True, False, False]
        assert all((lyr.v_dim, lyr.v_scale) == (vd, 0.707) for lyr in r.layers)
        for li, lyr in enumerate(r.layers):
            a = hf.model.layers[li].self_attn
            k = lyr.w_qkv[hq * d: (hq + hkv) * d].view(hkv, d, -1)
            v = lyr.w_qkv[(hq + hkv) * d:].view(hkv, d, -1)
            assert torch.equal(k[0], a.k_proj.weight[:d]) and torch.equal(v[0, :vd], a.v_proj.weight[:vd])
            assert not v[:, vd:].any()  # the value's padding
            # layer 0's two K/V heads each twice, in place (head j in j // 2); the sliding
            # layers' four their own
            same = [torch.equal(k[j], k[j + 1]) and torch.equal(v[j], v[j + 1]) for j in range(3)]
            assert same == ([True, False, True] if li == 0 else [False] * 3)
    if name in ("llama-biases", "starcoder2", "seed_oss", "ernie4_5"):  # biases past q/k/v
        assert all(lyr.b_o is not None and lyr.b_gate_up is not None and lyr.b_down is not None
                   for lyr in r.layers) and r._fused_w is None
        assert r.gated == (name != "starcoder2") and r.layer_norm == (name == "starcoder2")
    if name in ("arcee", "helium"):  # without biases: the fused native pass serves them
        assert r.gated == (name == "helium") and r.layer_norm is False
        assert (r._fused_w is None) == (name == "arcee")
    if name == "exaone4":  # post-norms, per-head q/k norms; RoPE on the sliding layers only
        assert all(lyr.ln_attn_in is None and lyr.qk_norm is not None for lyr in r.layers)
        assert windows == [WINDOW, WINDOW, None] and [lyr.rope for lyr in r.layers] == [0, 0, 1]
    if name == "phi":
        assert r.lm_head_b is not None and r.layers[0].parallel and not r.gated
        assert r.ropes[0][0].shape[-1] == r.head_dim // 2  # partial rotary
    if name in ("glm", "glm4"):  # interleaved pairs of the first half, in halves
        assert r.ropes[0][0].shape[-1] == r.head_dim // 2
        assert (r.layers[0].ln_mlp_out is not None) == (name == "glm4")
    if name.startswith("cohere"):  # one LayerNorm before both branches; no fused pass
        assert all(lyr.parallel and lyr.ln_mlp_in is None for lyr in r.layers)
        assert r.layer_norm == (name != "cohere2_moe-rms")  # (its RMSNorms)
        assert r.logit_scale == (None if name == "cohere_compass_text-rope" else 0.5)
        assert r._fused_w is None
        if name == "cohere2":  # RoPE on the sliding layers only
            assert windows == [WINDOW, None, WINDOW] and [lyr.rope for lyr in r.layers] == [0, 1, 0]
    if name.startswith("cohere_compass_text"):  # Cohere 2's block; RoPE over halves, a table a type
        assert all(lyr.parallel and lyr.ln_mlp_in is None and not lyr.rope_pairs
                   for lyr in r.layers)
        assert r.layer_norm and windows == [WINDOW, None, WINDOW]
        ropes = [lyr.rope for lyr in r.layers]
        assert ropes[0] == ropes[2] != ropes[1] and len(r.ropes) == 2
        cos = r.ropes[ropes[1]][0]
        nope = torch.equal(cos, torch.ones_like(cos))  # (the identity table)
        assert nope == (name == "cohere_compass_text")
        assert r.logit_scale == (0.5 if name == "cohere_compass_text" else None)
    if name in QWEN_VL:  # the multimodal RoPE of text positions: one RoPE's table, bit for bit
        d, theta = r.head_dim, hf.config.get_text_config().rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        f = torch.arange(r.max_positions).float()[:, None] * inv
        assert len(r.ropes) == 1 and torch.equal(r.ropes[0][0], torch.cat([f, f], -1).cos())
        assert torch.equal(r.ropes[0][1], torch.cat([f, f], -1).sin())
    if name in ABSOLUTE:  # learned positions; the identity RoPE table
        cos, sin = r.ropes[0]
        assert r.pos_embed.shape == (512, 128) and r.layer_norm and not r.gated
        assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
        assert r.num_kv_heads == (1 if name == "gpt_bigcode" else 4)
        if name == "gpt_neo":  # its local layer; scores not scaled (float32 in any dtype)
            assert windows == [None, WINDOW, None] and r.scale == 1.0 and not r.attn_float32
        assert (r.embed_scale is None) == (name not in ("biogpt", "xglm", "ctrl"))
        assert all(lyr.post_norms for lyr in r.layers) == (name == "openai-gpt")
        assert (r.norm is None) == (name == "openai-gpt")
        if name == "ctrl":  # its table from position 0; the LM head's bias
            assert torch.equal(r.pos_embed, hf.transformer.pos_encoding[:512])
            assert r.lm_head_b is not None and float(r.embed_scale) == pytest.approx(128 ** 0.5)
        if name in ("biogpt", "xglm"):  # the embedding scaled; the table from the offset on
            table = hf.biogpt.embed_positions.weight if name == "biogpt" else \
                hf.model.embed_positions.weights
            assert float(r.embed_scale) == pytest.approx(128 ** 0.5)
            assert torch.equal(r.pos_embed, table[2: 2 + 512])
        if name == "opt":  # the table's rows from the offset on
            assert torch.equal(r.pos_embed, hf.model.decoder.embed_positions.weight[2:])
    if name.startswith("gpt_neox"):  # RoPE on a quarter of each head (Japanese's: half)
        quarter = 2 if name == "gpt_neox_japanese" else 4
        assert r.ropes[0][0].shape[-1] == r.head_dim // quarter and r.pos_embed is None
        assert all(lyr.parallel == (name == "gpt_neox") and lyr.ln_mlp_in is not None
                   for lyr in r.layers)
    if name == "gpt_neox_japanese":  # one bias, the last layer's output's; no others
        assert [lyr.b_o is None for lyr in r.layers] == [True, True, False]
        assert torch.equal(r.layers[2].b_o, hf.gpt_neox_japanese.layers[2].attention.dense_bias)
        assert all(lyr.b_qkv is None and lyr.b_down is None for lyr in r.layers)
        assert lm.runner.lm_head is not lm.runner.embed  # its own head, `embed_out`
    # q/k LayerNorms: StableLM's a head, Persimmon's one for every head, with a bias
    assert all(lyr.qk_layer_norm == (name in ("stablelm-qk", "persimmon", "fuyu")) for lyr in r.layers)
    if name == "stablelm-qk":
        src = hf.model.layers[0].self_attn
        assert torch.equal(r.layers[0].qk_norm[5], src.k_layernorm.norms[1].weight)
        assert r.layers[0].qk_norm.shape == (4 + 2, 32) and r.layers[0].qk_norm_b is None
    if name == "persimmon":
        assert r.layers[0].qk_norm_b.shape == (4 + 4, 32) and r.num_kv_heads == 4
        assert r.ropes[0][0].shape[-1] == 16 and not r.gated and r.layer_norm
    if name in ("stablelm", "stablelm-parallel", "stablelm-qk", "jais2", "nemotron"):
        assert r.layer_norm and r.norm_b is not None and r._fused_w is None
        assert r.gated == name.startswith("stablelm") and all(
            lyr.parallel == (name == "stablelm-parallel") for lyr in r.layers)
        assert r.ropes[0][0].shape[-1] == r.head_dim // {"jais2": 1, "nemotron": 2}.get(name, 4)
        if name == "nemotron":  # LayerNorm1P: 1 + w
            src = hf.model.layers[0].input_layernorm.weight
            assert torch.equal(r.layers[0].ln_attn_in, src + 1.0)
    if name == "vaultgemma":
        assert all(lyr.ln_attn_out is None and lyr.ln_mlp_out is None for lyr in r.layers)
        assert r.attn_softcap == 2.0 and windows == [WINDOW, None, WINDOW, None]
    if name in MLA_ARCHS:  # latent attention: every head its own key, pe first
        m = r.layers[0].mla
        v = {"deepseek_v3": 24, "deepseek_v32": 24, "glm_moe_dsa": 24,
             "glm4_moe_lite": 64}.get(name, 32)
        assert (r.num_kv_heads, r.head_dim, m.v, m.rank, m.pe) == (4, 64, v, 32, 16)
        assert (m.q_b is None) == (name in ("deepseek_v3-q", "deepseek_v2-greedy", "sarvam_mla"))
        assert r.ropes[0][0].shape[-1] == 16
        model = hf.model.language_model if name == "mistral3-mistral4" else hf.model
        a = model.layers[0].self_attn
        a = a[0] if name == "longcat_flash" else a  # (its layer's first of two)
        assert r.scale == a.scaling and r._fused_w is None
        # YaRN's mscale in the scale
        if name in ("deepseek_v3", "deepseek_v32", "mistral3-mistral4"):
            assert r.scale != 64 ** -0.5
        assert (r.q_scale is not None) == (name == "mistral3-mistral4")
        if name == "minicpm3":  # embedding, branch and logit scales
            assert (float(r.embed_scale), r.logit_divisor) == (12.0, 4.0)
    if name in ALIBI:  # ALiBi: the explicit attention path, caches that record positions
        slopes = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8] + ([2 ** -1, 2 ** -3] if "-6" in name else [])
        if name == "falcon-rw":  # 2^(-k/2), rounded to bfloat16
            slopes = [float(torch.tensor(2 ** (-k / 2)).bfloat16()) for k in range(1, 17)]
        assert r.alibi.tolist() == slopes and r.alibi.dtype == torch.float32
        assert r.alibi_kind == ("falcon" if name == "falcon-rw" else
                                "bloom" if name.startswith("bloom") else "relative")
        assert r.attend_kernel is not None and r.positioned and not r.windowed
        cos, sin = r.ropes[0]
        assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
        if name.startswith("mpt"):  # no biases; q, k and v clamped
            assert all(lyr.b_qkv is None and lyr.ln_attn_in_b is None for lyr in r.layers)
            assert [lyr.clip_qkv for lyr in r.layers] == [0.6 if name == "mpt" else None] * 3
        elif name.startswith("bloom"):  # a LayerNorm with its bias on the embedding; per-head q/k/v
            assert torch.equal(r.embed_norm_b, hf.transformer.word_embeddings_layernorm.bias)
            qkv = hf.transformer.h[0].self_attention.query_key_value.weight
            d = r.head_dim
            assert torch.equal(r.layers[0].w_qkv[d: 2 * d], qkv[3 * d: 4 * d])  # head 1's q
    else:
        assert r.alibi is None and r.positioned == r.windowed
    if name in CHUNKED:
        # RoPE (over interleaved pairs: q's rows in halves) and q/k norms of ones on the
        # chunked layers; the layer without RoPE reads the identity table, its q scaled by
        # 1 + 0.1 log(1 + floor((p + 1) / 32)), in float32
        assert [lyr.rope for lyr in r.layers] == [0, 1, 0]
        q = hf.model.layers[0].self_attn.q_proj.weight[:32]
        head0 = r.layers[0].w_qkv[:32]
        assert torch.equal(head0[:16], q[0::2]) and torch.equal(head0[16:], q[1::2])
        assert torch.equal(r.layers[1].w_qkv, torch.cat([
            getattr(hf.model.layers[1].self_attn, f"{n}_proj").weight for n in "qkv"]))
        assert [lyr.qk_norm is not None and lyr.qk_norm_after_rope
                for lyr in r.layers] == [True, False, True]
        assert torch.equal(r.layers[0].qk_norm, torch.ones(4 + 2, 32))
        assert [lyr.q_scaled for lyr in r.layers] == [False, True, False]
        assert r.q_scale.dtype == torch.float32 and r.q_scale_from == 31
        assert float(r.q_scale[30]) == 1.0 and float(r.q_scale[31]) > 1.0
        assert abs(float(r.q_scale[94]) - (1 + 0.1 * math.log(3.0))) < 1e-6
        moe = [lyr.moe for lyr in r.layers]
        e = moe[1]
        assert [m is not None for m in moe] == ([False, True, False] if name == "llama4_text"
                                                 else [True] * 3)
        assert (e.scores, e.scale_input, e.top_k) == (
            "top_k_sigmoid", True, 1 if name == "llama4_text" else 2)
        src = hf.model.layers[1].feed_forward.experts
        assert torch.equal(e.gate_up[2], src.gate_up_proj[2].t())
        assert e.gate_up[2].shape == (128, 128)
        assert torch.equal(e.down[2], src.down_proj[2].t()) and e.shared_down is not None
        if name == "llama4_text":  # the dense layers' MLP: intermediate_size_mlp wide
            assert r.layers[0].w_gate_up.shape == (512, 128) and r._fused_w is None
    if name == "ministral3":  # 1 up to position 32, then 1 + 0.1 log(1 + floor(p / 32))
        assert r.q_scale_from == 32 and float(r.q_scale[31]) == 1.0
        assert abs(float(r.q_scale[64]) - (1 + 0.1 * torch.log(torch.tensor(3.0)))) < 1e-6
    if name == "llama-rope-llama3":
        assert hf.config.rope_parameters["rope_type"] == "llama3"
    # q/k norms after RoPE: not the fused pass (its kernel norms before RoPE)
    assert all(lyr.qk_norm_after_rope == name.startswith(("hunyuan", "nanochat"))
               for lyr in r.layers) or name in CHUNKED
    if name.startswith(("hunyuan", "nanochat")):
        assert r._fused_w is None and r.layers[0].qk_norm.shape == (4 + 2, 32)
    if name == "hunyuan_v1_dense":  # "dynamic" with alpha: NTK-alpha's static base
        d, base = r.head_dim, 10000.0 * 1000.0 ** (32 / 30)
        assert float(r.ropes[0][0][5, 1]) == pytest.approx(math.cos(5 * base ** (-2 / d)), rel=1e-5)
    if name == "olmo":  # LayerNorms without weights; q, k and v clamped
        assert r.layer_norm and r.eps == 1e-5 and torch.equal(r.norm, torch.ones(128))
        assert all(lyr.clip_qkv == 0.5 for lyr in r.layers) and r._fused_w is None
    if name.startswith("apertus"):  # each layer's xIELU, its learned parameters; not gated
        acts = [lyr.act for lyr in r.layers]
        assert not r.gated and r.layers[0].qk_norm is not None and r._fused_w is None
        assert len({id(a) for a in acts}) == 3 and not torch.equal(acts[0].alpha_p, acts[1].alpha_p)
        assert r.vocab_size == (VOCAB if name == "apertus" else 250)  # (1.5's head pruned)
    if name in ("gptj", "codegen"):  # one LayerNorm before both branches; RoPE on part of a head
        assert all(lyr.parallel and lyr.ln_mlp_in is None for lyr in r.layers)
        assert r.layer_norm and not r.gated and r.lm_head_b is not None
        assert r.ropes[0][0].shape[-1] == 8 and r.num_kv_heads == r.num_heads == (4 if name == "gptj" else 8)
    if name.startswith("falcon"):  # new: a norm each parallel branch; 7B's: one; else sequential
        assert r.layer_norm and not r.gated and r.num_kv_heads == {
            "falcon": 2, "falcon-mq": 1, "falcon-rw": 16}.get(name, 4)
        sequential = name in ("falcon-seq", "falcon-rw")
        assert all(lyr.parallel == (not sequential) and (lyr.ln_mlp_in is None) == (
            name == "falcon-mq") for lyr in r.layers)
        assert (r.layers[0].b_qkv is not None) == sequential
    if name == "mellum":  # the sliding layers' table: their own theta
        assert windows == [WINDOW, None, WINDOW] and [lyr.rope for lyr in r.layers] == [1, 0, 1]
        assert not torch.equal(r.ropes[0][0], r.ropes[1][0]) and r._fused_w is None
    if name == "cwm":
        assert windows == [WINDOW, None, WINDOW] and r._fused_w is not None
    if name in ("granite_swa", "granitemoe_swa"):  # every fourth layer global; sinks everywhere
        assert windows == [None, WINDOW, WINDOW] and r.attend_kernel is None
        assert all(lyr.sinks.shape == (4,) for lyr in r.layers) and r.scale == 0.1
    if name == "hyperclovax":  # the residual multiplier in the branch-output norms' weights
        src = hf.model.layers[0].post_norm1.weight
        assert torch.equal(r.layers[0].ln_attn_out, src * 0.5) and r.logit_scale == 0.5
        assert float(r.embed_scale) == 2.0 and r.logit_divisor is None
    if name == "nanochat":  # norms without weights; RoPE's rotation flipped: the sine negated
        assert torch.equal(r.embed_norm, torch.ones(128)) and torch.equal(r.norm, torch.ones(128))
        assert float(r.ropes[0][1][5, 0]) == pytest.approx(-math.sin(5.0))
        assert r.final_softcap == 3.0 and not r.gated


def test_logits_match_transformers(arch):
    """Prefill, then one-token steps, then a 4-token step (as verification runs), continuing
    one cache, against transformers' forward over the whole sequence."""
    name, lm, hf, prompt = arch
    g = torch.Generator().manual_seed(2)
    cont = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    ids = prompt + cont
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # [n, V]
    r = lm.runner
    cache = r.new_cache(8)  # grows while it runs
    got = [r.step(prompt, 0, cache, logits="all")[0]]
    for i in range(8):
        got.append(r.step([cont[i]], PROMPT + i, cache, logits="all")[0])
    got.append(r.step(cont[8:], PROMPT + 8, cache, logits="all")[0])
    got = torch.cat(got)
    assert got.shape == ref.shape and cache.length == len(ids)
    scale = float(ref.abs().max())
    diff = float((got - ref).abs().max())
    REPORT[name]["logit_maxabs"] = diff
    REPORT[name]["logit_scale"] = scale
    print(f"\n{name}: logits max-abs diff {diff:.3g} (logit scale {scale:.3g})")
    assert diff <= 1e-4 * max(1.0, scale), (name, diff, scale)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def full(arch):
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate

    name, lm, _, prompt = arch
    res = generate(lm, prompt, GenParams(mode="full", max_tokens=N_NEW, ignore_eos=True))
    assert len(res.token_ids) == N_NEW
    return res.token_ids


def test_full_equals_transformers_generate(arch, full):
    name, lm, hf, prompt = arch
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                      max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, PROMPT:].tolist()
    REPORT[name]["full=generate"] = want == full
    assert full == want, name


def _specs() -> list[str]:
    from vericache.compress.registry import compressor_names

    return [SPEC_PARAMS.get(n, n) for n in compressor_names()]


@pytest.mark.parametrize("via_store", [False, True], ids=["local", "store"])
def test_vericache_equals_full(arch, full, via_store):
    """Every registered compressor, its drafter cache built locally or loaded through the
    prefix store (`load_draft`, which carries the slots' positions)."""
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate
    from vericache.engine.rounds import LocalBackends
    from vericache.store.memory import MemoryStore

    name, lm, _, prompt = arch
    for spec in _specs():
        store = MemoryStore() if via_store else None
        try:
            res = generate(lm, prompt, GenParams(mode="vericache", compressor=spec, chunk_size=CHUNK,
                                                 draft_len=4, max_tokens=N_VERICACHE,
                                                 ignore_eos=True),
                           LocalBackends(lm, store))
        finally:
            if store is not None:
                store.close()
        s = res.stats
        REPORT[name].setdefault("vericache=full", {})[f"{spec}/{'store' if via_store else 'local'}"] = (
            res.token_ids == full[:N_VERICACHE], round(s.acceptance_rate, 2))
        assert res.token_ids == full[:N_VERICACHE], (name, spec, via_store)
        assert s.rounds >= 1 and s.drafted >= 1, (name, spec)


def test_flints_attention_is_float32_in_a_bfloat16_model(tmp_path):
    """Flint's eager attention takes its scores, its sinks' logits and their softmax in float32
    whatever the model's dtype (its q/k-normed scores reach tens), then casts the weights back.
    The runner's explicit path does too (`attn_float32`): in bfloat16 its output is
    transformers' bit for bit, and the same path with bfloat16 scores is not."""
    from transformers.models.flint.modeling_flint import eager_attention_forward

    from vericache.model.loader import load_model

    build("flint", tmp_path)
    r = load_model(str(tmp_path), dtype="bfloat16").runner
    attn = auto_class("flint").from_pretrained(str(tmp_path), dtype=torch.bfloat16).model.layers[0].self_attn
    assert r.attn_float32 and attn.sinks.dtype == torch.float32
    g, (L, n, hkv, grp, d) = torch.Generator().manual_seed(3), (5, 20, 2, 2, 32)
    q, k = ((torch.randn(1, h, m, d, generator=g) * 3).bfloat16() for h, m in ((hkv * grp, L), (hkv, n)))
    v = torch.randn(1, hkv, n, d, generator=g).bfloat16()
    seen = torch.arange(n)[None, :] <= torch.arange(n - L, n)[:, None]  # [L, n], causal
    ref = eager_attention_forward(attn, q, k, v, torch.zeros(1, 1, L, n).masked_fill(~seen, -torch.inf),
                                  scaling=attn.scaling)[0].transpose(1, 2)  # [1, Hq, L, D]

    def ours() -> torch.Tensor:  # rows by query head, then row
        out = r._sdpa(q.reshape(1, hkv, grp * L, d), k, v, seen.repeat(grp, 1), r.layers[0].sinks)
        return out.reshape(1, hkv * grp, L, d)

    assert torch.equal(ours(), ref)
    r.attn_float32 = False
    assert not torch.equal(ours(), ref)


def test_an_embedding_scaled_by_a_number_rounds_once(tmp_path):
    """CTRL (and Granite, HyperCLOVAX, AFMoE, BioGPT, XGLM) multiplies its embedding by a
    Python float: in bfloat16 the product is taken in float32 and rounded once. The runner
    multiplies so (`Weights.embed_scale_number`); sqrt(128) as a bfloat16 tensor (Gemma's
    way) rounds the scale first and gives other bits. With the tensor, CTRL's bfloat16 `full` left
    `generate` at token 14 in the dry run; with the number it did not."""
    import numpy as np

    from vericache.model.loader import load_model

    build("ctrl", tmp_path)
    r = load_model(str(tmp_path), dtype="bfloat16").runner
    hf = auto_class("ctrl").from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    ids = torch.arange(3, VOCAB)
    with torch.no_grad():
        ref = hf.transformer.w(ids)
        ref *= np.sqrt(hf.config.n_embd)  # transformers' CTRL, as its forward does
    assert isinstance(r.embed_scale, float) and torch.equal(r.embed[ids] * r.embed_scale, ref)
    assert not torch.equal(r.embed[ids] * torch.tensor(r.embed_scale, dtype=torch.bfloat16), ref)


@pytest.mark.parametrize("name", ["olmo2", "nanochat", "kolibri1", "llama4_text"])
def test_a_bfloat16_model_with_float32_parts(name, tmp_path):
    """OLMo computes RoPE in float32 whatever the model's dtype (its table is float32), then
    casts back, and so does Llama 4 (its complex table), whose q it scales by float32 factors
    past position 30, the product rounded once; nanochat's norms have no weights, and the ones
    that stand in were float32. In bfloat16 the runner's pass ran into a float32 product; now
    its logits are transformers' within bfloat16's rounding, and vericache (bitwise) is full.
    Kolibri-1's router is a float32 product over a bfloat16 model's rows (`_ROUTER_FLOAT32`), as
    transformers' is."""
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate
    from vericache.engine.rounds import LocalBackends
    from vericache.model.loader import load_model

    build(name, tmp_path)
    lm = load_model(str(tmp_path), dtype="bfloat16")
    r = lm.runner
    assert (r.ropes[0][0].dtype == torch.float32) == (name in ("olmo2", "llama4_text"))
    assert r.dtype == torch.bfloat16 and (name != "llama4_text" or r.q_scale.dtype == torch.float32)
    routers = [lyr.moe.router.dtype for lyr in r.layers if lyr.moe is not None]
    assert routers == ([torch.float32] * 3 if name == "kolibri1" else
                       [torch.bfloat16] if name == "llama4_text" else [])
    hf = auto_class(name).from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    prompt = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    got = r.step(prompt, 0, r.new_cache(8))[0][-1]
    assert float((got - ref).abs().max()) <= 0.05 * float(ref.abs().max())
    full = generate(lm, prompt, GenParams(mode="full", max_tokens=16, ignore_eos=True))
    vc = generate(lm, prompt, GenParams(mode="vericache", compressor="snapkv:recent=16,window=8",
                                        chunk_size=CHUNK, draft_len=4, max_tokens=16,
                                        ignore_eos=True, exact="bitwise"), LocalBackends(lm))
    assert vc.token_ids == full.token_ids and len(full.token_ids) == 16


@pytest.mark.parametrize("name", sorted(WINDOWED | {"llama4_text", "bloom-6", "mpt", "falcon-rw"}))
def test_window_masks_by_recorded_position(name, tmp_path):
    """A cache that records positions holds the same tokens in shuffled slots: decode logits
    equal the dense cache's (the window, or Llama 4's chunk, masks by position, not slot;
    ALiBi's bias is by position too). With the keys older
    than every later query's window dropped, a model whose layers all slide (Mistral, Phi-3
    here) gives the same logits too."""
    from vericache.model.loader import load_model

    build(name, tmp_path)
    r = load_model(str(tmp_path), dtype="float32").runner
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (PROMPT + 6,), generator=g).tolist()
    dense = r.new_cache(PROMPT)
    r.step(ids[:PROMPT], 0, dense, logits="none")
    perm = torch.randperm(PROMPT, generator=g)
    k, v = dense.view()
    shuffled = type(dense).from_tensors(k[:, :, perm], v[:, :, perm], 8, pos=perm)
    all_slide = all(lyr.window for lyr in r.layers)
    if all_slide:  # keep only positions p > PROMPT - WINDOW: in every later query's window
        sel = (perm > PROMPT - WINDOW).nonzero()[:, 0]
        dropped = type(dense).from_tensors(k[:, :, perm[sel]], v[:, :, perm[sel]], 8, pos=perm[sel])
    for i in range(PROMPT, PROMPT + 6):
        want = r.step([ids[i]], i, dense)[0]
        tol = 1e-4 * float(want.abs().max())
        assert float((r.step([ids[i]], i, shuffled)[0] - want).abs().max()) <= tol, (name, i)
        if all_slide:
            assert float((r.step([ids[i]], i, dropped)[0] - want).abs().max()) <= tol, (name, i)


@pytest.mark.parametrize("via_store", [False, True], ids=["local", "store"])
@pytest.mark.parametrize("spec", ["snapkv:recent=16,window=8", "streamingllm:ratio=4"])
@pytest.mark.parametrize("name", ["mistral-sliding", "bloom"])
def test_drafter_records_kept_positions(name, tmp_path, spec, via_store):
    """A windowed (or ALiBi) model's drafter cache records each slot's position: the key a
    token-dropping compressor kept in a slot is the full KV's key at the recorded position
    (after the selection policy moved the kept set, and after some rounds of drafting; bits=32,
    so the moved keys are the full KV's own values)."""
    from vericache.engine.generation import Generation, GenParams
    from vericache.engine.rounds import LocalBackends, run_round, start
    from vericache.model.loader import load_model
    from vericache.store.memory import MemoryStore

    build(name, tmp_path)
    lm = load_model(str(tmp_path), dtype="float32")
    prompt = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(4)).tolist()
    store = MemoryStore() if via_store else None
    b = LocalBackends(lm, store)
    g = Generation(lm, prompt, GenParams(mode="vericache", compressor=spec, chunk_size=CHUNK,
                                         draft_len=4, max_tokens=N_NEW, ignore_eos=True,
                                         selection="question:bits=32"))
    try:
        start(b, g)
        for _ in range(3):
            run_round(b, [g])
        dc, fc = b.drafter.sessions[g.rid].cache, b.verifier.cache(g.rid)
        n = dc.length
        pos = dc.pos[:, :, :n]
        assert pos.shape == (dc.num_layers, dc.k.shape[1], n) and int(pos.max()) < fc.length
        assert bool((pos[..., 1:] != pos[..., :1]).any())  # not one position everywhere
        assert n < fc.length  # tokens were dropped: slots are not positions
        want = torch.gather(fc.k[:, :, : fc.length], 2,
                            pos.unsqueeze(-1).expand(*pos.shape, dc.k.shape[-1]))
        # (the drafter holds its K/V in its own dtype: bfloat16 for a float32 model on CPU)
        assert torch.equal(dc.k[:, :, :n], want.to(dc.k.dtype)), spec
    finally:
        b.release(g)
        if store is not None:
            store.close()


def test_model_info_caps_longrope_context(tmp_path):
    """The gateway's view (`load_model_info`, no weights) serves the runner's context."""
    from vericache.model.loader import load_model_info

    build("phi3-longrope", tmp_path)
    assert load_model_info(str(tmp_path)).max_context == 128


def test_the_served_context_is_capped(tmp_path, monkeypatch):
    """The runner serves at most VERICACHE_MAX_CONTEXT positions (its RoPE tables hold every
    one from load on; Llama 4 Scout declares 10M): the runner, the loaded model and the
    gateway's view agree, and a position past it is an error, not a read past the table. A
    value that is not a positive number is refused."""
    from vericache.errors import ModelLoadError
    from vericache.model.families import MAX_CONTEXT
    from vericache.model.loader import load_model, load_model_info

    build("llama4_text", tmp_path)  # (its q-scale table is as long as its RoPE table)
    assert MAX_CONTEXT == 131072 and load_model_info(str(tmp_path)).max_context == 512
    monkeypatch.setenv("VERICACHE_MAX_CONTEXT", "100")
    lm = load_model(str(tmp_path), dtype="float32")
    r = lm.runner
    assert lm.max_context == r.max_positions == load_model_info(str(tmp_path)).max_context == 100
    assert r.ropes[0][0].shape[0] == r.q_scale.shape[0] == 100
    cache = r.new_cache(8)
    r.step(list(range(3, 99)), 0, cache, logits="none")
    with pytest.raises(ValueError, match="past the model's"):
        r.step([5, 6, 7], 99, cache)
    monkeypatch.setenv("VERICACHE_MAX_CONTEXT", "lots")
    with pytest.raises(ModelLoadError, match="VERICACHE_MAX_CONTEXT"):
        load_model(str(tmp_path), dtype="float32")


# one family for each way the runner follows transformers' own bfloat16 arithmetic: RMSNorm
# (Llama), torch's LayerNorm (GPT-2), q scaled before the scores (OPT), the parallel branches
# summed before the residual (Phi), products then biases and ALiBi as SDPA's mask (Falcon-RW),
# eager attention (XGLM), one q and one k LayerNorm over every head (Persimmon), SDPA where
# transformers takes it (CodeGen), grouped experts (Mixtral, Qwen2-MoE), each branch's output
# times the residual multiplier (Granite), norms that scale in float32 and grouped experts'
# biases added after their products (GPT-OSS), a LayerNorm a head (StableLM 2 12B's q/k
# norms), torch's LayerNorm over a float32 copy (OLMo), RoPE over interleaved pairs in place
# (Cohere, ERNIE 4.5), latent attention's keys nope then pe (DeepSeek-V3), its complex pairs
# in float32 in place (DeepSeek-V2), sinks as sigmoid(lse - sink) (Granite-SWA), the RoPE
# table in the model's dtype (GPT-J), the gated MLP, the soft-cap and the experts' scale in
# transformers' order and its top k sorted (Beam), a decode step's SDPA call with each query
# head its own rows (Solar Open, whose heads are 128 wide), a chunked layer's decode keys as
# transformers' cache holds them (Llama 4), eager attention with its softmax in the model's
# dtype on every layer, a value scaled in it (MiMo-V2-Flash), a softplus gate a head, soft-
# capped router logits and the experts' sum scaled after it (Laguna), latent attention's
# scaled q and latent, zero-computation experts and a mixture added a layer later (LongCat)
BF16_BITWISE = ["llama", "gpt2", "opt", "phi", "falcon-rw", "xglm", "persimmon", "codegen",
                "mixtral", "qwen2_moe", "granite", "gpt_oss", "stablelm-qk", "olmo", "cohere",
                "ernie4_5", "deepseek_v3", "deepseek_v2", "granite_swa", "gptj", "beam",
                "solar_open", "llama4_text", "mimo_v2_flash", "laguna", "longcat_flash",
                "openai-gpt", "gpt_neox_japanese", "jetmoe", "cohere_compass_text",
                "modernbert-decoder", "diffllama", "ergo"]


@pytest.mark.parametrize("name,dtype", [(n, "bfloat16") for n in BF16_BITWISE]
                         # (a sliding layer's decode keys once they span its window: transformers
                         # keeps its mask there, and the call's shape shows in float16)
                         + [("gemma3_text", "float16")])
def test_bfloat16_logits_are_transformers_bits(name, dtype, tmp_path):
    """In bfloat16 (and float16) a 256-token prefill's logits equal transformers' forward bit
    for bit (benchmarks/bf16_logits.py measures every family), and so do the next twelve
    decode steps' (each against transformers' step over its own cache): the same operations
    in the same order, rounded where transformers rounds; and `full`'s greedy tokens are
    transformers' `generate`'s."""
    from vericache.model.loader import load_model
    build(name, tmp_path)
    lm = load_model(str(tmp_path), dtype=dtype)
    n = 256  # (benchmarks/bf16_logits.py's prompt)
    ids = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    hf = auto_class(name).from_pretrained(str(tmp_path), dtype=getattr(torch, dtype)).eval()
    got, want, equal_steps, first = prefill_and_steps(lm, hf, ids, 12)
    # (the runner hands its logits on in float32; Beam's soft-cap is float32 in both, and
    # Ergo's LM head)
    assert want.dtype == (torch.float32 if name in ("beam", "ergo") else getattr(torch, dtype))
    assert torch.equal(got.float(), want.float()), (name, float((got - want.float()).abs().max()))
    assert (equal_steps, first) == (12, None)  # then twelve decode steps', against transformers'
    # (the prompt in one prefill pass, as transformers' generate takes it, then steps)
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate
    full = generate(lm, ids, GenParams(mode="full", max_tokens=20, ignore_eos=True))
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                      max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert full.token_ids == out[0, n:].tolist()


@pytest.mark.parametrize("name", sorted(VL_LOGITS))
def test_a_vision_language_checkpoints_logits(name, tmp_path):
    """A vision-language checkpoint (`VL_LOGITS`) loads, and on a text prompt the runner's
    logits (prefill, one-token steps, a four-token step) are transformers' image-text-to-text
    model's; the gateway's view of it is the runner's."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from vericache.model.loader import load_model, load_model_info, transformers_class

    over = VL_LOGITS[name]
    ids = {k: COMMON[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = CONFIG_MAPPING[name](**{**over, **ids, "text_config": {**COMMON, **over["text_config"]}})
    torch.manual_seed(0)
    _save_randomised(transformers_class(name).from_config(cfg, dtype=torch.float32), tmp_path)
    lm = load_model(str(tmp_path), dtype="float32")
    hf = transformers_class(name).from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    info = load_model_info(str(tmp_path))
    assert (info.max_context, info.vocab_size, info.kv_bytes_per_token) == \
        (lm.max_context, lm.vocab_size, lm.kv_bytes_per_token)
    x = torch.randint(3, VOCAB, (PROMPT + 6,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=x[None]).logits[0].float()
    r, cache = lm.runner, lm.runner.new_cache(8)
    got = [r.step(x[:PROMPT].tolist(), 0, cache, logits="all")[0]]
    for i in range(PROMPT, PROMPT + 2):
        got.append(r.step([int(x[i])], i, cache, logits="all")[0])
    got.append(r.step(x[PROMPT + 2:].tolist(), PROMPT + 2, cache, logits="all")[0])
    got = torch.cat(got)
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max())), name
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["gemma3", "llava", "qwen2_5_vl", "apertus1p5", "llama4", "mllama"])
def test_model_info_of_a_vision_language_model(name, tmp_path):
    """The gateway's view of a vision-language checkpoint is its text model's: the context,
    vocabulary (the LM head's: Apertus 1.5's is pruned to 250), KV bytes a token and
    end-of-sequence ids the runner serves."""
    from vericache.model.loader import load_model, load_model_info

    build(name, tmp_path)
    info, lm = load_model_info(str(tmp_path)), load_model(str(tmp_path))
    assert (info.max_context, info.vocab_size, info.kv_bytes_per_token, info.eos_token_ids) == \
        (lm.max_context, lm.vocab_size, lm.kv_bytes_per_token, lm.eos_token_ids)
    r = lm.runner
    assert (lm.max_context, lm.vocab_size) == (512, 250 if name == "apertus1p5" else VOCAB)
    assert 1 in lm.eos_token_ids
    assert lm.kv_bytes_per_token == 2 * r.num_layers * r.num_kv_heads * r.head_dim * 4


def test_unsupported_architecture_is_refused(tmp_path):
    """Mamba (a state-space model: its state is not a KV cache) is refused, the message
    listing every family."""
    from transformers import MambaConfig, MambaForCausalLM

    from vericache.errors import ModelLoadError
    from vericache.model.loader import load_model
    from vericache.model.runner import SUPPORTED

    torch.manual_seed(0)
    MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                 state_size=4)).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    msg = str(e.value)
    assert "'mamba' is not supported" in msg
    for name in SUPPORTED:
        assert name in msg
    assert set(SUPPORTED) >= {"llama", "mistral", "ministral", "qwen2", "qwen3", "smollm3",
                              "granite", "olmo2", "olmo3", "phi3", "gemma", "gemma2",
                              "gemma3_text", "gemma3", "mistral3", "llava", "mixtral",
                              "qwen2_moe", "qwen3_moe", "olmoe", "qwen2_vl", "qwen2_5_vl",
                              "qwen3_vl", "cohere", "cohere2", "starcoder2", "phi", "glm",
                              "glm4", "seed_oss", "arcee", "helium", "ernie4_5", "exaone4",
                              "gpt_oss", "granitemoe", "granitemoeshared", "glm4_moe", "dots1",
                              "solar_open", "exaone_moe", "minimax_m2", "flex_olmo", "gpt2",
                              "gpt_bigcode", "opt", "gpt_neox", "ministral3", "internlm3",
                              "iquestcoder", "stablelm", "jais2", "nemotron", "vaultgemma",
                              "deepseek_v3", "glm4_moe_lite", "youtu", "minicpm3", "mistral4",
                              "ernie4_5_moe", "minicpm5_moe", "afmoe", "hunyuan_v1_dense",
                              "hunyuan_v1_moe", "nanochat", "deepseek_v2", "phimoe",
                              "llama4_text", "bloom", "mpt"}


def test_vision_language_model_of_an_unsupported_language_model_is_refused(tmp_path):
    """A LLaVA checkpoint whose language model is Doge's (a bias on each key computed from its
    value): refused, naming both."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from vericache.errors import ModelLoadError
    from vericache.model.loader import load_model

    torch.manual_seed(0)
    text = dict(model_type="doge", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    cfg = LlavaConfig(text_config=text, vision_config=ARCHS["llava"][1]["vision_config"])
    LlavaForConditionalGeneration(cfg).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError,
                       match="llava's language model 'doge' is not supported"):
        load_model(str(tmp_path))


def test_dynamic_rope_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from vericache.errors import ModelLoadError
    from vericache.model.runner import Runner

    cfg = LlamaConfig(**{**COMMON, "num_hidden_layers": 1},
                      rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ModelLoadError, match="dynamic"):
        Runner.from_hf(LlamaForCausalLM(cfg))


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral", "qwen2_moe", "jetmoe",
                                  "modernbert-decoder"])
def test_weight_bytes_are_the_checkpoints(name, tmp_path):
    """`Runner.weight_bytes` (what the benchmarks count as the weights' memory) holds every
    parameter of the checkpoint once: the experts' (the attention's too), the LM head's
    and prediction head's, the norms' biases."""
    from vericache.model.loader import load_model

    build(name, tmp_path)
    lm = load_model(str(tmp_path), dtype="float32")
    hf = auto_class(name).from_pretrained(str(tmp_path), dtype=torch.float32)
    params = {p.data_ptr(): p.numel() * p.element_size() for p in hf.parameters()}
    assert lm.runner.weight_bytes() == sum(params.values())


def test_ctrl_with_another_final_eps():
    """CTRL's layers' norms take eps 1e-6 whatever its config says, its final norm the config's
    (`Weights.final_eps`): with a large one the runner's logits are still transformers'."""
    from transformers import CTRLConfig, CTRLLMHeadModel

    from vericache.model.runner import Runner

    cfg = CTRLConfig(**{**COMMON, "num_hidden_layers": 1}, dff=64, layer_norm_epsilon=0.5)
    torch.manual_seed(0)
    hf = CTRLLMHeadModel(cfg).eval()
    r = Runner.from_hf(hf)
    assert (r.eps, r.final_eps) == (1e-6, 0.5)
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = r.step(ids.tolist(), 0, r.new_cache(12), logits="all")[0]
        r.final_eps = None  # the layers' eps for the final norm too: other logits
        other = r.step(ids.tolist(), 0, r.new_cache(12), logits="all")[0]
    scale = max(1.0, float(ref.abs().max()))
    assert float((got - ref).abs().max()) <= 1e-5 * scale
    assert float((other - ref).abs().max()) > 1e-3 * scale


def test_cohere2_moe_with_its_sigmoid_router_is_refused():
    """Its sigmoid router takes the sigmoid and the sum in the logits' dtype (the runner's
    sigmoid scores are float32's), so it is refused by name; the softmax router is served."""
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    from vericache.errors import ModelLoadError
    from vericache.model.runner import Runner

    over = dict(ARCHS["cohere2_moe"][1], num_hidden_layers=2, expert_selection_fn="sigmoid")
    cfg = Cohere2MoeConfig(**{**COMMON, **over})
    with pytest.raises(ModelLoadError, match="Cohere 2 MoE's 'sigmoid' router"):
        Runner.from_hf(Cohere2MoeForCausalLM(cfg))


def test_a_granite_hybrid_with_mamba_layers_is_refused():
    """Granite 4.0's hybrids: a Mamba layer holds a state, not a KV cache; the layers are named."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from vericache.errors import ModelLoadError
    from vericache.model.runner import Runner

    over = dict(ARCHS["granitemoehybrid"][1], layer_types=["attention", "linear_attention", "attention"],
                mamba_n_heads=8, mamba_d_state=16)
    hf = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**{**COMMON, **over}))
    with pytest.raises(ModelLoadError, match=r"layers \[1\] are Mamba layers"):
        Runner.from_hf(hf)


def test_a_packed_bitnet_checkpoint_is_refused():
    """BitNet's packed ternary checkpoints (a quantization_config: transformers' BitLinear rounds
    each product's input to 8 bits) are refused with the way out; its plain weights load."""
    from transformers import BitNetConfig, BitNetForCausalLM

    from vericache.errors import ModelLoadError
    from vericache.model.runner import Runner

    hf = BitNetForCausalLM(BitNetConfig(**{**COMMON, "num_hidden_layers": 1}))
    assert Runner.from_hf(hf).layers[0].ln_mlp_sub is not None
    hf.config.quantization_config = {"quant_method": "bitnet", "linear_class": "autobitlinear"}
    with pytest.raises(ModelLoadError, match="packed ternary checkpoints"):
        Runner.from_hf(hf)


@pytest.mark.parametrize("positions", [False, True], ids=["dense", "positions"])
def test_caches_of_one_arena_are_pooled_from_their_first_token(positions, tmp_path, monkeypatch):
    """`Runner.new_cache(arena=key)`: the caches of one key are slots of one pool from the
    start (the engine's: a scheduler group's), so a pass over them copies no cache, and gives
    each sequence the logits and K/V of a pass of its own; a released slot is taken again; a
    full pool starts another, and a pass over caches of both pools copies them into one."""
    import gc

    from vericache.model.kvcache import KVCache, KVPool
    from vericache.model.loader import load_model
    from vericache.model.runner import SeqBatchItem

    build("qwen3", tmp_path)
    r = load_model(str(tmp_path), dtype="float32").runner
    r.arena_slots = 4
    copied = []
    of = KVPool.of.__func__

    def counted(cls, caches, *a, **k):
        copied.append(len(caches))
        return of(cls, caches, *a, **k)

    monkeypatch.setattr(KVPool, "of", classmethod(counted))
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (40, 65, 23, 51, 30)]

    def filled(ids, arena):
        c = r.new_cache(len(ids) + 4, positions, arena)
        n = len(ids) - 1
        r.forward([SeqBatchItem(ids[:n], torch.arange(n), c, "none")])
        return c

    def decode(caches, idx):  # one pass over every cache: each sequence's last token
        items = [SeqBatchItem(seqs[i][-1:], torch.tensor([len(seqs[i]) - 1]), c, "last")
                 for i, c in zip(idx, caches)]
        return r.forward(items)

    got = [filled(s, "g") for s in seqs[:3]]
    other = r.new_cache(8, positions, "h")
    plain = r.new_cache(8, positions)
    assert [c.slot for c in got] == [0, 1, 2] and all(c.pool is got[0].pool for c in got)
    assert other.pool is not got[0].pool and plain.pool is None
    assert got[0].capacity == r.max_positions  # a slot holds the model's context
    ref = [filled(s, None) for s in seqs[:3]]
    want = [decode([c], [i])[0] for i, c in enumerate(ref)]
    out = decode(got, [0, 1, 2])
    assert copied == []  # pooled already: nothing copied
    for w, o in zip(want, out):
        assert float((o - w).abs().max()) <= 1e-4 * float(w.abs().max())
    for a, b in zip(ref, got):
        assert torch.allclose(a.view()[0], b.view()[0], atol=1e-5)
        assert torch.allclose(a.view()[1], b.view()[1], atol=1e-5)
    pool = got[0].pool
    del got[1]
    gc.collect()
    again = filled(seqs[1], "g")
    assert again.pool is pool and again.slot == 1  # the released slot
    fourth = filled(seqs[3], "g")
    fifth = filled(seqs[4], "g")  # four slots held: a second pool
    assert fourth.pool is pool and fifth.pool is not pool and fifth.slot == 0
    caches = [got[0], again, got[1], fourth, fifth]
    ref = [KVCache.from_tensors(c.k[:, :, :c.length].clone(), c.v[:, :, :c.length].clone(), 4,
                                None if c.pos is None else c.pos[:, :, :c.length].clone())
           for c in caches]

    def step(cs):  # one more token for each, at its next position
        return r.forward([SeqBatchItem(torch.tensor([5]), torch.tensor([c.length]), c, "last")
                          for c in cs])

    want = [step([c])[0] for c in ref]
    out = step(caches)
    assert copied == [5]  # one pool for the pass: five caches copied into it
    assert all(c.pool is caches[0].pool for c in caches) and caches[0].pool.size == 8
    for w, o in zip(want, out):
        assert float((o - w).abs().max()) <= 1e-4 * float(w.abs().max())

@pytest.mark.parametrize("positions", [False, True], ids=["dense", "positions"])
@pytest.mark.parametrize("name,attention", [
    (name, attention) for name in ("qwen3", "mistral-sliding", "gemma3_text")
    for attention in ("kernel", "sdpa")] + [("gemma2", "sdpa")])  # Gemma 2: no kernel
def test_one_pass_for_a_ragged_batch(name, positions, attention, tmp_path):
    """Decode rows, a verify pass and a prefill chunk of sequences with different cached
    lengths in one pass (one attention call per layer over a pool of their caches) give each
    sequence the logits and K/V of a pass of its own; the next pass over the same caches
    reads the same pool, a pass without one of them too (its slot is padding), a sequence
    that joins takes the slot of one released, and a batch the pool cannot hold (more
    sequences than its free slots, or, with SDPA, which reads every slot of the span, under
    half of it) is pooled anew. With the native
    kernel, what a slot holds past its sequence's end is never read: it is NaN here; with
    SDPA, it is read masked and must be finite."""
    import gc

    from vericache.model.kvcache import KVCache
    from vericache.model.loader import load_model
    from vericache.model.runner import SeqBatchItem

    build(name, tmp_path)
    r = load_model(str(tmp_path), dtype="float32").runner
    if attention == "sdpa":
        r.attend_kernel = None
    assert (r.attend_kernel is not None) == (attention == "kernel")
    # the kernel takes each row's keys as a range; a sliding window over recorded positions
    # (a drafter cache of a windowed model) is SDPA's, with masks
    ranged = attention == "kernel" and not (positions and r.windowed)
    g = torch.Generator().manual_seed(5)
    pasts, news = [30, 70, 50, 21, 40, 25], [1, 5, 12, 1, 3, 2]
    seqs = [torch.randint(3, VOCAB, (p + n + 8,), generator=g) for p, n in zip(pasts, news)]

    def cache(ids):
        c = r.new_cache(len(ids) + 2)
        r.step(ids.tolist(), 0, c, logits="none")
        if not positions:
            return c
        k, v = c.view()
        return KVCache.from_tensors(k.clone(), v.clone(), 2, pos=torch.arange(c.length))

    def items(caches, order, lens):
        return [SeqBatchItem(seqs[i][caches[i].length: caches[i].length + n],
                             torch.arange(caches[i].length, caches[i].length + n), caches[i], "all")
                for i, n in zip(order, lens)]

    def poisoned(i):  # what a cache holds past its tokens is never read: make it poison
        c = cache(seqs[i][:pasts[i]])
        c.k[:, :, c.length:] = float("nan")
        c.v[:, :, c.length:] = float("nan")
        return c

    ref = [cache(s[:p]) for s, p in zip(seqs, pasts)]
    got = {i: poisoned(i) for i in range(4)}
    # (sequences in pass order, their new tokens, the pool expected: "new" or "same")
    passes = (([0, 1, 2, 3], news[:4], "new"),
              ([3, 2, 1, 0], [2, 1, 1, 1], "same"),  # the same set reordered
              ([0, 1, 2], [1, 3, 2], "same"),  # 3 sits this pass out: its slot is padding
              ([0, 4, 1, 2], [1, 3, 1, 1], "same"),  # 3 released: 4 joins in its slot
              ([4, 1], [1, 2], "same"),  # half the slots
              ([0, 1, 2, 4, 5], [1, 1, 1, 1, 2], "new"),  # five caches: the pool holds four
              ([4, 5], [1, 1], "same"),  # two members of the new pool (of eight slots)
              # two members five slots apart: the kernel reads only their rows' keys, so
              # they stay; SDPA would read the span, more than twice theirs: a pool of two
              ([0, 5], [1, 1], "same" if ranged else "new"))
    sizes = [4] * 5 + [8, 8, 8 if ranged else 2]
    pool = None
    for step, (order, lens, expect) in enumerate(passes):
        if step == 3:
            freed = got.pop(3).slot
            gc.collect()
            got[4] = poisoned(4)
        if step == 5:
            got[5] = poisoned(5)
        want = [r.forward([it])[0] for it in items(ref, order, lens)]
        if ranged and step:  # pooled: poison each slot past its tokens
            for i in order:
                if got[i].pool is not None:
                    got[i].k[:, :, got[i].length:] = float("nan")
                    got[i].v[:, :, got[i].length:] = float("nan")
        out = r.forward(items(got, order, lens))
        now = got[order[0]].pool
        assert all(got[i].pool is now for i in order)
        assert (now is pool) == (expect == "same"), (step, order)
        # a new pool has slots to spare: the next power of two (eight for five caches)
        assert now.size == sizes[step], (step, now.size)
        if step == 3:
            assert got[4].slot == freed
        pool = now
        for i, w, o in zip(order, want, out):
            assert o.shape == w.shape and ref[i].length == got[i].length
            assert float((o - w).abs().max()) <= 1e-4 * float(w.abs().max()), (name, order, lens)
            assert torch.allclose(ref[i].view()[0], got[i].view()[0], atol=1e-5)
            assert torch.allclose(ref[i].view()[1], got[i].view()[1], atol=1e-5)
        got[1].k[:, :, :2] = got[1].k[:, :, :2].clone()  # written in place (a drafter's refresh)
        # the slots one call read, up to the longest sequence's end, are finite (zeros, or a
        # former member's K/V), never uninitialised memory or a cache's own tail: the call
        # reads them for every shorter sequence, masked, and 0 x NaN would be NaN
        if not ranged:
            span = [got[i].slot for i in order]
            hi = max(got[i].length for i in order)
            read = (slice(None), slice(min(span), max(span) + 1), slice(None), slice(0, hi))
            assert bool(now.k[read].isfinite().all() and now.v[read].isfinite().all()), (name, step)


@pytest.mark.parametrize("act", ["sigmoid", "gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu",
                                 "silu", "relu2"])
@pytest.mark.parametrize("n", [1, 4, 8, 40, 64, 200])
def test_rowwise_gives_each_row_its_own_bits(act, n):
    """An elementwise function over a batch of rows (`rowwise`) gives each row the bits it gets
    alone, whatever the width, composites of torch ops too (GPT-2's gelu_new, quick_gelu):
    torch's run over a contiguous tensor takes vector code for whole vectors and scalar code
    for its tail (and exact GELU vector code for contiguous tensors only), so without it a
    row's sigmoid depended on the rows before it (a router's scores over 8 experts, on an
    AVX2 EPYC)."""
    from transformers.activations import ACT2FN

    from vericache.model.families import rowwise

    fn = torch.sigmoid if act == "sigmoid" else ACT2FN[act]
    x = 4 * torch.randn(33, 2 * n, generator=torch.Generator().manual_seed(n))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the invariant pass's)
    try:
        for rows in (x, x[:, :n]):  # a whole product, a slice of one
            got = rowwise(fn, rows)
            alone = torch.cat([rowwise(fn, rows[i: i + 1]) for i in range(33)])
            assert torch.equal(got, alone) and got.is_contiguous() and got.shape == rows.shape
            assert torch.allclose(got, fn(rows), rtol=1e-2, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma3_text", "llama4_text", "bloom-6",
                                  "mpt", "falcon-rw"])
def test_the_invariant_pass_reads_positions(name, tmp_path):
    """The invariant pass (items marked `bitwise`) runs each row as one SDPA call over the
    keys it sees, from its window's or chunk's start, ALiBi's bias by the keys' and the row's
    positions: a prefill, one-token steps and a four-token step, continuing one cache, give
    transformers' logits. (Its verify passes are checked against its own decode steps
    elsewhere, which a wrong start or bias in both would pass.)"""
    from vericache.model.loader import load_model
    from vericache.model.runner import SeqBatchItem

    build(name, tmp_path)
    r = load_model(str(tmp_path), dtype="float32").runner
    hf = auto_class(name).from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB, (PROMPT + 12,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache, got = r.new_cache(8), []
    for lo, hi in [(0, PROMPT), *[(p, p + 1) for p in range(PROMPT, PROMPT + 8)],
                   (PROMPT + 8, PROMPT + 12)]:
        item = SeqBatchItem(ids[lo:hi], torch.arange(lo, hi), cache, logits="all", bitwise=True)
        got.append(r.forward([item])[0])
    got = torch.cat(got)
    assert float((got - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max())), name
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["bloom-6", "mpt", "falcon-rw"])
def test_alibi_in_the_native_kernel(name, tmp_path):
    """The native attention kernel adds ALiBi's bias itself (each family's arithmetic), so an
    ALiBi model's decode and verify passes read the KV at the kernel's speed: a verify pass of
    five rows and a decode step over the prompt's cache give the explicit path's logits (the
    kernel set aside) to float32 rounding, and the votes too."""
    from vericache.model.loader import load_model
    from vericache.model.runner import SeqBatchItem

    build(name, tmp_path)
    r = load_model(str(tmp_path), dtype="float32").runner
    ids = torch.randint(3, VOCAB, (PROMPT + 6,), generator=torch.Generator().manual_seed(8))

    def run():
        c = r.new_cache(8)
        r.step(ids[:PROMPT].tolist(), 0, c, logits="none")
        verify = SeqBatchItem(ids[PROMPT: PROMPT + 5], torch.arange(PROMPT, PROMPT + 5), c, "all",
                              votes=True)
        got = r.forward([verify])[0]
        step = r.step([int(ids[PROMPT + 5])], PROMPT + 5, c, logits="all")[0]
        return torch.cat([got, step]), verify.attn_votes

    kernel = r.attend_kernel
    kinds, alibi = [], kernel._alibi  # (each ALiBi call's arithmetic, as the kernel is asked)
    kernel._alibi = lambda *args: kinds.append(args[-1]) or alibi(*args)
    try:
        with_kernel = run()
    finally:
        kernel._alibi = alibi
    # every layer of the verify pass (with votes) and of the step: MPT's, BLOOM's or Falcon's
    want = {"mpt": 0, "bloom-6": 1, "falcon-rw": 2}[name]
    assert kinds == [want] * (2 * r.num_layers)
    r.attend_kernel = None
    try:
        explicit = run()
    finally:
        r.attend_kernel = kernel
    scale = float(explicit[0].abs().max())
    assert float((with_kernel[0] - explicit[0]).abs().max()) <= 1e-5 * max(1.0, scale), name
    assert float((with_kernel[1] - explicit[1]).abs().max()) < 1e-5, name


@pytest.mark.parametrize("vote_from", [0, 5])
@pytest.mark.parametrize("name", ["bloom-6", "mpt"])
def test_alibi_votes_are_transformers_attention(name, vote_from, tmp_path):
    """ALiBi's bias is in the votes too (the explicit-score path; the selection policies move
    the drafter's set by them): a pass's votes are the attention weights transformers' eager
    attention returns, summed over the rows from `vote_from` on, for every layer and head."""
    from vericache.model.loader import load_model
    from vericache.model.runner import SeqBatchItem

    build(name, tmp_path)
    r = load_model(str(tmp_path), dtype="float32").runner
    hf = auto_class(name).from_pretrained(str(tmp_path), dtype=torch.float32,
                                          attn_implementation="eager").eval()
    ids = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        att = torch.stack(hf(ids[None], output_attentions=True).attentions)[:, 0]  # [L, H, n, n]
    c = r.new_cache(8)
    r.step(ids[:-9].tolist(), 0, c, logits="none")
    it = SeqBatchItem(ids[-9:], torch.arange(PROMPT - 9, PROMPT), c, "none", votes=True,
                      vote_from=vote_from)
    r.forward([it])
    want = att[:, :, PROMPT - 9 + vote_from:].sum(2)  # [layers, H, n]
    assert it.attn_votes.shape == want.shape
    assert float((it.attn_votes - want).abs().max()) < 1e-5


@pytest.mark.parametrize("name", sorted(MOE - {"mixtral-sliding"})
                         + ["olmo2", "cohere2", "starcoder2", "llama-biases", "phi", "glm4",
                            "arcee", "ernie4_5", "llama-gelu", "gpt2", "opt", "gpt_neox",
                            "nanochat", "olmo", "apertus", "gptj", "hyperclovax", "granite_swa",
                            "falcon", "llama4_text", "bloom", "mpt", "openai-gpt",
                            "longcat_flash", "bitnet", "modernbert-decoder", "diffllama"])
def test_bitwise_beside_the_fused_pass(name, tmp_path):
    """Families whose layers the fused native pass does not run. A mixture of experts gathers each
    expert's rows into one product, so which rows share a pass decides which rows share an
    expert's product; OLMo's q/k norms take slices of the qkv product, which are contiguous
    in a one-row step only; LayerNorms (Cohere 2's, StarCoder 2's), parallel blocks and
    output biases are torch's row-wise operations. In the bitwise mode a verify pass over
    four sequences (3 drafts each) still equals each sequence's own decode steps bit for
    bit, logits and K/V; and vericache (bitwise) equals full (bitwise). GPT-2 and OPT add
    learned positions, GPT-NeoX a parallel MLP on a norm of its own. `llama-gelu`: Llama
    gated by exact GELU, whose vector code torch takes for contiguous input only (`rowwise`).
    Laguna's first product is 258 floats a row (its gate one a head), so a pass's rows of q
    start off 64 bytes, where torch's SDPA gives other bits (`_attend_rows` copies each)."""
    from vericache.bench.exactness import measure
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate
    from vericache.engine.rounds import LocalBackends
    from vericache.model.loader import load_model

    if name == "llama-gelu":
        build("llama", tmp_path, hidden_act="gelu")
    else:
        build(name, tmp_path)
    lm = load_model(str(tmp_path), dtype="float32")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (PROMPT - 8 * i,), generator=g).tolist() for i in range(4)]
    bit = measure(lm.runner, prompts, rows=8, ks=(3,), batches=(4,), modes=("bitwise",))
    d = bit["bitwise", 3, 4]
    assert d.rows == 32
    assert d.max_abs_logit == 0 and d.logit_rows_differing == 0 and d.kv_rows_differing == 0
    params = dict(max_tokens=24, ignore_eos=True, exact="bitwise")
    full = generate(lm, prompts[0], GenParams(mode="full", **params))
    vc = generate(lm, prompts[0],
                  GenParams(mode="vericache", compressor="snapkv:recent=16,window=8",
                            chunk_size=CHUNK, draft_len=4, **params), LocalBackends(lm))
    assert vc.token_ids == full.token_ids and len(full.token_ids) == 24
