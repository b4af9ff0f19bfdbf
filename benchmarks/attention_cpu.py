"""CPU benchmark of tiled (FlashAttention-style) attention in pure PyTorch: claim C12, CPU half.

Protocol (one run; every baseline measured in the same process, on the same inputs):

* shapes ``(B, H, T, D)`` with ``B * H = 8``, ``D = 64``, causal, float32; ``T`` in 512, 1024, 2048, 4096;
* providers: ``naive`` (``llmbook.lm.flash.naive_attention``: the full ``T x T`` score matrix), ``tiled``
  (``llmbook.lm.flash.tiled_attention_forward`` with the block sizes printed below) and ``sdpa``
  (``torch.nn.functional.scaled_dot_product_attention``, PyTorch's own fused CPU kernel);
* time: the median of ``--repeats`` calls after one warm-up call each, ``time.perf_counter``, with the
  providers interleaved (naive, tiled, sdpa, naive, tiled, ...) so that a load spike on a shared machine
  hits all of them alike; the number of threads is fixed (``--threads``, default 1: a shared machine's
  spare cores make multi-threaded timings of many small operators erratic);
* what bounds the tiled forward at ``T = 4096`` (``bound`` in the JSON): the time of its two batched
  matmuls alone (the same tiles, the same loop, no softmax: ``tiled_matmuls_only``), interleaved with
  ``tiled`` and ``sdpa``, and the number of tiles and of score entries it computes;
* memory, two measures:
  - ``tensor_peak_bytes``: the peak of live tensor bytes allocated during one call, counted by PyTorch's
    dispatcher (``llmbook.lm.flash.peak_tensor_bytes``). Exact and machine-independent, but blind to
    scratch memory inside a fused kernel, so it is not reported for ``sdpa``;
  - ``rss_peak_bytes``: the growth of the process's peak resident set size during one call (Linux:
    ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS`` before the call;
    elsewhere ``resource.getrusage(RUSAGE_SELF).ru_maxrss``), in a fresh subprocess per provider and
    ``T`` after a warm-up at ``T = 64``. It sees everything, kernel scratch included, with the output
    tensor and allocator noise of a few MiB. ``tracemalloc`` is not used: tensor memory bypasses
    Python's allocator and tracemalloc would report almost nothing.

Results go to ``benchmarks/results/attention_cpu.json`` and ``attention_cpu.png`` with the machine and
the date. Targets (T = 4096): tiled forward time at most 0.5x naive, tiled memory a small fraction of naive;
tiled time at most 1.2x SDPA (issue 26; recorded as met or not, with the bound above).

Usage::

    python benchmarks/attention_cpu.py            # about 2 minutes on one core
    python benchmarks/attention_cpu.py --quick    # T in {256, 512}, checks the script itself
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing llmbook
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import machine, save  # noqa: E402  (this folder is on sys.path)

from llmbook.lm.flash import naive_attention, peak_tensor_bytes, tiled_attention_forward  # noqa: E402

PROVIDERS = ("naive", "tiled", "sdpa")
TARGET_T, TARGET_TIME_RATIO, TARGET_SDPA_RATIO = 4096, 0.5, 1.2


def interleaved_median_times(fns: dict, repeats: int) -> dict:
    """Median wall time of each callable over ``repeats`` rounds that call them in turn (one warm-up each)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def tiled_matmuls_only(q, k, v, block_q: int, block_k: int) -> int:
    """The causal tiled forward's two matmuls per tile (``S = Q_i K_j^T``, ``P V_j``) and nothing else.

    Same tiles and loop as :func:`llmbook.lm.flash.tiled_attention_forward` (``T_q = T_k``): its time is
    what the tiled forward would cost with a free softmax. Returns the number of tiles visited.
    """
    BH, T, D = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
    q3, k3_t, v3 = q.reshape(BH, T, D), k.reshape(BH, T, D).transpose(-1, -2), v.reshape(BH, T, -1)
    tiles = 0
    for qs in range(0, T, block_q):
        qe = min(qs + block_q, T)
        o_i = torch.zeros(BH, qe - qs, v3.shape[-1])
        for ks in range(0, qe, block_k):
            ke = min(ks + block_k, qe)
            o_i.baddbmm_(q3[:, qs:qe] @ k3_t[:, :, ks:ke], v3[:, ks:ke])
            tiles += 1
    return tiles


def score_entries(T: int, BH: int, block_q: int, block_k: int) -> int:
    """Entries of all score tiles the causal tiled forward computes (diagonal tiles in full)."""
    return BH * sum((min(qs + block_q, T) - qs) * min(qs + block_q, T) for qs in range(0, T, block_q))


