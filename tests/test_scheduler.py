"""The scheduler without a model: named cases and a table of whole runs."""

import pytest

from vericache.engine.scheduler import (DONE, DRAFTING, READY_DRAFT, VERIFYING, WAITING, Job,
                                        Scheduler)


def admit(s: Scheduler, *rids: str) -> None:
    for rid in rids:
        s.add(rid)
    (job,) = s.schedule()
    assert job.kind == "prefill"
    s.done(job)


def test_lockstep_all_draft_then_all_verify():
    s = Scheduler("lockstep")
    admit(s, "a", "b", "c")
    (d,) = s.schedule()
    assert d == Job("draft", ("a", "b", "c"))
    assert s.schedule() == []  # one lane at a time
    s.done(d)
    (v,) = s.schedule()
    assert v == Job("verify", ("a", "b", "c"))
    assert s.schedule() == []
    s.done(v, {"b"})
    assert [s.state(r) for r in "abc"] == [READY_DRAFT, DONE, READY_DRAFT]


def test_staggered_one_group_verifies_while_the_other_drafts():
    s = Scheduler("staggered", groups=2)
    for rid in "abcd":
        s.add(rid)
    # admission: one request a job, on the admission lane and the drafter lane; the
    # verifier lane, with nothing to verify, idles
    p1, p2 = s.schedule()
    assert (p1, p2) == (Job("prefill", ("a",), "admit"), Job("prefill", ("b",), "draft"))
    assert (p1.lane, p2.lane) == ("admit", "draft") and s.group("a") != s.group("b")
    s.done(p1)
    s.done(p2)
    # the verifier would idle (nothing verifies or is ready to): the drafter lane drafts for
    # the first group's admitted request while the admission lane admits the next
    p3, d0 = s.schedule()
    assert (p3, d0) == (Job("prefill", ("c",), "admit"), Job("draft", ("a",)))
    s.done(d0)
    # a verifies; with the verifier busy, the drafter lane admits before drafting b
    v0, p4 = s.schedule()
    assert (v0, p4) == (Job("verify", ("a",)), Job("prefill", ("d",), "draft"))
    for j in (p3, p4, v0):
        s.done(j)
    assert [s.group(r) for r in "abcd"] == [0, 1, 0, 1]
    (d1,) = s.schedule()  # all admitted, nothing to verify: the next group drafts
    assert d1 == Job("draft", ("b", "d"))
    s.done(d1)
    jobs = s.schedule()
    assert sorted(j.kind for j in jobs) == ["draft", "verify"]
    v = next(j for j in jobs if j.kind == "verify")
    d2 = next(j for j in jobs if j.kind == "draft")
    assert v.rids == d1.rids and d2.rids == ("a", "c")
    assert all(s.state(r) == VERIFYING for r in v.rids)
    assert all(s.state(r) == DRAFTING for r in d2.rids)
    s.done(v)  # the first group verifies while the second drafts again
    s.done(d2)
    jobs = s.schedule()
    assert {j.kind: j.rids for j in jobs} == {"verify": d2.rids, "draft": ("b", "d")}


def test_staggered_drafter_lane_admits_first_while_the_verifier_has_work():
    """A free drafter lane takes a waiting request's prefill before drafting, unless the
    verifier would idle: then it drafts, and the verifier's link starts early."""
    s = Scheduler("staggered", groups=2)
    for rid in "abcdef":
        s.add(rid)
    p1, p2 = s.schedule()
    s.done(p1)
    s.done(p2)
    p3, d = s.schedule()  # a, b ready to draft; nothing to verify: draft
    assert d.kind == "draft" and p3.kind == "prefill"
    s.done(d)
    v, p4 = s.schedule()  # the verifier has work: the drafter lane admits
    assert v.kind == "verify" and p4 == Job("prefill", ("d",), "draft")
    s.done(p4)
    (p5,) = s.schedule()  # still verifying, requests wait: admit again, draft later
    assert p5 == Job("prefill", ("e",), "draft")
    s.done(p5)
    s.done(v)
    s.done(p3)
    jobs = s.schedule()  # the verifier idles again: one lane admits, the other drafts
    assert sorted(j.kind for j in jobs) == ["draft", "prefill"]


