"""CPU benchmark of byte-level BPE training (chapter 15, claim C03's "training runs in seconds").

Protocol (one run; every baseline measured in the same process, on the same corpus):

* corpus: the book's frozen corpus (``llmbook/data/corpus.txt``), CPython's ``pydoc_data`` topics and
  the running Python's standard-library sources, sorted by path, concatenated up to ``--mb`` MB (its size,
  number of pre-tokens and SHA-256 are printed and stored: the stdlib differs between Python versions);
* providers, all learning byte-level merges over GPT-2 pre-tokens:
  - ``incremental``: ``llmbook.lm.bpe.train_bpe`` (pair counts over unique words, updated per merge), its
    pre-tokens counted by ``--workers`` processes (default: every core, ``pretoken_counts.default_workers``);
  - ``serial``: the same with one process (only at the largest merge count);
  - ``naive``: ``train_bpe(method="naive")``, which recounts every pair of every unique word before
    each merge (only up to ``--naive-max`` merges: it grows linearly in the number of merges);
  - ``hf``: HuggingFace ``tokenizers``' ``BpeTrainer`` (Rust, multi-threaded unless
    ``RAYON_NUM_THREADS`` says otherwise) with the byte-level pre-tokenizer;
* time: the median of ``--repeats`` runs of the whole training (reading the text, pre-tokenising,
  counting, merging), ``time.perf_counter``; ``incremental`` and ``naive`` must learn the same merges
  (checked);
* memory: the peak of Python allocations during one training (``tracemalloc``, a separate untimed run;
  for ``naive`` only at the smallest merge count, as tracemalloc slows its loop several times over);
  HF's allocations happen in Rust and are invisible to tracemalloc, so it has no memory column;
* encoding: the median time to encode the whole corpus with the trained tokenizer, ours against
  ``tokenizers`` loaded with the same merges (``BPETokenizer.to_huggingface``);
* profile, at the largest merge count (a vocabulary of 10,000 by default): the median time of the two stages
  apart, pre-tokenising and counting (``count_pretokens``, one process and ``--workers``) and the merge loop
  run on those counts.

Results go to ``benchmarks/results/bpe_training.json`` and ``bpe_training.png`` with the machine and date.
Targets: the incremental trainer is at least 10x faster than the naive recount at the largest merge count both
run, and at a vocabulary of 10,000 on at least 5 MB it takes at most 5x the time of HF ``tokenizers``.

Usage::

    python benchmarks/bpe_training.py            # about 6 minutes on two idle cores
    python benchmarks/bpe_training.py --quick    # 0.5 MB, 20 / 50 merges: checks the script itself
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import sys
import sysconfig
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing llmbook
    sys.path.insert(0, str(ROOT))

from _common import machine, median_time, save  # noqa: E402  (this folder is on sys.path)

from llmbook.data import corpus  # noqa: E402
from llmbook.lm.bpe import BPETokenizer, _merge_loop, pretokenize, train_bpe  # noqa: E402
from llmbook.lm.pretoken_counts import count_pretokens, default_workers  # noqa: E402

TARGET_RATIO = 10.0
TARGET_HF_RATIO = 5.0


def build_corpus(mb: float) -> str:
    parts = [corpus()]
    try:
        from pydoc_data.topics import topics

        parts += [topics[k] for k in sorted(topics)]
    except ImportError:  # pragma: no cover
        pass
    limit = int(mb * 1_000_000)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(stdlib.glob("*.py")) + sorted(p for p in stdlib.glob("*/**/*.py") if "site-packages" not in p.parts)
    for path in paths:  # the top-level modules first, then the packages
        if sum(map(len, parts)) >= limit:
            break
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "".join(parts)[:limit]


def hf_train(text: str, n_merges: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=256 + n_merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=2)
    tok.train_from_iterator([text], trainer)
    return tok


def hf_from(tok: BPETokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.BPE(*tok.to_huggingface()))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return hf


def profile(text: str, n_merges: int, workers: int, repeats: int) -> dict:
    """Median seconds of each stage: counting pre-tokens (one process, ``workers``) and the merge loop."""
    t1, counts = median_time(lambda: count_pretokens(text, workers=1), repeats, warmup=False)
    tw, _ = median_time(lambda: count_pretokens(text, workers=workers), repeats, warmup=False)

    def merge():
        words = [tuple(p.encode("utf-8", "surrogateescape")) for p in counts]
        return _merge_loop(words, list(counts.values()), n_merges, [bytes([i]) for i in range(256)])
    tm, _ = median_time(merge, repeats, warmup=False)
    return {"count_serial_s": t1, "count_parallel_s": tw, "workers": workers, "merge_s": tm,
            "distinct_pretokens": len(counts)}


def peak_python_bytes(fn) -> int:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmbook.plotting import apply_style

    apply_style()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for p, marker in (("incremental", "o"), ("naive", "s"), ("hf", "D")):
        pts = [(r["merges"], r[p]["time_s"]) for r in rows if p in r]
        label = {"hf": "HF tokenizers (Rust)", "naive": "naive recount",
                 "incremental": f"incremental ({result['config'].get('workers', 1)} processes count)"}[p]
        ax.loglog(*zip(*pts, strict=True), marker=marker, label=label)
    ax.set(xlabel="merges", ylabel="training time (s)",
           title=f"BPE training on {result['corpus']['bytes'] / 1e6:.1f} MB")
    ax.legend()
    m = result["machine"]
    fig.suptitle(f"{m['processor']}, Python {m['python']}, tokenizers {m['tokenizers']}, {result['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=5.5, help="corpus size in millions of characters")
    ap.add_argument("--merges", type=int, nargs="+", default=[30, 100, 300, 1000, 3000, 9744],
                    help="merge counts (9744 merges: a vocabulary of 10,000)")
    ap.add_argument("--workers", type=int, default=default_workers(), help="processes that count pre-tokens")
    ap.add_argument("--naive-max", type=int, default=300, help="largest merge count the naive recount runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="0.5 MB, 20 and 50 merges; results in a temporary folder")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    if args.quick:
        import tempfile

        args.mb, args.merges, args.naive_max, args.repeats, args.out = 0.5, [20, 50], 50, 1, Path(tempfile.mkdtemp())
    import tokenizers

    text = build_corpus(args.mb)
    info = {"bytes": len(text.encode("utf-8")), "chars": len(text), "pretokens": len(pretokenize(text)),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
    print(f"corpus: {info['bytes'] / 1e6:.2f} MB, {info['pretokens']} pre-tokens, sha256 {info['sha256'][:12]}")
    print(f"{'merges':>7} | {'incremental':>11} {'naive':>8} {'HF':>8} | {'naive/incr':>10} {'incr/HF':>8} | "
          f"{'peak incr':>10} {'peak naive':>10} | {'encode ours':>11} {'HF':>7}")
    rows = []
    for n in args.merges:
        row = {"merges": n}
        t, tok = median_time(lambda n=n: train_bpe(text, n, workers=args.workers), args.repeats, warmup=False)
        peak = peak_python_bytes(lambda n=n: train_bpe(text, n, workers=1))  # one process: every allocation seen
        row["incremental"] = {"time_s": t, "workers": args.workers, "peak_python_bytes": peak}
        if n == max(args.merges):
            t, serial = median_time(lambda n=n: train_bpe(text, n, workers=1), args.repeats, warmup=False)
            assert serial.merges == tok.merges, "one process and several learn different merges"
            row["serial"] = {"time_s": t}
            row["profile"] = profile(text, n, args.workers, args.repeats)
        if n <= args.naive_max:
            t, naive = median_time(lambda n=n: train_bpe(text, n, method="naive"), args.repeats, warmup=False)
            assert naive.merges == tok.merges, "the naive and incremental trainers disagree"
            row["naive"] = {"time_s": t}
            if n == min(args.merges):
                row["naive"]["peak_python_bytes"] = peak_python_bytes(lambda n=n: train_bpe(text, n, method="naive"))
        t, _ = median_time(lambda n=n: hf_train(text, n), args.repeats, warmup=False)
        row["hf"] = {"time_s": t}
        hf = hf_from(tok)
        row["encode_s"] = {"ours": median_time(lambda tok=tok: tok.encode(text), 1, warmup=False)[0],
                           "hf": median_time(lambda hf=hf: hf.encode(text), 1, warmup=False)[0]}
        ratio_naive = row["naive"]["time_s"] / row["incremental"]["time_s"] if "naive" in row else None
        row["ratios"] = {"naive_over_incremental": ratio_naive,
                         "incremental_over_hf": row["incremental"]["time_s"] / row["hf"]["time_s"]}
        rows.append(row)
        mib = 2**20
        naive_t = f"{row['naive']['time_s']:>7.2f}s" if "naive" in row else f"{'-':>8}"
        naive_m = (f"{row['naive']['peak_python_bytes'] / mib:>7.1f}MiB" if "peak_python_bytes" in row.get("naive", {})
                   else f"{'-':>10}")
        print(f"{n:>7} | {row['incremental']['time_s']:>10.2f}s {naive_t} {row['hf']['time_s']:>7.2f}s | "
              f"{ratio_naive if ratio_naive else float('nan'):>10.1f} {row['ratios']['incremental_over_hf']:>8.1f} | "
              f"{row['incremental']['peak_python_bytes'] / mib:>7.1f}MiB {naive_m} | "
              f"{row['encode_s']['ours']:>10.2f}s {row['encode_s']['hf']:>6.2f}s")
    last = rows[-1]
    if "profile" in last:
        pr = last["profile"]
        print(f"profile at {last['merges']} merges ({pr['distinct_pretokens']:,} distinct pre-tokens): counting "
              f"{pr['count_serial_s']:.2f}s in one process, {pr['count_parallel_s']:.2f}s in {pr['workers']} "
              f"({pr['count_serial_s'] / pr['count_parallel_s']:.2f}x); merging {pr['merge_s']:.2f}s; whole training "
              f"{last['serial']['time_s']:.2f}s in one process, "
              f"{last['incremental']['time_s']:.2f}s in {pr['workers']}")
    both = [r for r in rows if r["ratios"]["naive_over_incremental"]]
    result = {
        "benchmark": "bpe_training",
        "date": dt.date.today().isoformat(),
        "machine": machine(tokenizers=tokenizers.__version__,
                           rayon_threads=os.environ.get("RAYON_NUM_THREADS", "default")),
        "corpus": info,
        "config": {"repeats": args.repeats, "time": "median of perf_counter over whole trainings",
                   "workers": args.workers,
                   "peak_python_bytes": "tracemalloc peak of one training in one process (Python allocations only)",
                   "naive_max": args.naive_max},
        "rows": rows,
    }
    if both:
        last = both[-1]
        ok = last["ratios"]["naive_over_incremental"] >= TARGET_RATIO
        result["target"] = {"merges": last["merges"], "naive_over_incremental_min": TARGET_RATIO, "met": ok}
        print(f"target at {last['merges']} merges: naive / incremental {last['ratios']['naive_over_incremental']:.1f} "
              f"(>= {TARGET_RATIO:g}: {'met' if ok else 'NOT met'})")
    big = rows[-1]
    if big["merges"] + 256 >= 10_000 and info["bytes"] >= 5_000_000:
        ratio = big["ratios"]["incremental_over_hf"]
        result["target_hf"] = {"merges": big["merges"], "incremental_over_hf_max": TARGET_HF_RATIO,
                               "met": ratio <= TARGET_HF_RATIO}
        print(f"target at a vocabulary of {big['merges'] + 256:,} on {info['bytes'] / 1e6:.1f} MB: incremental / HF "
              f"{ratio:.2f} (<= {TARGET_HF_RATIO:g}: {'met' if ratio <= TARGET_HF_RATIO else 'NOT met'})")
    save(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
