"""The book's ZeRO-3 (FSDP-style sharding) on gloo with 2 processes.

Oracles: single-process training on the full batch (same model, data and AdamW), and byte counts from the
parameter count. Everything is float64, so the weights agree to 1e-12.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmbook.lm.data_parallel import launch
from llmbook.lm.fsdp import FullyShardedDataParallel
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.optim import AdamW

STEPS, B = 3, 8


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 33), nn.GELU(), nn.Linear(33, 4)).double()


def _gpt(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=11, d_model=8, n_layers=2, n_heads=2, d_ff=16)).double()


def _batch(kind: str, t: int, rank: int = 0, world_size: int = 1):
    g = torch.Generator().manual_seed(100 + t)
    if kind == "mlp":
        x, y = torch.randn(B, 16, generator=g, dtype=torch.float64), torch.randn(B, 4, generator=g, dtype=torch.float64)
    else:
        x, y = torch.randint(0, 11, (B, 8), generator=g), torch.randint(0, 11, (B, 8), generator=g)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def _loss(kind: str, model, x, y):
    if kind == "mlp":
        return ((model(x) - y) ** 2).mean()
    logits = model(x)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _make(kind: str, seed: int):
    return _mlp(seed) if kind == "mlp" else _gpt(seed)


def _single(kind: str) -> dict:
    model = _make(kind, 0)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for t in range(STEPS):
        opt.zero_grad()
        _loss(kind, model, *_batch(kind, t)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fsdp_worker(kind: str) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = _make(kind, seed=rank)  # rank 1 starts elsewhere: the broadcast must fix it
    units = [module[0], module[2], module[4]] if kind == "mlp" else list(module.blocks)
    full_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    model = FullyShardedDataParallel(module, units=units)
    opt = AdamW(model.shards, lr=1e-2, weight_decay=0.1)
    held_between_steps = []
    for t in range(STEPS):
        opt.zero_grad()
        _loss(kind, model, *_batch(kind, t, rank, world_size)).backward()
        opt.step()
        held_between_steps.append(model.resident_bytes)
    counts = {"gathered": model.gathered_bytes, "scattered": model.scattered_bytes,
              "peak": model.peak_resident_bytes, "held": held_between_steps, "full_bytes": full_bytes,
              "shard_bytes": sum(s.numel() * s.element_size() for s in model.shards),
              "padded_bytes": sum(s.numel() * s.element_size() for s in model.shards) * world_size}
    return {"params": model.full_state_dict(), **counts}


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_zero3_equals_single_process_training(kind):
    ranks = launch(_fsdp_worker, 2, kind)
    single = _single(kind)
    for r in ranks:
        for k, v in single.items():
            torch.testing.assert_close(r["params"][k], v, rtol=0, atol=1e-12)
        padded = r["padded_bytes"]
        assert r["full_bytes"] <= padded < r["full_bytes"] + 2 * 8 * 20  # at most one pad per tensor and rank
        assert r["shard_bytes"] * 2 == padded  # each rank stores half of every (padded) parameter
        assert r["gathered"] == STEPS * 2 * padded  # every weight gathered in forward and again in backward
        assert r["scattered"] == STEPS * padded  # every gradient reduce-scattered once
        assert r["held"] == [0] * STEPS  # between steps no rank holds a full weight
    if kind == "mlp":  # three units: never all of the model's weights at once
        assert all(r["peak"] < r["full_bytes"] for r in ranks)


def _misuse_worker() -> list[str]:
    out = []
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).double()
    for units in ([m], [nn.Linear(2, 2)], [m[0], m[0]]):
        try:
            FullyShardedDataParallel(m, units=units)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def test_errors_are_clear():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        FullyShardedDataParallel(nn.Linear(2, 2))
    msgs = launch(_misuse_worker, 2)[0]
    assert msgs[0].startswith("units must be submodules") and msgs[1].startswith("units must be submodules")
    assert "is in two units" in msgs[2]
