"""GPU benchmark: MoE dispatch as a per-expert loop, a grouped PyTorch GEMM and the Triton kernel.

    python benchmarks/moe_dispatch.py            # all configurations (a few minutes on one GPU)
    python benchmarks/moe_dispatch.py --quick    # two configurations

For every (E, K, N) it draws a random top-K routing over E experts for N tokens of width C,
checks that the three backends of ``llmbook.kernels.moe`` agree with the loop in bfloat16, then
times each with ``triton.testing.do_bench`` (median, after warm-up) and prints the speed-up over the
loop measured in the same run. Results go to ``benchmarks/results/moe_dispatch.json`` and a plot to
``benchmarks/results/moe_dispatch.png``, both naming the GPU, dtype, shapes, versions and date.

On a machine without CUDA it says so and exits with status 0 (it is not a test). ``--dry-run``
exercises the whole script on the CPU with tiny shapes and a wall-clock timer, writing to a
temporary folder: a check of the plumbing, not a measurement (with ``TRITON_INTERPRET=1`` it
includes the Triton kernel, run by the interpreter).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from llmbook.kernels.moe import (
    moe_dispatch_loop,
    moe_dispatch_torch,
    moe_dispatch_triton,
    triton_available,
)
from llmbook.kernels.runtime import interpret_requested

ROOT = Path(__file__).resolve().parent
DTYPE = torch.bfloat16
C, D = 2048, 2048  # token width and expert output width (one expert matrix: C x D)
CONFIGS = [  # (E, K, N)
    (8, 1, 4096), (8, 2, 4096), (8, 2, 16384), (16, 4, 8192), (64, 2, 8192), (64, 8, 4096), (128, 8, 8192),
]
QUICK = [(8, 2, 4096), (64, 8, 4096)]
# a small manual sweep instead of autotuning: (BLOCK_M, BLOCK_N, BLOCK_K)
TRITON_BLOCKS = [(64, 128, 64), (128, 128, 64), (64, 64, 64)]


def make_case(E, K, N, C, D, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(N, C, generator=g).to(device, dtype)
    W = (torch.randn(E, C, D, generator=g) / C**0.5).to(device, dtype)
    logits = torch.randn(N, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(device, dtype)
    return x, W, ids.to(device), w


def gpu_timer():
    import triton.testing

    def bench(fn):
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    return bench


def wall_timer(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(configs, C, D, device, dtype, bench, triton_blocks, check_tol=3e-2):
    rows = []
    for E, K, N in configs:
        x, W, ids, w = make_case(E, K, N, C, D, device, dtype)
        ref = moe_dispatch_loop(x, W, ids, w)
        backends = {"loop": partial(moe_dispatch_loop, x, W, ids, w),
                    "torch_grouped": partial(moe_dispatch_torch, x, W, ids, w)}
        for bm, bn, bk in triton_blocks:
            backends[f"triton_{bm}x{bn}x{bk}"] = partial(moe_dispatch_triton, x, W, ids, w,
                                                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        scale = max(1.0, ref.float().abs().max().item())
        ms, diff = {}, {}
        for name, fn in backends.items():
            d = (fn().float() - ref.float()).abs().max().item()
            if d > check_tol * scale:
                raise AssertionError(f"{name} disagrees with the loop for E={E} K={K} N={N}: max abs diff {d:.3g}")
            diff[name] = d
            ms[name] = bench(fn)
        triton_names = [n for n in ms if n.startswith("triton")]
        best = min(triton_names, key=ms.get) if triton_names else None
        flops = 2 * N * K * C * D
        row = {"E": E, "K": K, "N": N, "C": C, "D": D, "ms": ms, "max_abs_diff_vs_loop": diff,
               "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()},
               "speedup_vs_loop": {n: ms["loop"] / t for n, t in ms.items()}, "best_triton": best}
        rows.append(row)
        speed = row["speedup_vs_loop"]
        line = f"E={E:4d} K={K} N={N:6d}  loop {ms['loop']:8.3f} ms  grouped-torch x{speed['torch_grouped']:5.2f}"
        if best:
            line += f"  triton x{speed[best]:5.2f} ({best[7:]}, {row['tflops'][best]:.0f} TFLOP/s)"
        print(line, flush=True)
    return rows


def plot(rows, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"E={r['E']}\nK={r['K']}\nN={r['N']}" for r in rows]
    grouped = [r["speedup_vs_loop"]["torch_grouped"] for r in rows]
    triton = [r["speedup_vs_loop"][r["best_triton"]] if r["best_triton"] else np.nan for r in rows]
    pos = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 3.6))
    ax.bar(pos - 0.2, grouped, 0.4, label="grouped PyTorch")
    ax.bar(pos + 0.2, triton, 0.4, label="Triton (best of the block sweep)")
    ax.axhline(1.0, color="#888888", lw=1, ls="--", label="per-expert loop = 1")
    ax.set_xticks(pos, labels, fontsize=8)
    ax.set_ylabel("speed-up over the loop")
    ax.set_title(f"MoE dispatch, {meta['dtype']}, C = {meta['C']}, D = {meta['D']}\n"
                 f"{meta['device_name']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two configurations only")
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU run of the plumbing (not a measurement)")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="folder for the JSON and the plot")
    args = parser.parse_args(argv)

    if args.dry_run:
        device, dtype, c, d, bench = "cpu", torch.float32, 64, 64, wall_timer
        configs = [(4, 1, 64), (8, 2, 100)]
        interpret = interpret_requested() and triton_available()
        blocks = [(16, 16, 16)] if interpret else []  # TRITON_INTERPRET=1 adds the kernel, interpreted
        out = Path(tempfile.mkdtemp(prefix="moe_dispatch_dry_"))
        name = "CPU dry run (not a measurement)"
    else:
        if not torch.cuda.is_available():
            print("moe_dispatch benchmark: no CUDA GPU here, nothing to measure (use a GPU machine; "
                  "--dry-run checks the script on the CPU).")
            return 0
        device, dtype, c, d = "cuda", DTYPE, C, D
        if not triton_available():
            print("triton is not installed: timing the loop and grouped PyTorch only (pip install triton)")
        try:
            bench = gpu_timer()
        except ImportError:
            bench = wall_timer
        configs = QUICK if args.quick else CONFIGS
        blocks = TRITON_BLOCKS if triton_available() else []
        out = args.out
        name = torch.cuda.get_device_name()

    meta = {"device_name": name, "dtype": str(dtype).replace("torch.", ""), "C": c, "D": d,
            "torch": torch.__version__, "triton": _triton_version(), "python": platform.python_version(),
            "date": datetime.date.today().isoformat(),
            "timer": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms)" if not args.dry_run else "wall clock",
            "grouped_mm": hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")}
    print(f"MoE dispatch on {name}, {meta['dtype']}, C = {c}, D = {d}")
    rows = run(configs, c, d, device, dtype, bench, blocks)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_dispatch.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    plot(rows, meta, out / "moe_dispatch.png")
    print(f"wrote {out / 'moe_dispatch.json'} and {out / 'moe_dispatch.png'}")
    return 0


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
