"""`vericache bench`: the n-gram drafter simulation, the parse checks, grid parsing, the
report, and one small real end-to-end run through the CLI."""

from __future__ import annotations

import json

import pytest

from vericache.bench import report
from vericache.bench.grid import CellPlan, Grid, plan, split_compressors, takes_ratio
from vericache.bench.metrics import (extract_code, first_divergence, ngram_lookup, ngram_rounds,
                                     parses_code, parses_json, tau_hist)
from vericache.bench.prompts import BenchPrompt
from vericache.errors import InvalidArgument, UnknownName

# ---- n-gram (prompt-lookup) drafter ------------------------------------------------------

NGRAM_CASES = {
    # name: (prompt, output, k, expected tokens per round)
    "output copies the prompt": ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], 4, [5, 2]),
    "no earlier match": ([1, 2, 3], [4, 5, 6, 7], 8, [1, 1, 1]),
    "k caps each round": ([9, 1, 2, 3, 4, 5, 6, 7, 8], [9, 1, 2, 3, 4, 5, 6, 7], 2, [3, 3, 1]),
    "last round leaves room for the bonus token": ([5, 6, 7, 8], [5, 6, 7, 8], 10, [3]),
    "mismatch stops acceptance": ([1, 2, 3, 4, 5], [1, 2, 9, 9], 4, [2, 1]),
    "one output token makes no round": ([1, 2], [1], 4, []),
    "empty output": ([1, 2], [], 4, []),
    # a copy stops where the known text ends: after 0 7 8 7, the 7 at 1 offers only 8 7
    "repetition inside the output": ([0], [7, 8, 7, 8, 7, 8, 7, 8], 3, [1, 1, 3, 2]),
}


@pytest.mark.parametrize("name", list(NGRAM_CASES))
def test_ngram_rounds(name):
    prompt, output, k, expected = NGRAM_CASES[name]
    rounds = ngram_rounds(prompt, output, k)
    assert rounds == expected
    assert sum(rounds) == max(0, len(output) - 1)  # every token after the first, once


def test_ngram_lookup_prefers_longest_then_most_recent():
    # the 2-gram (2, 3) occurs at 1; the 1-gram (3) also at 6, but longer n wins
    assert ngram_lookup([1, 2, 3, 4, 5, 9, 3, 6, 2, 3], 2) == [4, 5]
    # two occurrences of the same 1-gram: the most recent one's continuation
    assert ngram_lookup([7, 1, 8, 7, 2, 9, 7], 2, max_n=1) == [2, 9]
    assert ngram_lookup([1, 2, 3], 0) == []
    assert ngram_lookup([1], 4) == []


def test_first_divergence_and_hist():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([], [4]) == 0
    assert tau_hist([1, 3, 1, 17]) == {"1": 2, "3": 1, "17": 1}


# ---- parse checks -------------------------------------------------------------------------

def test_parses_code():
    good = "Here you go:\n```python\ndef f(x):\n    return x + 1\n```\nDone."
    assert extract_code(good) == "def f(x):\n    return x + 1\n"
    assert parses_code(good)
    assert parses_code("def f():\n    return 1\n")  # no fence: the whole text
    assert not parses_code("```python\ndef f(:\n```")
    assert not parses_code("Sure! The function is below.")  # prose is not code
    assert not parses_code("```python\n```")  # empty code
    assert parses_code("```\nx = [1, 2]\n```")  # a fence without a language


def test_parses_code_truncated_answer():
    cut = "```python\ndef f(x):\n    y = x + 1\n    return (y,"  # cut by max_tokens
    assert not parses_code(cut)
    assert parses_code(cut, truncated=True)  # valid so far: an open bracket is not an error
    # cut inside an identifier: the partial last line is dropped
    assert parses_code("```python\ndef f():\n    return 1\n\ndef _decode_u", truncated=True)
    assert parses_code('def f():\n    """doc\n    more', truncated=True)  # open docstring
    assert not parses_code("```python\ndef f(x):\n    y = = 1\n    return (y,", truncated=True)
    assert not parses_code("```python\nx = )\n```\n", truncated=True)  # closed fence: strict
    assert not parses_code("```python\ndef f(:", truncated=True)  # nothing before the cut


