"""The native attention kernel of two commits, side by side: one layer's call (3 KV heads, 3
query heads each, head size 64, SmolLM2's shape) for decode, draft, verify and prefill shapes,
timed alternately and compared bit for bit.

    PYTHONPATH=. .venv/bin/python benchmarks/attend_ab.py --baseline 5d273ba
    PYTHONPATH=. .venv/bin/python benchmarks/attend_ab.py --baseline 5d273ba --march znver3

`attend.c` of --baseline (`git show`) and of this checkout are each compiled with the
runner's compiler ($CC, else cc) and flags (`vericache.model.kernels.LIBRARIES`; `--march`
replaces `-march=native`, so that an AVX2 build can run on an AVX-512 machine) into a
temporary folder and loaded with ctypes. For each shape and thread count, --reps rounds each time both builds' calls (the
best of 3 calls each) and the baseline's / this checkout's time is their ratio: the median
and the range over the rounds are printed (a ratio over 1: this checkout is faster). Every
shape's outputs must be equal bit for bit between the builds (the script fails otherwise):
the kernel's bits are what exactness rests on. The inputs are random; the machine should be
otherwise idle.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from vericache.model.kernels import LIBRARIES

I64, F32, PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# name: (sequences, rows a query head, keys, bfloat16 K/V)
SHAPES = {"decode 16 x 8k": (16, 1, 8000, False), "decode 1 x 8k": (1, 1, 8000, False),
          "draft 4 x 2k bf16": (4, 1, 2000, True), "verify 33 rows x 8k": (1, 33, 8000, False),
          "prefill 56 rows x 8k": (1, 56, 8000, False)}


def build(source: str, folder: Path, name: str, march: str | None,
          library: str = "attend") -> ctypes.CDLL:
    """`source` compiled as the runner compiles `library` (its flags, `--march` for native)
    into `folder`, loaded; for "attend", its entry points typed."""
    _, cflags, ldflags = LIBRARIES[library]
    if march:
        cflags = [f"-march={march}" if f.startswith("-march=") else f for f in cflags]
    src, obj, lib = folder / f"{name}.c", folder / f"{name}.o", folder / f"{name}.so"
    src.write_text(source)
    cc = os.environ.get("CC", "cc")  # the compiler the runner builds with (`kernels._build`)
    subprocess.run([cc, *cflags, "-c", "-o", str(obj), str(src)], check=True)
    subprocess.run([cc, "-shared", "-o", str(lib), str(obj), *ldflags], check=True)
    dll = ctypes.CDLL(str(lib))
    for fn in ("vc_attend_f32", "vc_attend_bf16") if library == "attend" else ():
        getattr(dll, fn).argtypes = [PTR] * 3 + [I64] * 3 + [PTR] * 3 + [I64] * 4 + [F32, I64]
        getattr(dll, fn).restype = ctypes.c_int
    return dll


def inputs(B: int, T: int, N: int, bf: bool, H: int = 3, G: int = 3, D: int = 64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, G * T, D, generator=g)
    dtype = torch.bfloat16 if bf else torch.float32
    k = torch.randn(B, H, N, D, generator=g).to(dtype)
    v = torch.randn(B, H, N, D, generator=g).to(dtype)
    # row (g, t) sees the keys [0, N - T + t + 1): a causal pass's last T tokens
    hi = (N - T + 1 + torch.arange(T)).repeat(G)[None].expand(B, -1).contiguous()
    return q, k, v, torch.zeros_like(hi), hi


def call(dll: ctypes.CDLL, x, threads: int) -> tuple[float, torch.Tensor]:
    q, k, v, lo, hi = x
    B, H, R, D = q.shape
    N = k.shape[2]
    out = torch.empty_like(q)
    fn = dll.vc_attend_bf16 if k.dtype == torch.bfloat16 else dll.vc_attend_f32
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        if fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), H * N * D, N * D, D, lo.data_ptr(),
              hi.data_ptr(), out.data_ptr(), B, H, R, D, 0.125, threads) != 0:
            raise RuntimeError("the kernel failed")
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="a git ref")
    ap.add_argument("--march", default=None, help="build for this -march instead of native")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", default="1,2")
    a = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    before = subprocess.run(["git", "show", f"{a.baseline}:vericache/model/kernels/attend.c"],
                            cwd=root, capture_output=True, text=True, check=True).stdout
    after = (root / "vericache/model/kernels/attend.c").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(before, Path(tmp), "before", a.march), build(after, Path(tmp), "after", a.march)]
        print(f"baseline {a.baseline} / this checkout, one layer's call "
              f"({a.march or 'native'} build; median and range of {a.reps} alternated rounds)")
        for name, (B, T, N, bf) in SHAPES.items():
            x = inputs(B, T, N, bf)
            for threads in map(int, a.threads.split(",")):
                ratios, outs = [], None
                for _ in range(a.reps):
                    (t0, o0), (t1, o1) = call(libs[0], x, threads), call(libs[1], x, threads)
                    ratios.append(t0 / t1)
                    outs = (o0, o1)
                if not torch.equal(*outs):
                    raise SystemExit(f"{name}: the two builds' outputs differ")
                ratios.sort()
                print(f"  {name:22s} {threads} thread(s): {ratios[len(ratios) // 2]:.3f} "
                      f"({ratios[0]:.3f}-{ratios[-1]:.3f}), last {t1 * 1e3:.3f} ms, same bits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