def make_call(provider: str, q, k, v, block_q: int, block_k: int):
    if provider == "naive":
        return lambda: naive_attention(q, k, v, causal=True)
    if provider == "tiled":
        return lambda: tiled_attention_forward(q, k, v, causal=True, block_q=block_q, block_k=block_k)
    if provider == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    raise ValueError(provider)


def inputs(B: int, H: int, T: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g) for _ in range(3))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_child(provider: str, B: int, H: int, T: int, D: int, block_q: int, block_k: int, threads: int) -> None:
    """Subprocess body: print the growth of peak RSS (bytes) during one call.

    On Linux the high-water mark is reset first (``/proc/self/clear_refs``), so the peak of the call is
    measured even when importing torch peaked higher; elsewhere ``ru_maxrss`` is used as it is.
    """
    torch.set_num_threads(threads)
    make_call(provider, *inputs(B, H, 64, D), block_q, block_k)()  # warm-up: load kernels, small buffers
    q, k, v = inputs(B, H, T, D)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        before, how = _status_kib("VmRSS"), "VmHWM after resetting it"
    except OSError:
        before, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    out = make_call(provider, q, k, v, block_q, block_k)()
    after = _status_kib("VmHWM") if how.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del out
    print(json.dumps({"rss_peak_bytes": (after - before) * 1024, "how": how}))  # KiB on Linux


