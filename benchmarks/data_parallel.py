"""CPU benchmark of gradient synchronisation in data-parallel training (chapter 8): gloo, 2 processes.

Protocol (one run; every variant measured in the same processes, on the same model and data):

* model: a TinyGPT of about ``--params`` million float32 parameters (d_model 256, ``--layers`` layers,
  V = 2048), batch ``--batch`` x 128 tokens per rank, one torch thread per process;
* variants, all on the same rank-local batch, timed per training step (forward, backward, synchronisation,
  AdamW step), the median of ``--steps`` steps after two warm-up steps:
  - ``local``: no communication at all (what the step costs on one rank's data: the floor);
  - ``sync per-parameter``: after backward, one blocking all-reduce per gradient (no overlap);
  - ``sync one buffer``: after backward, every gradient flattened into one blocking all-reduce;
  - ``ours per-parameter``: :class:`llmbook.lm.data_parallel.DataParallel` without buckets, each all-reduce
    launched asynchronously from a post-accumulate-grad hook while backward goes on;
  - ``ours buckets 1 MB`` / ``25 MB``: the same with buckets;
  - ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` (25 MB buckets), the reference;
* ratio: each variant's median over ``sync per-parameter``'s, measured in the same run.

Two processes on two cores leave no idle core for gloo's communication threads, so overlap can hide
little here; on one machine with more cores, or across machines, the gap widens. The script says so
beside the numbers.

Usage::

    python benchmarks/data_parallel.py            # about a minute
    python benchmarks/data_parallel.py --quick    # a tiny model, 3 steps: checks the script itself
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import machine, save  # noqa: E402

from llmbook.lm.data_parallel import DataParallel, launch  # noqa: E402
from llmbook.lm.gpt import GPTConfig, TinyGPT  # noqa: E402
from llmbook.lm.optim import AdamW  # noqa: E402
from llmbook.lm.probability import cross_entropy_loss  # noqa: E402

VARIANTS = ["local", "sync per-parameter", "sync one buffer", "ours per-parameter", "ours buckets 1 MB",
            "ours buckets 25 MB", "torch DDP"]


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=2048, d_model=256, n_layers=layers, n_heads=4, d_ff=688, max_seq_len=128))


def _worker(layers: int, batch: int, steps: int) -> dict:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 2048, (batch, 129), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    out = {}
    for name in VARIANTS:
        base = _model(layers)
        if name.startswith("ours"):
            mb = None if name.endswith("per-parameter") else float(name.split()[-2])
            model = DataParallel(base, bucket_size_mb=mb)
        elif name == "torch DDP":
            model = nn.parallel.DistributedDataParallel(base, bucket_cap_mb=25)
        else:
            model = base
        opt = AdamW(model.parameters(), lr=1e-4)
        params = [p for p in base.parameters()]
        times = []
        for t in range(steps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            cross_entropy_loss(model(x), y).backward()
            if name == "sync per-parameter":
                for p in params:
                    dist.all_reduce(p.grad)
                    p.grad.div_(2)
            elif name == "sync one buffer":
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat)
                flat.div_(2)
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            elif name.startswith("ours"):
                model.finish_gradient_synchronization()
            opt.step()
            if t >= 2:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    out["n_params"] = sum(p.numel() for p in _model(layers).parameters())
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = VARIANTS
    ratios = [result["ratio"][n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(names[::-1], ratios[::-1], color="#4C72B0")
    ax.axvline(1.0, color="#999999", ls="--")
    ax.set(xlabel="step time / sync per-parameter step time (lower is faster)",
           title=f"gloo, 2 processes, {result['n_params'] / 1e6:.1f} M float32 parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.batch, args.steps = 1, 1, 3
    ranks = launch(_worker, 2, args.layers, args.batch, args.steps, timeout=1800)
    slowest = {n: max(r[n] for r in ranks) for n in VARIANTS}  # a step ends when the slower rank ends
    base = slowest["sync per-parameter"]
    result = {"benchmark": "data_parallel", "date": dt.date.today().isoformat(), "machine": machine(),
              "n_params": ranks[0]["n_params"], "layers": args.layers, "batch_per_rank": args.batch,
              "steps": args.steps, "seconds": slowest, "ratio": {n: slowest[n] / base for n in VARIANTS}}
    print(f"{result['n_params'] / 1e6:.2f} M parameters, batch {args.batch} x 128 per rank, median of "
          f"{args.steps} steps, gloo with 2 processes on {result['machine']['cpus']} cores")
    for n in VARIANTS:
        print(f"  {n:22s} {slowest[n] * 1e3:8.1f} ms   x{result['ratio'][n]:.2f}")
    print("two processes on two cores: gloo's threads compete with the backward pass, so overlap hides little")
    if not args.quick:
        save(result, args.out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
