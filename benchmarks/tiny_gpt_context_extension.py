"""The book's tiny GPT (RoPE, trained on 64-character windows) read past its context with scaled RoPE (chapter 4).

Protocol (deterministic, CPU, float32, one thread):

* model: ``pretrained_tiny()`` (``llmbook/data/tiny_gpt.pt``): 4 layers, head width D = 32, RoPE base
  10 000, trained only on windows of ``L_train = 64`` characters, never fine-tuned for longer ones;
* text: the held-out 10 % of the book's corpus (``corpus_tokens()``), cut into ``N`` consecutive,
  non-overlapping windows of ``T + 1 = 257`` characters (every one that fits);
* methods: ``none`` (the model as trained), ``pi`` (position interpolation), ``ntk`` (NTK-aware, alpha = s),
  ``dynamic`` (dynamic NTK at the window's length) and ``yarn`` (beta_fast 32, beta_slow 1, attention factor
  0.1 ln s + 1), all at ``s = T / L_train = 4`` (``llmbook.lm.context_extension.scaled_inv_freq``), put into
  the model by ``llmbook.lm.long_context.token_losses``;
* baseline ``window``: the model as trained, but every prediction made from the last ``L_train`` characters
  only (a sliding window, what a reader of a 64-character model can always do); for t < 64 it is ``none``;
* measure: the cross-entropy (nats per character) at every position t = 0..255 (the prediction made
  with t + 1 characters of context), averaged per window over the bands [0, 64), [64, 128), [128, 256);
* uncertainty: each method minus ``none`` and minus ``window``, per band, paired over the windows
  (``llmbook.rag.significance.compare``: 95 % bootstrap interval, sign-flip permutation p, seed 0).

Run: ``python benchmarks/tiny_gpt_context_extension.py`` (about 2 minutes of one core); writes
``benchmarks/results/tiny_gpt_context_extension.json``, which chapter 4 reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from llmbook.lm.long_context import band_means, token_losses
from llmbook.lm.training import corpus_tokens, pretrained_tiny
from llmbook.rag.significance import compare

METHODS = ("none", "pi", "ntk", "dynamic", "yarn")
T = 256
EDGES = (0, 64, 128, 256)


def main(out: Path = Path(__file__).parent / "results") -> dict:
    torch.set_num_threads(1)
    model, _ = pretrained_tiny()
    L_train = model.config.max_seq_len
    factor = T / L_train
    _, _, heldout = corpus_tokens()
    N = len(heldout) // (T + 1)
    ids = torch.as_tensor(heldout[: N * (T + 1)].astype(np.int64)).reshape(N, T + 1)
    per_position, bands = {}, {}
    for method in METHODS:
        losses = token_losses(model, ids, method, factor, L_train)  # (N, T)
        per_position[method] = [round(float(v), 5) for v in losses.mean(0)]
        bands[method] = band_means(losses, EDGES).double().numpy()  # (N, K)
    # sliding window: sub-window starting at u covers ids[u .. u + L_train]; its last loss predicts token
    # u + L_train from the L_train characters before it, i.e. position t = u + L_train - 1 of the window
    sub = ids.unfold(1, L_train + 1, 1)  # (N, T + 1 - L_train, L_train + 1)
    last = torch.cat([token_losses(model, chunk, "none")[:, -1] for chunk in sub.reshape(-1, L_train + 1).split(512)])
    losses_none = token_losses(model, ids, "none")
    window = losses_none.clone()
    assert torch.allclose(last.reshape(N, -1)[:, 0], losses_none[:, L_train - 1], atol=1e-5)  # t = 63: same context
    window[:, L_train - 1:] = last.reshape(N, -1)
    per_position["window"] = [round(float(v), 5) for v in window.mean(0)]
    bands["window"] = band_means(window, EDGES).double().numpy()
    labels = [f"{a}-{b}" for a, b in zip(EDGES, EDGES[1:], strict=False)]
    table = {m: {lab: round(float(bands[m][:, k].mean()), 5) for k, lab in enumerate(labels)} for m in bands}
    paired = {}
    for baseline in ("none", "window"):
        paired[baseline] = {}
        for m in bands:
            if m == baseline:
                continue
            paired[baseline][m] = {}
            for k, lab in enumerate(labels):
                c = compare(bands[m][:, k], bands[baseline][:, k])
                paired[baseline][m][lab] = {"diff": round(c.diff, 5), "low": round(c.low, 5),
                                            "high": round(c.high, 5), "p": round(c.p, 5)}
    result = {
        "benchmark": "tiny_gpt_context_extension",
        "model": "llmbook/data/tiny_gpt.pt", "L_train": L_train, "T": T, "factor": factor,
        "windows": N, "text": "held-out 10 % of the corpus, consecutive non-overlapping windows of T + 1 characters",
        "bands": labels, "band_loss_nats": table,
        "paired_minus_baseline": paired,
        "per_position_loss_nats": per_position,
        "torch": torch.__version__,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tiny_gpt_context_extension.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    res = main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results")
    for m, row in res["band_loss_nats"].items():
        print(f"{m:>8}", "  ".join(f"{lab}: {v:.3f}" for lab, v in row.items()))
    for base, rows in res["paired_minus_baseline"].items():
        for m, row in rows.items():
            print(f"{m:>8} - {base}", "  ".join(f"{lab}: {d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
                                              for lab, d in row.items()))