def test_staggered_offloaded_requests_are_admitted_on_the_admission_lane_only():
    """A request whose full KV is offloaded (load bytes) ends its admission by storing that
    KV over the tier's link, one store at a time: the drafter lane never prefills one; it
    drafts the admitted requests instead. A resident request behind it is still taken."""
    s = Scheduler("staggered", groups=2)
    for rid in "abcd":
        s.add(rid, load_bytes=100)
    (p1,) = s.schedule()  # the drafter lane does not take b
    assert p1 == Job("prefill", ("a",), "admit") and s.state("b") == WAITING
    s.done(p1)
    p2, d = s.schedule()
    assert (p2, d) == (Job("prefill", ("b",), "admit"), Job("draft", ("a",)))
    s.done(d)
    (v,) = s.schedule()  # a verifies; the free drafter lane leaves c to the admission lane
    assert v == Job("verify", ("a",)) and s.state("c") == WAITING
    s2 = Scheduler("staggered", groups=2)
    s2.add("x", load_bytes=100)
    s2.add("y")
    # once x is on the admission lane, the head of the queue is resident: the drafter lane
    # takes it
    assert s2.schedule() == [Job("prefill", ("x",), "admit"), Job("prefill", ("y",), "draft")]


def test_verify_budget_splits_a_verify_job():
    """Offloaded requests hold their prefilled full KV until their first verification (which
    loads nothing), and admission keeps room for one working copy beside them; later verify
    jobs load working copies and split where the loads do not fit, those that load nothing
    taken first."""
    s = Scheduler("lockstep", verify_budget=300)
    for rid in "abcd":
        s.add(rid, load_bytes=100)
    (p,) = s.schedule()
    assert p.rids == ("a", "b")  # a third: 300 held + a copy's room > 300
    s.done(p)
    assert s.in_use() == (0, 200)
    (d,) = s.schedule()
    s.done(d)
    (v1,) = s.schedule()
    assert v1.rids == ("a", "b") and s.in_use() == (0, 200)  # on their own KV: no loads
    s.done(v1)
    assert s.in_use() == (0, 0)
    (p2,) = s.schedule()  # their KV went back to the host: c and d fit now
    assert p2.rids == ("c", "d")
    s.done(p2)
    (d2,) = s.schedule()
    assert d2.rids == ("a", "b", "c", "d")
    s.done(d2)
    (v2,) = s.schedule()  # room 300 - 200 held: c and d (no load) and a's copy
    assert v2.rids == ("a", "c", "d") and s.in_use() == (0, 300)
    s.done(v2)
    (v3,) = s.schedule()  # lockstep: the rest verifies before anyone drafts again
    assert v3.rids == ("b",)
    s.done(v3)
    (d3,) = s.schedule()
    assert d3.rids == ("a", "b", "c", "d")


def test_resident_budget_bounds_admission_and_frees_on_done():
    s = Scheduler("lockstep", verify_budget=200)
    for rid in "abc":
        s.add(rid, resident_bytes=100)
    (p,) = s.schedule()
    assert p.rids == ("a", "b") and s.state("c") == WAITING
    s.done(p)
    (d,) = s.schedule()
    s.done(d)
    (v,) = s.schedule()
    s.done(v, {"a"})
    (p2,) = s.schedule()  # a's memory is free: c is admitted before the next round
    assert p2 == Job("prefill", ("c",))


def test_total_budget_counts_the_drafter_and_the_verifier_together():
    """One memory for both sides: the drafters' compressed KV, the prefilled full KV an
    offloaded request holds until its first verification, and room for one working copy:
    admission and verify jobs shrink, and no job goes past the budget; a forgotten request
    frees its share."""
    s = Scheduler("lockstep", total_budget=400)
    for rid in "abcd":
        s.add(rid, draft_bytes=50, load_bytes=100)
    (p,) = s.schedule()
    assert p.rids == ("a", "b")  # 2 x (50 + 100) held + a copy's 100; a third: 550 > 400
    assert s.in_use() == (100, 200)
    s.done(p)
    (d,) = s.schedule()
    s.done(d)
    (v1,) = s.schedule()
    assert v1.rids == ("a", "b")
    s.done(v1)
    (p2,) = s.schedule()  # d would make 200 drafted + 200 held + a copy: 500 > 400
    assert p2.rids == ("c",) and s.in_use() == (150, 100)
    s.done(p2)
    (d2,) = s.schedule()
    s.done(d2)
    (v2,) = s.schedule()  # room 400 - 150 drafted - 100 held: c (no load) and a's copy
    assert v2.rids == ("a", "c") and s.in_use() == (150, 200)
    s.done(v2, {"c"})
    s.forget("c")
    with pytest.raises(ValueError, match="not done"):
        s.forget("a")
    (p3,) = s.schedule()  # c's share is free: d fits (100 + 50 drafted, 100 held, a copy)
    assert p3 == Job("prefill", ("d",))
    s.done(p3)
    (v3,) = s.schedule()  # lockstep: b verifies before anyone drafts again
    assert v3.rids == ("b",) and s.in_use() == (150, 200)
    s2 = Scheduler("lockstep", total_budget=240)
    for rid in "abc":
        s2.add(rid, draft_bytes=50, load_bytes=100)
    (p,) = s2.schedule()
    assert p.rids == ("a",)  # a second would hold 2 x 150 + a copy's 100 > 240


