"""A reward model trained on the book's assistant's own episodes, and best-of-N against it (chapter 41).

Protocol (all seeded; 2 threads; the assistant in float32):

1. ``TRAIN`` "rl"-split prompts, ``G`` episodes each at temperature 1 (``run_agent``), labelled 0/1 by the
   gold verifier ``assistant_tasks.verify``; every accepted-versus-rejected pair of one prompt is a training pair.
2. The reward model is the assistant's frozen trunk, pooled over the episode (``assistant_rm.episode_features``),
   plus a linear head fitted with chapter 10's Bradley-Terry loss (``assistant_rm.fit_reward_head``). The pooling
   and the L2 penalty are chosen by within-prompt AUC on ``DEV`` other "rl" prompts, never on the test prompts.
   A weak reward model with the same settings is fitted on the pairs of the first ``WEAK`` training prompts only.
3. ``TEST`` "heldout"-split prompts (question templates the reward model never saw), ``N_MAX`` episodes each;
   per episode the JSON stores both reward models' scores, the gold reward, the answer, the tool calls and the
   failure mode; the chapter computes best-of-N from them. The head's weights are stored too, with a few
   transcripts, so that the chapter can re-score them.

Usage::

    python benchmarks/assistant_reward_model.py    # about 4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from llmbook.agents import assistant_rm as arm
from llmbook.agents.agent_loop import failure_mode, run_agent
from llmbook.agents.assistant_tasks import make_tasks
from llmbook.lm.assistant import load_assistant

TRAIN, DEV, TEST, WEAK, G, N_MAX = 300, 100, 150, 30, 8, 32
SEEDS = {"train": 4101, "dev": 4103, "test": 4105}  # tasks; sampling uses seed + 1
POOLS, WEIGHT_DECAYS = ("mean", "last"), (1e-3, 1e-2, 1e-1, 1.0)
N_TEXTS = 6  # transcripts stored for re-scoring


def sample(assistant, split: str, n_prompts: int, k: int, log):
    t0 = time.perf_counter()
    tasks = make_tasks(n_prompts, seed=SEEDS[split], split="heldout" if split == "test" else "rl")
    trajs = run_agent(assistant, [t for t in tasks for _ in range(k)], temperature=1.0, seed=SEEDS[split] + 1)
    y = torch.tensor([tr.reward for tr in trajs], dtype=torch.float64).view(n_prompts, k)
    log(f"{split}: {n_prompts} prompts x {k} episodes, success {y.mean():.3f}, "
        f"{time.perf_counter() - t0:.0f} s")
    return tasks, trajs, y


def summary(s, s_weak, y) -> dict:
    """Held-out within-prompt AUC and best-of-N gold success, each ``[mean, low, high]`` (95 % over prompts)."""
    mixed = [p for p in range(len(y)) if 0 < y[p].sum() < y.shape[1]]
    pairs = [float(y[p].sum() * (y.shape[1] - y[p].sum())) for p in mixed]
    out = {}
    for name, sc in (("rm", s), ("weak_rm", s_weak), ("oracle", y)):
        out[name] = {"best_of_n": {N: [round(v, 4) for v in arm.prompt_bootstrap(arm.best_of_n(sc, y, N))]
                                   for N in (1, 2, 4, 8, 16, 32) if N <= y.shape[1]}}
        if name != "oracle":
            auc = [arm.within_prompt_auc(sc[p:p + 1], y[p:p + 1]) for p in mixed]
            out[name]["test_auc"] = [round(v, 4) for v in arm.prompt_bootstrap(auc, pairs)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", flush=True)

    assistant = load_assistant(dtype=torch.float32)
    data = {split: sample(assistant, split, n, k, log)
            for split, n, k in (("train", TRAIN, G), ("dev", DEV, G), ("test", TEST, N_MAX))}
    phi = {(split, pool): arm.episode_features(assistant, data[split][1], pool=pool).double()
           for split in data for pool in POOLS}
    log("features done")
    win, lose = arm.within_prompt_pairs(data["train"][2])
    grid = []
    for pool in POOLS:
        for wd in WEIGHT_DECAYS:
            head = arm.fit_reward_head(phi["train", pool], win, lose, weight_decay=wd)
            dev_auc = arm.within_prompt_auc(head(phi["dev", pool]).view(DEV, G), data["dev"][2])
            train_auc = arm.within_prompt_auc(head(phi["train", pool]).view(TRAIN, G), data["train"][2])
            grid.append({"pool": pool, "weight_decay": wd, "dev_auc": round(dev_auc, 4),
                         "train_auc": round(train_auc, 4)})
            log(f"pool {pool}, weight decay {wd:g}: train AUC {train_auc:.3f}, dev AUC {dev_auc:.3f}")
    best = max(grid, key=lambda g: g["dev_auc"])
    pool, wd = best["pool"], best["weight_decay"]
    head = arm.fit_reward_head(phi["train", pool], win, lose, weight_decay=wd)
    weak_prompts = data["train"][2][:WEAK]
    w_win, w_lose = arm.within_prompt_pairs(weak_prompts)
    weak = arm.fit_reward_head(phi["train", pool][:WEAK * G], w_win, w_lose, weight_decay=wd)
    tasks, trajs, y = data["test"]
    s, s_weak = head(phi["test", pool]), weak(phi["test", pool])
    result = {
        "benchmark": "assistant_reward_model",
        "protocol": {"train_prompts": TRAIN, "dev_prompts": DEV, "test_prompts": TEST, "weak_prompts": WEAK,
                     "G": G, "N_max": N_MAX, "temperature": 1.0, "seeds": SEEDS,
                     "train_split": "rl", "test_split": "heldout", "dtype": "float32"},
        "train_pairs": len(win), "weak_pairs": len(w_win),
        "train_success": round(float(data["train"][2].mean()), 4),
        "grid": grid, "chosen": {"pool": pool, "weight_decay": wd},
        "head": head.to_dict(), "weak_head": weak.to_dict(),
        "test": {"kind": [t.kind for t in tasks],
                 "y": y.tolist(),
                 "score": [[round(v, 6) for v in row] for row in s.view(TEST, N_MAX).tolist()],
                 "score_weak": [[round(v, 6) for v in row] for row in s_weak.view(TEST, N_MAX).tolist()],
                 "answer": [tr.answer for tr in trajs],
                 "calls": [[list(c) for c in tr.calls] for tr in trajs],
                 "failure": [failure_mode(tr) for tr in trajs],
                 "texts": [trajs[i].text() for i in range(N_TEXTS)]},
    }
    result["summary"] = summary(s.view(TEST, N_MAX), s_weak.view(TEST, N_MAX), y)
    result["minutes"] = round((time.perf_counter() - start) / 60, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "assistant_reward_model.json"
    path.write_text(json.dumps(result) + "\n")
    auc, auc_weak = (arm.within_prompt_auc(x.view(TEST, N_MAX), y) for x in (s, s_weak))
    log(f"chosen: pool {pool}, weight decay {wd:g}; test AUC {auc:.3f} (weak {auc_weak:.3f}); wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
