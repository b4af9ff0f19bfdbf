"""CPU benchmark of approximate nearest-neighbour indexes (chapter 24): recall@10 and queries per second.

Protocol (one run; every index measured in the same process, on the same data, with 2 threads):

* corpora:
  - ``book``: the book's passages as unit-length MiniLM embeddings (``pipeline.book_data().doc_emb``,
    N of a few hundred, D = 384) and its labelled questions (``query_emb``) as queries;
  - ``synthetic``: ``--n`` (default 1M) vectors of D = 64 drawn around 1000 Gaussian cluster centres
    (centres N(0, 1); within-cluster Gaussian noise of variance 1.65 / (j + 1) along coordinate j, an
    effective dimension of about 14), queries drawn the same way. Clustered, with a decaying spectrum,
    because real embeddings are: on i.i.d. Gaussian data every distance concentrates near the same value,
    a query's neighbours are spread over all cells, an IVF index must probe most lists and a graph index
    needs a very wide beam. (A first run with isotropic noise of 0.35 per coordinate, effective
    dimension 64 inside each cluster, gave IVF recall 0.97 at nprobe = 1 but HNSW only 0.76-0.84 at
    ef = 64. The decaying spectrum raised faiss HNSW's recall by 0.03-0.10 and left hnswlib's almost
    where it was: with M = 16 and efConstruction = 40 both graph indexes stay below IVF on these
    well-separated clusters, which favour IVF.) D = 64 keeps the flat matrix at 256 MB and the HNSW
    builds within minutes;
* indexes: exact search (``faiss.IndexFlatL2``, the baseline and the ground truth), IVF-Flat and IVF-PQ
  (faiss, ``nlist`` about sqrt(N), trained on a sample), HNSW (``faiss.IndexHNSWFlat`` and ``hnswlib``,
  M = 16), and, on the book corpus only, the book's own indexes: its numpy HNSW (``llmbook.rag.hnsw.HNSW``),
  its IVF-Flat (``llmbook.rag.ann.IVFIndex`` on centroids from its own Lloyd k-means, the same training sample
  and ``nlist``) and its PQ (``pq_train``, 8-bit codes, exhaustive ADC by ``pq_adc``, then exact re-ranking of
  the top R by ``rerank_exact``);
* recall@10: the fraction of the exact top 10 (flat L2) that an index returns in its top 10;
* time: the median of ``--repeats`` searches of the whole query batch after one warm-up,
  ``time.perf_counter`` (on the book corpus each timed call searches the batch 20 times, as one batch of
  56 queries takes microseconds); the ``llmbook`` HNSW is a Python loop, timed with the rest;
  QPS = queries / time; ratios are against the flat index on the same corpus.
  Build times (training + adding) are one run each.

Results go to ``benchmarks/results/ann.json`` and ``ann.png`` with the machine and date.

Usage::

    python benchmarks/ann.py            # about 12 minutes on 2 busy cores (the 1M-vector HNSW builds dominate)
    python benchmarks/ann.py --quick    # 50k synthetic vectors: checks the script itself
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing llmbook
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from _common import machine, median_time, save  # noqa: E402  (this folder is on sys.path)

THREADS = 2
MARKERS = {"flat": "*", "faiss IVF-Flat": "o", "faiss IVF-PQ": "^", "faiss HNSW": "s", "hnswlib": "D",
           "llmbook HNSW (numpy)": "P", "llmbook IVF-Flat": "h", "llmbook PQ (ADC, exhaustive)": "v",
           "llmbook PQ + exact rerank": "<"}


def recall_at(I: np.ndarray, I0: np.ndarray, k: int = 10) -> float:
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(I.tolist(), I0.tolist(), strict=True)]))


def synthetic(n: int, nq: int, d: int = 64, clusters: int = 1000, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d)).astype(np.float32)
    # within-cluster noise with a decaying spectrum, variance 1.65 / (j + 1) along coordinate j (total 7.8):
    # an effective dimension of about 14, like the PCA spectrum of real sentence embeddings
    scale = np.sqrt(1.65 / np.arange(1, d + 1)).astype(np.float32)
    x = centres[rng.integers(0, clusters, n)] + rng.normal(size=(n, d)).astype(np.float32) * scale
    q = centres[rng.integers(0, clusters, nq)] + rng.normal(size=(nq, d)).astype(np.float32) * scale
    return np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(q, dtype=np.float32)


def run_corpus(name: str, x: np.ndarray, q: np.ndarray, repeats: int, ours: bool, inner: int = 1) -> list[dict]:
    import faiss
    import hnswlib

    n, d = x.shape
    rows = []

    def measure(label, params, build, search):
        t0 = time.perf_counter()
        index = build()
        build_s = time.perf_counter() - t0
        def batch():
            for _ in range(inner):
                out = search(index)
            return out

        t, I = median_time(batch, repeats)
        t /= inner
        row = {"corpus": name, "index": label, "params": params, "build_s": build_s, "search_s": t,
               "qps": len(q) / t, "I": np.asarray(I)}
        rows.append(row)
        return index

    def flat():
        index = faiss.IndexFlatL2(d)
        index.add(x)
        return index

    measure("flat", "exact", flat, lambda ix: ix.search(q, 10)[1])
    I0 = rows[0]["I"]
    nlist = max(4, int(round(np.sqrt(n) / 4) * 4))
    train = x[np.random.default_rng(1).permutation(n)[:min(n, 64 * nlist)]]

    def ivf(pq_m=None):
        quantizer = faiss.IndexFlatL2(d)
        if pq_m is None:
            index = faiss.IndexIVFFlat(quantizer, d, nlist)
        else:
            index = faiss.IndexIVFPQ(quantizer, d, nlist, pq_m, 8)
        index.cp.niter = 10
        index.train(train)
        index.add(x)
        return index

    ivf_index = None
    for nprobe in (1, 4, 16):
        def search(ix, nprobe=nprobe):
            ix.nprobe = nprobe
            return ix.search(q, 10)[1]
        if ivf_index is None:
            ivf_index = measure("faiss IVF-Flat", f"nlist={nlist} nprobe={nprobe}", ivf, search)
        else:
            measure("faiss IVF-Flat", f"nlist={nlist} nprobe={nprobe}", lambda ix=ivf_index: ix, search)
    if n >= 100 * 256:  # PQ needs enough vectors to train 256 centroids per sub-space
        pq_m = d // 4
        measure("faiss IVF-PQ", f"nlist={nlist} M={pq_m} nbits=8 nprobe=16", lambda: ivf(pq_m),
                lambda ix: (setattr(ix, "nprobe", 16), ix.search(q, 10)[1])[1])

    def fhnsw():
        index = faiss.IndexHNSWFlat(d, 16)
        index.hnsw.efConstruction = 40
        index.add(x)
        return index

    fh = None
    for ef in (16, 64):
        def search(ix, ef=ef):
            ix.hnsw.efSearch = ef
            return ix.search(q, 10)[1]
        fh = measure("faiss HNSW", f"M=16 efC=40 ef={ef}", fhnsw if fh is None else (lambda ix=fh: ix), search)

    def hl():
        index = hnswlib.Index(space="l2", dim=d)
        index.init_index(max_elements=n, M=16, ef_construction=40, random_seed=0)
        index.set_num_threads(THREADS)
        index.add_items(x, np.arange(n))
        return index

    hi = None
    for ef in (16, 64):
        def search(ix, ef=ef):
            ix.set_ef(ef)
            return ix.knn_query(q, k=10)[0]
        hi = measure("hnswlib", f"M=16 efC=40 ef={ef}", hl if hi is None else (lambda ix=hi: ix), search)

    if ours:
        import torch

        from llmbook.rag.ann import IVFIndex, pq_adc, pq_encode, pq_train, rerank_exact
        from llmbook.rag.hnsw import HNSW
        from llmbook.rag.kmeans import lloyd

        measure("llmbook HNSW (numpy)", "M=16 efC=40 ef=64",
                lambda: HNSW(torch.from_numpy(x), M=16, ef_construction=40),
                lambda ix: ix.search(torch.from_numpy(q), 10, ef=64)[1].numpy())
        xt, qt = torch.from_numpy(x), torch.from_numpy(q)

        def our_ivf():  # the book's Lloyd k-means on the same training sample, then its IVFIndex
            tt = torch.from_numpy(train)
            start = torch.randperm(len(tt), generator=torch.Generator().manual_seed(0))[:nlist]
            return IVFIndex(xt, lloyd(tt, tt[start], max_iter=10).centroids)

        oi = None
        for nprobe in (1, 4, 16):
            def search(ix, nprobe=nprobe):
                return ix.search(qt, 10, nprobe=nprobe)[1].numpy()
            oi = measure("llmbook IVF-Flat", f"nlist={nlist} nprobe={nprobe}", our_ivf if oi is None else
                         (lambda ix=oi: ix), search)
        pq_m = d // 16  # 24 sub-vectors of 16 dimensions for D = 384: 24 bytes per passage, as in chapter 24

        def our_pq():
            C = pq_train(xt, pq_m, 256, max_iter=10)
            return C, pq_encode(xt, C)

        def pq_search(ix, R=None):
            C, codes = ix
            d_adc = pq_adc(qt, codes, C)
            if R is None:
                return d_adc.topk(10, largest=False).indices.numpy()
            return rerank_exact(qt, xt, d_adc.topk(R, largest=False).indices, 10)[1].numpy()

        pq = measure("llmbook PQ (ADC, exhaustive)", f"M={pq_m} nbits=8", our_pq, pq_search)
        for R in (20, 100):
            measure("llmbook PQ + exact rerank", f"M={pq_m} nbits=8 R={R}", lambda ix=pq: ix,
                    lambda ix, R=R: pq_search(ix, R))
    base = rows[0]["qps"]
    for r in rows:
        r["recall@10"] = recall_at(r.pop("I"), I0)
        r["qps_vs_flat"] = r["qps"] / base
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmbook.plotting import apply_style

    apply_style()
    corpora = list(dict.fromkeys(r["corpus"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(corpora), figsize=(4.2 * len(corpora), 3.6), squeeze=False)
    for ax, c in zip(axes[0], corpora, strict=True):
        for r in (r for r in result["rows"] if r["corpus"] == c):
            ax.scatter(r["recall@10"], r["qps"], marker=MARKERS.get(r["index"], "o"),
                       label=f"{r['index']} {r['params'].split()[-1]}")
        ax.set(xscale="linear", yscale="log", xlabel="recall@10", ylabel="queries / s", title=c)
        ax.legend(fontsize=6)
    m = result["machine"]
    fig.suptitle(f"{m['processor']}, {m['threads']} threads, faiss {m['faiss']}, {result['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="synthetic corpus size")
    ap.add_argument("--nq", type=int, default=500, help="synthetic queries")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="50k synthetic vectors; results in a temporary folder")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    if args.quick:
        import tempfile

        args.n, args.nq, args.repeats, args.out = 50_000, 100, 1, Path(tempfile.mkdtemp())
    import faiss
    import hnswlib  # noqa: F401

    from llmbook.rag import pipeline

    faiss.omp_set_num_threads(THREADS)
    data = pipeline.book_data()
    xb = np.ascontiguousarray(data.doc_emb.numpy(), dtype=np.float32)
    qb = np.ascontiguousarray(data.query_emb.numpy(), dtype=np.float32)
    rows = run_corpus(f"book MiniLM (N={len(xb)}, D={xb.shape[1]})", xb, qb, args.repeats, ours=True, inner=20)
    xs, qs = synthetic(args.n, args.nq)
    rows += run_corpus(f"synthetic clustered (N={args.n:,}, D=64)", xs, qs, args.repeats, ours=False)
    print(f"{'corpus':<36} {'index':<22} {'params':<32} {'recall@10':>9} {'QPS':>10} {'x flat':>8} {'build s':>8}")
    for r in rows:
        print(f"{r['corpus']:<36} {r['index']:<22} {r['params']:<32} {r['recall@10']:>9.3f} {r['qps']:>10.0f} "
              f"{r['qps_vs_flat']:>8.1f} {r['build_s']:>8.2f}")
    result = {"benchmark": "ann", "date": dt.date.today().isoformat(),
              "machine": machine(threads=THREADS, faiss=faiss.__version__, hnswlib="0.8.0"),
              "protocol": {"k": 10, "repeats": args.repeats, "synthetic_n": args.n, "synthetic_nq": args.nq,
                           "synthetic_d": 64, "clusters": 1000,
                           "noise": "within-cluster variance 1.65/(j+1) along coordinate j"},
              "rows": rows}
    save(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