def test_too_small_budget_still_admits_one():
    s = Scheduler("lockstep", draft_budget=10, verify_budget=10)
    s.add("a", draft_bytes=50, resident_bytes=50)
    s.add("b", draft_bytes=50, resident_bytes=50)
    (p,) = s.schedule()
    assert p.rids == ("a",)


def test_done_rejects_a_job_not_running_and_remove_rejects_running():
    s = Scheduler("lockstep")
    admit(s, "a")
    with pytest.raises(ValueError):
        s.done(Job("verify", ("a",)))
    (d,) = s.schedule()
    with pytest.raises(ValueError):
        s.remove("a")
    s.done(d)
    s.remove("a")
    assert s.finished


def test_unknown_schedule():
    with pytest.raises(ValueError, match="lockstep, staggered"):
        Scheduler("eager")


def run(s: Scheduler, rounds: dict[str, int], trace: list) -> None:
    """Drive the scheduler as an engine would, finishing lanes in order; each request ends
    after `rounds[rid]` verifications."""
    left = dict(rounds)
    running: list[Job] = []
    while not s.finished:
        running += s.schedule()
        assert running, "deadlock"
        job = running.pop(0)
        trace.append((job.kind, job.rids, tuple(j.kind for j in running)))
        fin = set()
        if job.kind == "verify":
            for rid in job.rids:
                left[rid] -= 1
                if left[rid] == 0:
                    fin.add(rid)
        s.done(job, fin)


@pytest.mark.parametrize("mode,groups,budget,rounds,overlaps", [
    ("lockstep", 1, None, {"a": 2, "b": 3}, False),
    ("lockstep", 1, 100, {"a": 2, "b": 1, "c": 2}, False),
    ("staggered", 2, None, {"a": 3, "b": 3, "c": 2, "d": 4}, True),
    ("staggered", 3, None, {"a": 2, "b": 2, "c": 2}, True),
    ("staggered", 2, 200, {"a": 2, "b": 2, "c": 1}, True),
    ("staggered", 2, 100, {"a": 2, "b": 2, "c": 1}, False),  # one request's KV at a time
])
def test_runs_finish_every_request(mode, groups, budget, rounds, overlaps):
    s = Scheduler(mode, groups=groups, verify_budget=budget)
    for rid in rounds:
        s.add(rid, load_bytes=60)
    trace: list = []
    run(s, rounds, trace)
    assert all(s.state(r) == DONE for r in rounds)
    verified = [r for kind, rids, _ in trace if kind == "verify" for r in rids]
    assert sorted(verified) == sorted(r for r, n in rounds.items() for _ in range(n))
    both = any(kind == "verify" and "draft" in others or kind == "draft" and "verify" in others
               for kind, _, others in trace)
    assert both == overlaps
    assert not s.schedule()


def test_draft_ahead_runs_only_when_the_drafter_lane_is_free_and_once_per_round():
    s = Scheduler("staggered", groups=1, draft_ahead=True)
    s.add("a")
    (p,) = s.schedule()
    s.done(p)
    (d,) = s.schedule()
    assert d.kind == "draft"
    s.done(d)
    jobs = s.schedule()
    assert [j.kind for j in jobs] == ["verify", "ahead"]
    assert s.state("a") == "verifying"
    s.done(jobs[1])
    assert s.state("a") == "verifying" and not s.schedule()  # one ahead job per round
    s.done(jobs[0])
    (d2,) = s.schedule()
    assert d2.kind == "draft"
    assert not Scheduler("lockstep", draft_ahead=True).schedule()


