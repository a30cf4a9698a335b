"""`vericache generate`: decode one prompt, streaming verified text (or one JSON object)."""

from __future__ import annotations

import json
import sys

from vericache.cli.common import add_gen_args, add_model_args, add_prompt_args, gen_params, prompt_ids
from vericache.compress import make_compressor
from vericache.engine import local
from vericache.model import load_model


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="decode one prompt (streams verified tokens)",
                       description="Decode one prompt in full, lossy or vericache mode. Without "
                                   "--json the text streams as it is verified; with --json one "
                                   "object: text, token_ids, finish_reason, usage.")
    add_prompt_args(p)
    add_model_args(p)
    add_gen_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(run=run)


def run(args) -> int:
    params = gen_params(args)  # bad flags fail before the model loads
    if params.mode != "full":
        make_compressor(params.compressor, params.ratio)
    lm = load_model(args.model, args.dtype, args.device)
    ids = prompt_ids(args, lm.tokenizer)
    if args.json:
        res = local.generate(lm, ids, params)
        print(json.dumps(res.to_json()))
        return 0
    run = local.stream(lm, ids, params)
    for ev in run:
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    g = run.gen
    u = g.usage()
    print(f"\n[{g.stop.finish_reason}] {u['completion_tokens']} tokens, {u['rounds']} rounds, "
          f"{u['tokens_per_round']} tokens/round, acceptance {u['acceptance_rate']}", file=sys.stderr)
    return 0