def test_parses_json():
    assert parses_json('{"functions": ["f"], "classes": []}')
    assert parses_json('```json\n{"a": {"b": "}"}}\n```')  # a brace inside a string
    assert parses_json('The answer: {"a": 1} and more text {x}')
    assert not parses_json('{"functions": ["f", ')  # truncated
    assert not parses_json("no object here")
    assert not parses_json("[1, 2, 3]")


# ---- grid ---------------------------------------------------------------------------------

def test_split_compressors_keeps_spec_parameters():
    assert split_compressors("snapkv, kivi:bits=4,group=32,streamingllm") == [
        "snapkv", "kivi:bits=4,group=32", "streamingllm"]


def test_ratio_axis_only_where_it_applies():
    assert takes_ratio("snapkv") and takes_ratio("streamingllm")
    assert not takes_ratio("kivi:bits=4")
    assert not takes_ratio("snapkv:ratio=8")  # the spec fixes it
    g = Grid(["snapkv", "kivi:bits=4"], [4.0, 8.0], [8, 32])
    assert g.configs == [("snapkv", 4.0), ("snapkv", 8.0), ("kivi:bits=4", None)]
    cells = plan([BenchPrompt("p", [1, 2, 3])], g)
    assert cells[0] == CellPlan("p", "full")
    assert sum(c.mode == "lossy" for c in cells) == 3
    assert sum(c.mode == "vericache" for c in cells) == 6


def test_selection_axis_runs_vericache_once_per_policy():
    g = Grid(["snapkv"], [4.0], [8, 32], selections=["static", "question", "verify:every=2"])
    cells = plan([BenchPrompt("p", [1, 2, 3])], g)
    vc = [c for c in cells if c.mode == "vericache"]
    assert [(c.draft_len, c.selection) for c in vc] == [
        (8, "static"), (8, "question"), (8, "verify:every=2"),
        (32, "static"), (32, "question"), (32, "verify:every=2")]
    assert [c.selection for c in cells if c.mode == "lossy"] == ["static"]
    assert vc[2].label == "p vericache snapkv@4 k=8 sel=verify:every=2"
    assert g.params("vericache", "snapkv", 4.0, 8, selection="verify").selection == "verify"
    with pytest.raises(UnknownName, match="valid: question, static, verify"):
        Grid(["snapkv"], [4.0], [8], selections=["oracle"])


def test_grid_rejects_bad_input():
    with pytest.raises(UnknownName):
        Grid(["nope"], [4.0], [8])
    with pytest.raises(InvalidArgument):
        Grid(["snapkv"], [4.0], [0])


# ---- report and exit status (no model) ----------------------------------------------------

def _fake_cell(mode, identical=True, **kw):
    cell = dict(prompt="p", mode=mode, compressor=None if mode == "full" else "snapkv",
                ratio=None if mode == "full" else 4.0, draft_len=8 if mode == "vericache" else None,
                completion_tokens=10, finish_reason="length", seconds=1.0, tokens_per_s=10.0,
                decode_tokens_per_s=12.0, speed_ratio_vs_full=1.0, decode_speed_ratio_vs_full=1.0,
                rounds=3, tau_mean=3.0, tau_hist={"3": 3}, acceptance_rate=0.5,
                full_kv_bytes=4 << 20, compressed_kv_bytes=1 << 20, compression=4.0,
                first_divergence=None, identical=identical, parses_code=True, parses_json=None,
                prefill_s=0.1, compress_s=0.01, draft_s=0.4, verify_s=0.4, draft_steps=9,
                verify_tokens=12, ngram_tau=1.5 if mode == "vericache" else None, ngram_tau_hist=None,
                selection=None if mode == "full" else "question", select_s=0.01,
                select_share_of_rounds=0.0125, select_moved_tokens=100, select_delta_bytes=52400,
                select_delta_bytes_per_token=5240.0)
    cell.update(kw)
    return cell