def test_a_services_ledger_refuses_a_session_past_its_budget_and_holds_nothing(lm):
    """The drafter's and verifier's own budgets (what the services run): a session that
    would pass it raises ResourceExhausted naming the flag; release gives the bytes back."""
    import torch

    from vericache.engine.budget import Ledger
    from vericache.engine.drafter import Drafter
    from vericache.engine.verifier import Verifier
    from vericache.errors import ResourceExhausted

    per_token = lm.runner.kv_bytes_per_token()
    ver = Verifier(lm.runner, ledger=Ledger(100 * per_token, "--kv-budget-mb"))
    ver.prefill("a", list(range(1, 41)), 20, 256)
    assert ver.ledger.in_use == 60 * per_token
    with pytest.raises(ResourceExhausted, match="--kv-budget-mb"):
        ver.prefill("b", list(range(1, 31)), 20, 256)  # 60 + 50 > 100
    assert "b" not in ver.sessions and ver.ledger.in_use == 60 * per_token
    ver.release("a")
    ver.prefill("b", list(range(1, 31)), 20, 256)
    assert ver.ledger.in_use == 50 * per_token

    # the drafter charges a token at its own K/V dtype's size: bfloat16 on CPU, half float32's
    per_token = lm.runner.kv_bytes_per_token(lm.runner.draft_dtype)
    assert lm.runner.draft_dtype == torch.bfloat16
    assert 2 * per_token == lm.runner.kv_bytes_per_token()
    dra = Drafter(lm.runner, lm.eos_token_ids,
                  ledger=Ledger(30 * per_token, "--draft-kv-budget-mb"))
    shape = (lm.runner.num_layers, lm.runner.num_kv_heads, 10, lm.runner.head_dim)
    dra.attach("a", torch.zeros(shape), torch.zeros(shape), [1], 11, 10)
    assert dra.ledger.in_use == 20 * per_token
    assert dra.sessions["a"].cache.k.dtype == torch.bfloat16
    with pytest.raises(ResourceExhausted, match="--draft-kv-budget-mb"):
        dra.attach("b", torch.zeros(shape), torch.zeros(shape), [1], 11, 10)
    assert set(dra.sessions) == {"a"}
    dra.release("a")
    assert dra.ledger.in_use == 0


def test_the_default_budget_sees_a_containers_memory_limit(tmp_path):
    """A Kubernetes or compose memory limit shows in the cgroup files, not in /proc/meminfo:
    the default budgets take it into account (v2, then v1; no limit: None)."""
    from vericache.engine.budget import cgroup_room

    assert cgroup_room(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    assert cgroup_room(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text(f"{4 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{1 << 30}\n")
    assert cgroup_room(str(tmp_path)) == 3 << 30
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{(2 << 30) + 5}\n")
    assert cgroup_room(str(v1)) == 0


def test_staggered_admission_never_waits_behind_a_queue_of_verifications():
    """Both lanes always have work of their own (two groups cycling): a request that arrives
    is prefilled at once on the admission lane, and the verifier lane never prefills."""
    s = Scheduler("staggered", groups=2)
    for rid in "abcd":
        s.add(rid)
    running: list[Job] = []
    lanes = []
    for _ in range(8):  # the four admitted; both groups draft and verify in turn
        new = s.schedule()
        lanes += [(j.kind, j.lane) for j in new]
        running += new
        s.done(running.pop(0))
    assert not [r for r in "abcd" if s.state(r) == WAITING]
    assert ("verify", "verify") in lanes and ("draft", "draft") in lanes
    assert ("prefill", "verify") not in lanes
    s.add("late")
    jobs = s.schedule()
    assert Job("prefill", ("late",), "admit") in jobs
    assert s.state("late") == "prefill"


def test_staggered_plain_requests_run_as_one_batch():
    """Requests whose draft jobs drafted nothing (plain decoding steps) belong to no group:
    a staggered schedule verifies them in one job, as lockstep would, instead of two half
    batches; a request that drafts again rejoins its own group's jobs."""
    s = Scheduler("staggered", groups=2)
    for rid in "abcd":
        s.add(rid)
    while s._in(WAITING) or s._in("prefill"):
        for j in s.schedule():
            s.done(j)
    assert sorted(s.group(r) for r in "abcd") == [0, 0, 1, 1]
    verified: list[tuple[str, ...]] = []
    running: list[Job] = []
    for _ in range(16):  # drive as an engine would, every draft job drafting nothing
        running += s.schedule()
        job = running.pop(0)
        s.done(job, plain=set(job.rids) if job.kind == "draft" else set())
        if job.kind == "verify":
            verified.append(job.rids)
    # the first verify jobs take one group each (nobody is plain yet); once every request
    # has drafted nothing, every verify job holds the whole batch
    whole = [sorted(v) == list("abcd") for v in verified]
    assert not whole[0] and sum(whole) >= 3 and all(whole[whole.index(True):]), verified
    # a request that drafts again is no longer plain: its group's jobs take it, not others'
    running += s.schedule()
    while not any(j.kind == "draft" for j in running):  # the running verify job ends
        s.done(running.pop(0))
        running += s.schedule()
    (d,) = [j for j in running if j.kind == "draft"]
    s.done(d, plain=set(d.rids) - {"a"})
    running.remove(d)
    assert not s._reqs["a"].plain and all(s._reqs[r].plain for r in d.rids if r != "a")
