"""Where a runner pass's time goes on a CUDA device: for a random-weight Llama-3-8B shape
(bf16, `gpu_timing.build_runner`), each decode (1 row) and verify (33 rows) pass timed under
each SDPA backend torch offers, then one profiled pass set under torch's own choice: its wall
time, the GPU's busy time, the kernel launches and the top kernels.

    python3 benchmarks/gpu_profile.py                 # on the device (CUDA only)
    python3 benchmarks/gpu_profile.py --points 1x8192 --no-profile

A pass that needs a mask (verify rows) is refused by the flash backend: it is listed as such.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_timing as gt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="1x8192,1x32768,16x8192", help="BATCHxCONTEXT list")
    p.add_argument("--no-profile", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    r = gt.build_runner("llama3-8b", torch.bfloat16, dev)
    g = torch.Generator().manual_seed(0)
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "math": SDPBackend.MATH}
    for point in a.points.split(","):
        B, N = map(int, point.split("x"))
        caches = gt._caches(r, B, N, 40)
        for rows in (1, 33):
            for name, bk in backends.items():
                ctx = sdpa_kernel([bk]) if bk is not None else contextlib.nullcontext()
                try:
                    with ctx:
                        t = gt._timed(lambda: gt._pass(r, caches, rows, g), dev, 5)
                    print(f"B={B} N={N} rows={rows} {name}: {t * 1e3:.2f} ms", flush=True)
                except RuntimeError as e:
                    print(f"B={B} N={N} rows={rows} {name}: refused ({str(e)[:80]})", flush=True)
            if a.no_profile:
                continue
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                for _ in range(3):
                    gt._pass(r, caches, rows, g)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t) / 3
            ev = prof.key_averages()
            busy = sum(e.self_device_time_total for e in ev) / 3 / 1e3
            launches = sum(e.count for e in ev if e.device_type.name == "CUDA") // 3
            print(f"== B={B} N={N} rows={rows}: wall {wall * 1e3:.2f} ms a pass under the "
                  f"profiler, GPU busy {busy:.2f} ms, {launches} kernel launches")
            print(ev.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
        del caches
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
