"""Distilling the book's tiny GPT into a 1-layer student, against the same student on hard labels (chapter 7).

Protocol: the teacher is the committed tiny GPT (``llmbook/data/tiny_gpt.pt``, 4 layers, held-out loss 1.53
nats per character). The student is a 1-layer TinyGPT of the same width (``d_model = 128``, 4 heads, SwiGLU
344, context 64). Both students train for ``--steps`` steps of ``B = 16`` random windows of 64 characters
of the training split, with ``op.AdamW`` (betas 0.9, 0.95, decay 0.1 on matrices), 10 % linear warm-up and
cosine decay from 3e-3 to 3e-4, and global clipping at 1:

* ``hard``: the next-character cross-entropy only;
* ``distil``: :math:`(1-\\alpha)\\,\\mathrm{CE} + \\alpha\\,T^2 D_{KL}(p_T\\|p_S)` with
  ``llmbook.lm.distillation.distillation_loss`` at temperature ``--tau`` (2) and :math:`\\alpha` ``--alpha``
  (0.5), the teacher's logits computed on the same batch.

Seed ``s`` fixes the student's initialisation; the batches are the same for every run (a generator seeded
with 1), so the teacher's logits are computed once per step and every run is paired. The held-out loss is
the students' cross-entropy against the true next characters over the first 128 non-overlapping windows of
64 characters of the held-out text, recorded per window. One thread.

Usage::

    python benchmarks/distillation.py [--steps 150] [--seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from _common import machine

from llmbook.lm import optim as op
from llmbook.lm import schedules as sc
from llmbook.lm import training as tr
from llmbook.lm.distillation import distillation_loss
from llmbook.lm.gpt import TinyGPT
from llmbook.lm.probability import cross_entropy_loss

STUDENT = dataclasses.replace(tr.TINY_GPT[0], n_layers=1)  # the teacher's configuration, one layer
B, T, N_WINDOWS = 16, 64, 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tau", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    _, train_ids, heldout_ids = tr.corpus_tokens()
    teacher, _ = tr.pretrained_tiny()
    teacher.eval()
    gen = torch.Generator().manual_seed(1)
    batches = []
    with torch.no_grad():
        for _ in range(args.steps):
            x, y = tr.get_batch(train_ids, B, T, gen)
            batches.append((x, y, teacher(x)))
    ids = torch.as_tensor(heldout_ids[:N_WINDOWS * T + 1], dtype=torch.long)
    hx, hy = ids[:-1].reshape(N_WINDOWS, T), ids[1:].reshape(N_WINDOWS, T)
    with torch.no_grad():
        teacher_windows = cross_entropy_loss(teacher(hx), hy, reduction="none").mean(-1)
    runs = []
    for mode in ("hard", "distil"):
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            student = TinyGPT(STUDENT)
            params = list(student.parameters())
            opt = op.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                           lr=3e-3, betas=(0.9, 0.95))
            losses = []
            student.train()
            for t, (x, y, z_T) in enumerate(batches):
                z_S = student(x)
                ce = cross_entropy_loss(z_S, y)
                loss = ce if mode == "hard" else (1 - args.alpha) * ce + args.alpha * distillation_loss(
                    z_S, z_T, tau=args.tau)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                sc.clip_grad_norm_(student.parameters(), 1.0)
                for group in opt.param_groups:
                    group["lr"] = sc.warmup_cosine(t, args.steps // 10, args.steps, 3e-3, 3e-4)
                opt.step()
                losses.append(round(ce.item(), 5))
            student.eval()
            with torch.no_grad():
                per_window = cross_entropy_loss(student(hx), hy, reduction="none").mean(-1)
            runs.append({"mode": mode, "seed": seed, "train_ce": losses,
                         "heldout_windows": [round(v, 6) for v in per_window.tolist()],
                         "heldout_loss": round(float(per_window.mean()), 6)})
            print(f"{mode:6s} seed {seed}: held-out {runs[-1]['heldout_loss']:.4f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    result = {"benchmark": "distillation", "student": dataclasses.asdict(STUDENT),
              "student_params": TinyGPT(STUDENT).num_parameters(),
              "teacher_params": teacher.num_parameters(),
              "settings": {"steps": args.steps, "seeds": args.seeds, "B": B, "T": T, "tau": args.tau,
                           "alpha": args.alpha, "lr": [3e-3, 3e-4], "T_warm": args.steps // 10, "betas": [0.9, 0.95],
                           "weight_decay": 0.1, "max_norm": 1.0,
                           "heldout": f"first {N_WINDOWS} windows of {T} held-out characters"},
              "teacher_heldout_windows": [round(v, 6) for v in teacher_windows.tolist()],
              "runs": runs, "machine": machine(threads=1, torch=torch.__version__),
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t0)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distillation.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'distillation.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