def rss_peak(provider, B, H, T, D, block_q, block_k, threads) -> int:
    cmd = [sys.executable, __file__, "--rss-child", provider, "--bh", str(B * H), "--D", str(D),
           "--T", str(T), "--block-q", str(block_q), "--block-k", str(block_k), "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_peak_bytes"]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmbook.plotting import apply_style

    apply_style()
    rows = result["rows"]
    Ts = [r["T"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.6))
    for p, marker in zip(PROVIDERS, "osD", strict=True):
        ax_t.loglog(Ts, [r[p]["time_s"] for r in rows], marker=marker, label=p)
        ax_m.loglog(Ts, [r[p]["rss_peak_bytes"] / 2**20 for r in rows], marker=marker, label=f"{p} (peak RSS)")
    for p, marker in (("naive", "o"), ("tiled", "s")):
        ax_m.loglog(Ts, [r[p]["tensor_peak_bytes"] / 2**20 for r in rows], marker=marker, ls=":",
                    label=f"{p} (tensor bytes)")
    ax_t.set(xlabel="sequence length T", ylabel="forward time (s)", title="time, causal fp32")
    ax_m.set(xlabel="sequence length T", ylabel="peak memory of one call (MiB)", title="memory")
    for ax in (ax_t, ax_m):
        ax.set_xticks(Ts, [str(T) for T in Ts])
        ax.minorticks_off()
    ax_t.legend()
    ax_m.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"B*H = {result['config']['BH']}, D = {result['config']['D']}, {m['threads']} thread(s), "
                 f"{m['processor']}, torch {m['torch']}, {result['date']}", fontsize=8)
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--bh", type=int, default=8, help="B * H (B = 1)")
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--block-q", type=int, default=128)
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="T in {256, 512}; results in a temporary folder")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--rss-child", choices=PROVIDERS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    B, H = 1, args.bh
    if args.rss_child:
        rss_child(args.rss_child, B, H, args.T[0], args.D, args.block_q, args.block_k, args.threads)
        return 0
    if args.quick:
        import tempfile

        args.T, args.repeats, args.out = [256, 512], 1, Path(tempfile.mkdtemp())
    torch.set_num_threads(args.threads)
    rows = []
    print(f"causal fp32, B*H = {B * H}, D = {args.D}, tiled blocks {args.block_q} x {args.block_k}, "
          f"{args.threads} thread(s)")
    print(f"{'T':>6} | {'time naive':>10} {'tiled':>8} {'sdpa':>8} | {'tiled/naive':>11} {'tiled/sdpa':>10} | "
          f"{'RSS naive':>10} {'tiled':>9} {'sdpa':>9} | {'tensor naive':>12} {'tiled':>9} | mem tiled/naive")
    for T in args.T:
        q, k, v = inputs(B, H, T, args.D)
        row = {"T": T}
        fns = {p: make_call(p, q, k, v, args.block_q, args.block_k) for p in PROVIDERS}
        times = interleaved_median_times(fns, args.repeats)
        for p, fn in fns.items():
            row[p] = {"time_s": times[p],
                      "rss_peak_bytes": rss_peak(p, B, H, T, args.D, args.block_q, args.block_k, args.threads)}
            if p != "sdpa":
                row[p]["tensor_peak_bytes"] = peak_tensor_bytes(fn)[1]
        n, t, s = row["naive"], row["tiled"], row["sdpa"]
        row["ratios"] = {
            "time_tiled_over_naive": t["time_s"] / n["time_s"],
            "time_tiled_over_sdpa": t["time_s"] / s["time_s"],
            "tensor_bytes_tiled_over_naive": t["tensor_peak_bytes"] / n["tensor_peak_bytes"],
            "rss_tiled_over_naive": t["rss_peak_bytes"] / max(n["rss_peak_bytes"], 1),
        }
        if T == TARGET_T:  # what bounds the tiled forward: its matmuls alone, timed against it and SDPA
            fns = {"tiled": fns["tiled"], "sdpa": fns["sdpa"],
                   "matmuls": lambda q=q, k=k, v=v: tiled_matmuls_only(q, k, v, args.block_q, args.block_k)}
            bt = interleaved_median_times(fns, args.repeats)
            row["bound"] = {
                "tiled_time_s": bt["tiled"], "sdpa_time_s": bt["sdpa"], "matmuls_only_time_s": bt["matmuls"],
                "time_tiled_over_sdpa": bt["tiled"] / bt["sdpa"],
                "time_matmuls_only_over_sdpa": bt["matmuls"] / bt["sdpa"],
                "tiles": sum(len(range(0, min(qs + args.block_q, T), args.block_k))
                             for qs in range(0, T, args.block_q)),
                "score_entries": score_entries(T, B * H, args.block_q, args.block_k),
                "score_entries_causal": B * H * T * (T + 1) // 2,
            }
        rows.append(row)
        mib = 2**20
        print(f"{T:>6} | {n['time_s']:>9.3f}s {t['time_s']:>7.3f}s {s['time_s']:>7.3f}s | "
              f"{row['ratios']['time_tiled_over_naive']:>11.3f} {row['ratios']['time_tiled_over_sdpa']:>10.2f} | "
              f"{n['rss_peak_bytes'] / mib:>7.1f}MiB {t['rss_peak_bytes'] / mib:>6.1f}MiB "
              f"{s['rss_peak_bytes'] / mib:>6.1f}MiB | {n['tensor_peak_bytes'] / mib:>9.1f}MiB "
              f"{t['tensor_peak_bytes'] / mib:>6.1f}MiB | {row['ratios']['tensor_bytes_tiled_over_naive']:.4f}")
    result = {
        "benchmark": "attention_cpu",
        "date": dt.date.today().isoformat(),
        "machine": machine(threads=args.threads, torch=torch.__version__),
        "config": {"BH": B * H, "D": args.D, "causal": True, "dtype": "float32", "block_q": args.block_q,
                   "block_k": args.block_k, "repeats": args.repeats, "time": "median of perf_counter",
                   "tensor_peak_bytes": "peak live tensor bytes, PyTorch dispatcher accounting (peak_tensor_bytes)",
                   "rss_peak_bytes": "peak RSS growth (VmHWM reset by clear_refs) in one call, fresh subprocess"},
        "rows": rows,
    }
    at = next((r for r in rows if r["T"] == TARGET_T), None)
    if at is not None:
        ok = at["ratios"]["time_tiled_over_naive"] <= TARGET_TIME_RATIO
        ok_sdpa = at["ratios"]["time_tiled_over_sdpa"] <= TARGET_SDPA_RATIO
        result["target"] = {"T": TARGET_T, "time_tiled_over_naive_max": TARGET_TIME_RATIO, "met": ok,
                            "time_tiled_over_sdpa_max": TARGET_SDPA_RATIO, "sdpa_met": ok_sdpa}
        print(f"target at T = {TARGET_T}: tiled/naive time {at['ratios']['time_tiled_over_naive']:.3f} "
              f"(<= {TARGET_TIME_RATIO}: {'met' if ok else 'NOT met'}), tensor memory "
              f"{at['ratios']['tensor_bytes_tiled_over_naive']:.4f} of naive; tiled/sdpa time "
              f"{at['ratios']['time_tiled_over_sdpa']:.2f} (<= {TARGET_SDPA_RATIO}: {'met' if ok_sdpa else 'NOT met'})")
        b = at["bound"]
        print(f"bound at T = {TARGET_T} (second interleaved run): tiled {b['tiled_time_s']:.3f}s, its matmuls alone "
              f"{b['matmuls_only_time_s']:.3f}s, sdpa {b['sdpa_time_s']:.3f}s; tiled/sdpa "
              f"{b['time_tiled_over_sdpa']:.2f}, matmuls only/sdpa {b['time_matmuls_only_over_sdpa']:.2f}; "
              f"{b['tiles']} tiles, {b['score_entries'] / b['score_entries_causal']:.3f}x the causal score entries")
    save(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