def test_run_exits_nonzero_when_vericache_differs(monkeypatch, tmp_path, capsys):
    from vericache.cli import bench, main

    class FakeLM:
        name, model_id, tokenizer = "fake", "fake:0", None

    cells = [_fake_cell("full"), _fake_cell("lossy", identical=False, first_divergence=3),
             _fake_cell("vericache", identical=False, first_divergence=5)]
    monkeypatch.setattr(bench, "load_model", lambda *a: FakeLM())
    monkeypatch.setattr(bench, "load_prompts", lambda args, tok: [BenchPrompt("p", [1, 2])])
    monkeypatch.setattr(bench, "run_cells", lambda lm, prompts, grid, quiet: cells)
    out = tmp_path / "r.json"
    assert main(["bench", "--compressors", "snapkv", "--ratios", "4", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "differs from full greedy" in captured.err and "p vericache snapkv@4 k=8 sel=question" in captured.err
    doc = json.loads(out.read_text())
    assert doc["summary"]["all_vericache_identical"] is False
    cells[2]["identical"] = True
    assert main(["bench", "--compressors", "snapkv", "--quiet"]) == 0


def test_plot_writes_png(tmp_path):
    import matplotlib  # noqa: F401  -- a required test dependency: missing fails, never skips

    from vericache.bench.plot import plot

    cells = [_fake_cell("full"), _fake_cell("vericache"),
             _fake_cell("vericache", ratio=8.0, compression=8.0, tau_mean=2.0)]
    doc = {"model": "fake", "summary": report.summarize(cells)}
    plot(doc, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys):
    from vericache.bench import plot
    from vericache.cli import bench, main

    monkeypatch.setattr(plot.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(bench, "load_model", lambda *a: pytest.fail("the model must not load"))
    assert main(["bench", "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


# ---- one small real run -------------------------------------------------------------------

def test_file_prompts(lm, tmp_path):
    from vericache.bench.prompts import file_prompts

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "q.txt").write_text("def add(a, b):")
    (tmp_path / "q.txt").write_text("Write a haiku.")
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Say hi."}]))
    ps = file_prompts(lm.tokenizer, [tmp_path / "a" / "q.txt", tmp_path / "q.txt"], [msgs], chat=False)
    assert [p.name for p in ps] == ["q", "q#2", "m"]
    assert all(p.expects == "any" and p.ids for p in ps)
    assert lm.tokenizer.decode(ps[0].ids).endswith("def add(a, b):")
    assert "<|im_start|>assistant" in lm.tokenizer.decode(ps[2].ids)
    msgs.write_text("not json")
    with pytest.raises(InvalidArgument):
        file_prompts(lm.tokenizer, [], [msgs])


@pytest.fixture(scope="module")
def bench_doc(lm, tmp_path_factory):
    """`vericache bench` on one ~300-token built-in prompt (the session's model, loaded once)."""
    from vericache.cli import bench, main

    out = tmp_path_factory.mktemp("bench") / "bench.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "load_model", lambda *a: lm)
        rc = main(["bench", "--builtin", "1", "--context-tokens", "300", "--compressors", "snapkv",
                   "--ratios", "4", "--draft-lens", "8", "--max-tokens", "16", "--chunk-size", "64",
                   "--threads", "1", "--quiet", "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_bench_end_to_end(bench_doc):
    rc, doc = bench_doc
    assert rc == 0
    assert [p["name"] for p in doc["prompts"]] == ["builtin-code-0"]
    assert 250 <= doc["prompts"][0]["prompt_tokens"] <= 300
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["torch"]
    cells = {c["mode"]: c for c in doc["cells"]}
    assert list(cells) == ["full", "lossy", "vericache"]
    full, lossy, vc = cells["full"], cells["lossy"], cells["vericache"]
    assert vc["identical"] is True and doc["summary"]["all_vericache_identical"] is True
    assert full["identical"] is True and full["speed_ratio_vs_full"] == 1.0
    for c in doc["cells"]:
        assert c["completion_tokens"] >= 1 and c["tokens_per_s"] > 0
        assert c["full_kv_bytes"] > 0 and c["prefill_s"] > 0
        assert isinstance(c["parses_code"], bool) and c["parses_json"] is None
    assert vc["parses_code"] == full["parses_code"]  # the same text parses the same way
    assert sum(int(n) * int(t) for t, n in vc["tau_hist"].items()) == vc["completion_tokens"] - 1
    assert 1.0 <= vc["tau_mean"] <= 9.0 and 0.0 <= vc["acceptance_rate"] <= 1.0
    assert vc["compression"] > 1.0 and vc["compressed_kv_bytes"] < vc["full_kv_bytes"]
    assert vc["verify_tokens"] == vc["rounds"] + vc["draft_steps"]  # k + 1 per round
    assert 1.0 <= vc["ngram_tau"] <= 9.0
    assert lossy["first_divergence"] is None or 0 <= lossy["first_divergence"] <= 16
    assert lossy["acceptance_rate"] is None and lossy["draft_len"] is None
