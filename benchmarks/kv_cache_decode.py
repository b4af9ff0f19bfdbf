"""CPU benchmark of decoding with a KV cache against recomputing the whole prefix: claim C11, the speed half.

Protocol (one run; both loops measured in the same process, on the same prompt and model):

* model: the book's trained tiny GPT (``pretrained_tiny()``, float32, 4 layers, d = 128), greedy decoding;
* providers: ``cached`` (``llmbook.lm.kv_cache.generate_cached``: one prefill of the prompt, then one
  token per step through ``forward_cached``, reading earlier keys and values from a preallocated
  ``KVCache``) and ``recompute`` (every step runs the full forward pass over the prompt and all tokens
  generated so far and keeps the last logits; no cropping, so both see the same context);
* both loops must produce identical tokens (checked; the script fails otherwise);
* time: the median of ``--repeats`` whole decoding runs after one warm-up run, ``time.perf_counter``;
  per token = run time / new tokens; threads fixed (``--threads``, default 1);
* memory: the peak of live tensor bytes during one run (``llmbook.lm.flash.peak_tensor_bytes``:
  PyTorch's dispatcher accounting, exact and machine-independent), which includes the cache itself.

Results go to ``benchmarks/results/kv_cache_decode.json`` and ``kv_cache_decode.png`` with the machine and
the date. The ratio ``recompute / cached`` per token is the number to read; absolute times drift.

Usage::

    python benchmarks/kv_cache_decode.py            # new tokens in {64, 128, 256, 512}, about a minute on one core
    python benchmarks/kv_cache_decode.py --quick    # {16, 32}, checks the script itself
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing llmbook
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _common import machine, median_time, save  # noqa: E402  (this folder is on sys.path)

from llmbook.lm.flash import peak_tensor_bytes  # noqa: E402
from llmbook.lm.kv_cache import generate_cached  # noqa: E402
from llmbook.lm.training import pretrained_tiny  # noqa: E402

PROVIDERS = ("cached", "recompute")


@torch.no_grad()
def recompute(model, ids, n_new: int):
    """Greedy decoding without a cache: the whole prefix goes through the model at every step."""
    for _ in range(n_new):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def make_call(provider: str, model, ids, n_new: int):
    if provider == "cached":
        return lambda: generate_cached(model, ids, n_new, tau=0)
    if provider == "recompute":
        return lambda: recompute(model, ids, n_new)
    raise ValueError(provider)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmbook.plotting import apply_style

    apply_style()
    rows = result["rows"]
    Ns = [r["n_new"] for r in rows]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(10, 3.6))
    for p, marker in zip(PROVIDERS, "os", strict=True):
        ax_t.loglog(Ns, [r[p]["ms_per_token"] for r in rows], marker=marker, label=p)
    ax_r.semilogx(Ns, [r["ratios"]["time_recompute_over_cached"] for r in rows], marker="o")
    ax_t.set(xlabel="new tokens", ylabel="time per token (ms)", title="greedy decoding, tiny GPT, fp32")
    ax_r.set(xlabel="new tokens", ylabel="recompute / cached", title="time per token, ratio")
    for ax in (ax_t, ax_r):
        ax.set_xticks(Ns, [str(n) for n in Ns])
        ax.minorticks_off()
    ax_t.legend()
    m = result["machine"]
    fig.suptitle(f"prompt {result['config']['prompt_tokens']} tokens, {m['threads']} thread(s), {m['processor']}, "
                 f"torch {m['torch']}, {result['date']}", fontsize=8)
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", type=int, nargs="+", default=[64, 128, 256, 512], help="new tokens per run")
    ap.add_argument("--prompt", default="The key and the value of every token ")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="new tokens in {16, 32}; results in a temporary folder")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    if args.quick:
        import tempfile

        args.new, args.repeats, args.out = [16, 32], 1, Path(tempfile.mkdtemp())
    torch.set_num_threads(args.threads)
    model, tok = pretrained_tiny()
    ids = torch.as_tensor(tok.encode(args.prompt), dtype=torch.long)[None]
    print(f"tiny GPT ({model.num_parameters()} parameters, fp32), prompt {ids.shape[1]} tokens, greedy, "
          f"{args.threads} thread(s)")
    print(f"{'new':>5} | {'ms/token cached':>15} {'recompute':>10} | {'recompute/cached':>16} | "
          f"{'peak MiB cached':>15} {'recompute':>10}")
    rows = []
    for n_new in args.new:
        outs = {p: make_call(p, model, ids, n_new)() for p in PROVIDERS}
        if not torch.equal(outs["cached"], outs["recompute"]):
            raise SystemExit(f"cached and recomputed decoding disagree at {n_new} new tokens")
        row = {"n_new": n_new}
        for p in PROVIDERS:
            fn = make_call(p, model, ids, n_new)
            t = median_time(fn, args.repeats)[0]
            row[p] = {"time_s": t, "ms_per_token": 1e3 * t / n_new, "tensor_peak_bytes": peak_tensor_bytes(fn)[1]}
        c, r = row["cached"], row["recompute"]
        row["ratios"] = {"time_recompute_over_cached": r["time_s"] / c["time_s"],
                         "tensor_bytes_recompute_over_cached": r["tensor_peak_bytes"] / c["tensor_peak_bytes"]}
        rows.append(row)
        print(f"{n_new:>5} | {c['ms_per_token']:>15.3f} {r['ms_per_token']:>10.3f} | "
              f"{row['ratios']['time_recompute_over_cached']:>16.2f} | {c['tensor_peak_bytes'] / 2**20:>15.2f} "
              f"{r['tensor_peak_bytes'] / 2**20:>10.2f}")
    result = {
        "benchmark": "kv_cache_decode",
        "date": dt.date.today().isoformat(),
        "machine": machine(threads=args.threads, torch=torch.__version__),
        "config": {"model": "pretrained_tiny", "dtype": "float32", "prompt_tokens": int(ids.shape[1]),
                   "decoding": "greedy", "repeats": args.repeats, "time": "median of perf_counter over whole runs",
                   "tensor_peak_bytes": "peak live tensor bytes, PyTorch dispatcher accounting (peak_tensor_bytes)",
                   "same_tokens": True},
        "rows": rows,
    }
    save(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
