"""Where a long-context variant's time goes, per lane and job kind, without its baselines.

Runs the chosen `vericache bench --scenario long-context` variants (the scenario's own
`run_long_context_variant`, after the same shared prefill) and prints, per variant, its
throughput, τ, each lane's busy seconds per job kind (prefill, draft, ahead, verify) and the
offloaded tier's link figures. `--admit N` also profiles N admissions alone (cProfile of
`LocalBackends.admit`: the prefix load, the prompt's last tokens, selection, the offload)
and prints the top functions. It times `LaneRunner._execute` from outside, so it runs on
any commit of the engine (before `busy_by_job` was in the scenario JSON too). Each job kind
also gets the CPU time and page faults of its lane's own thread (getrusage RUSAGE_THREAD;
the OpenMP workers a job fans out to, the tier's loader and storer are not in it), and each
variant the whole process's; `--timeline` prints every job's start and end. `--perf` also
samples every thread with Linux's `perf record` (call stacks, 499 Hz) over the variant and
prints, for its timed run only (the lanes' first job to their last), the CPU seconds in each
kind of native code (the attention kernel, the weight products, page faults, torch's other
kernels, Python, ...) in all and per thread name, and the leaf functions that took the most.
Outputs are not checked against full decoding here: run `vericache bench --scenario
long-context` for that.

    PYTHONPATH=. .venv/bin/python benchmarks/lane_profile.py --concurrency 16 \\
        --context-tokens 8000 --variants vericache_lockstep,vericache_staggered --admit 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import defaultdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--context-tokens", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--variants", default="vericache_lockstep,vericache_staggered",
                    help="comma list of long-context variants (full_resident, full_offloaded, "
                         "lossy, vericache_lockstep, vericache_staggered)")
    ap.add_argument("--compressor", default="snapkv")
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--draft-len", type=int, default=32, help="k, fixed")
    ap.add_argument("--selection", default="question")
    ap.add_argument("--kv-budget-caches", type=float, default=4.0)
    ap.add_argument("--link-gbps", type=float, default=4.0)
    ap.add_argument("--admit", type=int, default=0, metavar="N",
                    help="also profile N admissions alone (cProfile)")
    ap.add_argument("--timeline", action="store_true",
                    help="print each job: lane, kind, requests, start and end (seconds)")
    ap.add_argument("--perf", action="store_true",
                    help="sample the variant with `perf record` and print where the timed run's "
                         "CPU went, by kind of native code and thread (needs Linux's perf)")
    a = ap.parse_args()

    import vericache.engine.lanes as lanes
    from vericache.bench.prompts import shared_document_prompts
    from vericache.bench.scenario import (ScenarioConfig, drop_new_keys, fill_prefix_cache,
                                          run_long_context_variant)
    from vericache.compress.registry import make_compressor
    from vericache.engine.generation import Generation
    from vericache.engine.kvtier import make_tier
    from vericache.engine.rounds import LocalBackends
    from vericache.model import load_model
    from vericache.store.memory import MemoryStore

    # (lane, kind) -> [seconds, jobs, thread user s, thread system s, thread page faults]
    spent: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0, 0.0, 0.0, 0])
    timeline: list[tuple[str, str, int, float, float]] = []
    execute = lanes.LaneRunner._execute

    def timed(self, job, *args):
        t0, u0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD)
        try:
            return execute(self, job, *args)
        finally:
            t1, u1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD)
            s = spent[(job.lane, job.kind)]
            s[0] += t1 - t0
            s[1] += 1
            s[2] += u1.ru_utime - u0.ru_utime
            s[3] += u1.ru_stime - u0.ru_stime
            s[4] += u1.ru_minflt - u0.ru_minflt
            timeline.append((job.lane, job.kind, len(job.rids), t0, t1))

    lanes.LaneRunner._execute = timed
    lm = load_model()
    prompts = shared_document_prompts(lm.tokenizer, a.concurrency, a.context_tokens)
    cfg = ScenarioConfig(scenario="long-context", concurrency=a.concurrency, max_tokens=a.max_tokens,
                         compressor=a.compressor, ratio=a.ratio, draft_len=a.draft_len,
                         adaptive=False, kv_budget_caches=a.kv_budget_caches,
                         link_gbps=a.link_gbps, selections=[a.selection])
    store = MemoryStore()
    t0 = time.perf_counter()
    fill_prefix_cache(lm, store, [(f"warm-{i}", p.ids) for i, p in enumerate(prompts)],
                      make_compressor(a.compressor, a.ratio))
    print(f"shared prefill: {time.perf_counter() - t0:.1f} s", flush=True)
    published = set(store.keys())

    for rep in range(a.admit):
        tier = make_tier("offloaded", a.link_gbps, lm.runner.device)
        backends = LocalBackends(lm, store, tier)
        g = Generation(lm, prompts[rep % len(prompts)].ids, cfg.params("vericache"),
                       request_id=f"admit-{rep}")
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        backends.admit(g)
        prof.disable()
        print(f"admission {rep}: {time.perf_counter() - t:.3f} s", flush=True)
        backends.close()
        tier.close()
        drop_new_keys(store, published)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())

    for v in a.variants.split(","):
        spent.clear()
        timeline.clear()
        sampler = _ThreadSampler()
        recorder = _PerfRecorder() if a.perf else None
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        raw = run_long_context_variant(lm, prompts, cfg, v, store)
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        samples = recorder.stop() if recorder is not None else None
        by_name = sampler.stop()
        drop_new_keys(store, published)
        gens, tr = raw["gens"], raw["trace"]
        tokens = sum(len(g.output_ids) for g in gens)
        wall = tr.end - tr.start
        rounds = [n for g in gens for n in g.stats.round_emitted]
        print(f"{v}: {tokens / wall:.3f} tok/s, wall {wall:.1f} s, tau "
              f"{sum(rounds) / max(1, len(rounds)):.2f}, most admitted {tr.max_active}")
        print(f"  process (its tier's preallocation included): user {u1.ru_utime - u0.ru_utime:.1f} s, "
              f"system {u1.ru_stime - u0.ru_stime:.1f} s, {u1.ru_minflt - u0.ru_minflt} page faults")
        print("  every thread, by name (user s, system s, page faults; OpenMP's workers are "
              "the process's other threads):")
        for name, (user, system, faults) in sorted(by_name.items(), key=lambda x: -sum(x[1][:2])):
            print(f"    {name:24s} {user:7.1f} {system:7.1f} {faults:9d}")
        for (lane, kind), (sec, n, user, system, faults) in sorted(spent.items()):
            print(f"  {lane:6s} {kind:8s} {sec:8.2f} s in {n} jobs; its thread: user {user:.1f} s, "
                  f"system {system:.1f} s, {faults} page faults")
        if a.timeline and timeline:
            base = min(t[3] for t in timeline)
            for lane, kind, n, t0, t1 in sorted(timeline, key=lambda t: t[3]):
                print(f"  job {lane:6s} {kind:8s} {n:2d} requests {t0 - base:7.2f} {t1 - base:7.2f} s")
        st = raw["tier_stats"]
        if st is not None:
            print(f"  link: loaded {st.bytes_loaded / 1e9:.2f} GB, stored {st.bytes_stored / 1e9:.2f} GB, "
                  f"loader {st.transfer_s:.1f} s, pass waited {st.stall_s:.1f} s", flush=True)
        if samples is not None and timeline:
            _print_perf(samples, min(t[3] for t in timeline), max(t[4] for t in timeline),
                        sampler.names)
    return 0


PERF_HZ = 499
# kinds of native code, by a sample's leaf function (the first pattern that matches); a sample
# with a page fault among its frames counts as "page faults"
KINDS = (("attention kernel", ("attend", "expf")),
         ("weight products", ("qblock", "block", "vc_linear", "q8x_", "sgemm", "gemm")),
         ("other native kernels", ("vc_",)),
         ("torch's other kernels", ("at::", "c10::", "mkl", "gomp_", "GOMP")),
         ("memory copies and fills", ("memmove", "memcpy", "memset", "clear_page")),
         ("Python", ("Py", "_Py")),
         ("the kernel's scheduling", ("sched", "futex", "finish_task_switch", "spin_unlock",
                                      "do_syscall", "irq")))


def _kind(frames: list[str]) -> str:
    if any("page_fault" in f for f in frames):
        return "page faults"
    leaf = frames[0] if frames else "?"
    for kind, patterns in KINDS:
        if any(pat in leaf for pat in patterns):
            return kind
    return "other"


class _PerfRecorder:
    """`perf record` of this process (every thread, call stacks, CLOCK_MONOTONIC times, which
    `time.perf_counter` reads on Linux) from construction to `stop`, which returns the samples
    as (thread id, seconds, leaf-first frames)."""

    def __init__(self):
        if shutil.which("perf") is None:
            raise SystemExit("--perf needs Linux's perf (Debian: apt-get install linux-perf)")
        self._dir = tempfile.TemporaryDirectory()
        self._data = os.path.join(self._dir.name, "perf.data")
        self._proc = subprocess.Popen(
            ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", str(PERF_HZ), "-g",
             "-p", str(os.getpid()), "-o", self._data],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the variant starts
        if self._proc.poll() is not None:
            raise SystemExit(f"perf record failed: {self._proc.stderr.read().decode().strip()}")

    def stop(self) -> list[tuple[int, float, list[str]]]:
        self._proc.send_signal(signal.SIGINT)
        self._proc.wait()
        text = subprocess.run(["perf", "script", "-F", "tid,time,ip,sym", "-i", self._data],
                              capture_output=True, text=True).stdout
        self._dir.cleanup()
        samples: list[tuple[int, float, list[str]]] = []
        for line in text.splitlines():
            head = line.split()
            if len(head) == 2 and head[1].endswith(":") and head[0].isdigit():
                samples.append((int(head[0]), float(head[1][:-1]), []))
            elif head and samples:
                samples[-1][2].append(head[1] if len(head) > 1 else head[0])
        return samples


def _print_perf(samples, start: float, end: float, names: dict[int, str]) -> None:
    """Where the CPU went between `start` and `end` (perf_counter seconds)."""
    inside = [s for s in samples if start <= s[1] <= end]
    kinds: dict[str, int] = defaultdict(int)
    by_thread: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    leaves: dict[str, int] = defaultdict(int)
    for tid, _, frames in inside:
        k = _kind(frames)
        kinds[k] += 1
        name = names.get(tid, "(not Python's: OpenMP)").rstrip("0123456789_")
        by_thread[name][k] += 1
        leaves[frames[0] if frames else "?"] += 1
    cores = os.cpu_count() or 1
    total = len(inside) / PERF_HZ
    print(f"  perf over the timed run ({end - start:.1f} s, {cores} CPUs: {cores * (end - start):.1f} "
          f"CPU s): {total:.1f} CPU s sampled")
    for k, n in sorted(kinds.items(), key=lambda x: -x[1]):
        print(f"    {k:26s} {n / PERF_HZ:7.2f} CPU s  {n / max(1, len(inside)):6.1%}")
    for name, ks in sorted(by_thread.items(), key=lambda x: -sum(x[1].values())):
        top = ", ".join(f"{k} {n / PERF_HZ:.2f}" for k, n in sorted(ks.items(), key=lambda x: -x[1])[:4])
        print(f"    thread {name:24s} {sum(ks.values()) / PERF_HZ:6.2f} CPU s: {top}")
    print("    leaf functions:")
    for leaf, n in sorted(leaves.items(), key=lambda x: -x[1])[:12]:
        print(f"      {n / PERF_HZ:7.2f} CPU s  {leaf[:90]}")


class _ThreadSampler:
    """Each thread's CPU time and page faults over a run, from /proc/self/task (a thread's
    last sample before it ended; sampled every 0.2 s), summed by thread name."""

    def __init__(self):
        self._start = self._sample()
        self._last: dict[int, tuple[str, float, float, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _sample() -> dict[int, tuple[str, float, float, int]]:
        tick = os.sysconf("SC_CLK_TCK")
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:  # ended
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            # (from the state on: minflt is stat's 10th field, utime its 14th, stime its 15th)
            out[int(tid)] = (names.get(int(tid), "(not Python's: OpenMP)"),
                             int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]))
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._last.update(self._sample())

    @property
    def names(self) -> dict[int, str]:
        """Every thread seen, by native id."""
        return {tid: s[0] for tid, s in {**self._start, **self._last}.items()}

    def stop(self) -> dict[str, list]:
        self._stop.set()
        self._thread.join()
        self._last.update(self._sample())
        totals: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
        for tid, (name, user, system, faults) in self._last.items():
            _, u0, s0, f0 = self._start.get(tid, (name, 0.0, 0.0, 0))
            t = totals[name.rstrip("0123456789_")]
            t[0] += user - u0
            t[1] += system - s0
            t[2] += faults - f0
        return dict(totals)


if __name__ == "__main__":
    raise SystemExit(main())
