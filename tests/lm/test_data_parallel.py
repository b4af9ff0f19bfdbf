"""The book's DDP wrapper and ZeRO-1 optimiser on gloo with 2 processes.

Oracles: single-process training on the full batch (the same model, data and optimiser), torch's
``DistributedDataParallel`` and ``ZeroRedundancyOptimizer`` run in the same processes on the same data, and
byte counts from the parameter count. Everything is float64, so equality holds to 1e-12 (all-reduce sums two
numbers, in either order the same).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmbook.lm.data_parallel import DataParallel, ShardedOptimizer, launch
from llmbook.lm.memory import optimizer_state_bytes
from llmbook.lm.optim import AdamW

STEPS, B = 3, 8


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)).double()


def _batch(t: int, rank: int = 0, world_size: int = 1):
    g = torch.Generator().manual_seed(100 + t)
    x, y = torch.randn(B, 16, generator=g, dtype=torch.float64), torch.randn(B, 4, generator=g, dtype=torch.float64)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _single_process(opt_class=AdamW) -> dict:
    model = _model(0)
    opt = opt_class(model.parameters(), lr=1e-2)
    for t in range(STEPS):
        opt.zero_grad()
        _loss(model, *_batch(t)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ddp_worker(bucket_size_mb, sharded: bool, to_owner: bool = False) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if to_owner:  # ZeRO-1 with the paper's traffic: each gradient reduced to the rank that steps it
        module = _model(seed=rank)
        opt = ShardedOptimizer(module.parameters(), AdamW, lr=1e-2)
        ours = DataParallel(module, bucket_size_mb=bucket_size_mb, owner=opt.owner_of)
    else:
        ours = DataParallel(_model(seed=rank), bucket_size_mb=bucket_size_mb)  # rank 1 starts elsewhere: broadcast
        opt = ShardedOptimizer(ours.parameters(), AdamW, lr=1e-2) if sharded else AdamW(ours.parameters(), lr=1e-2)
    grads_held = []
    ref_model = _model(0)  # torch's classes on the same data
    ref = nn.parallel.DistributedDataParallel(ref_model)
    if sharded:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ref_opt = ZeroRedundancyOptimizer(ref_model.parameters(), optimizer_class=AdamW, lr=1e-2)
    else:
        ref_opt = AdamW(ref_model.parameters(), lr=1e-2)
    for t in range(STEPS):
        x, y = _batch(t, rank, world_size)
        opt.zero_grad()
        _loss(ours, x, y).backward()
        ours.finish_gradient_synchronization()
        grads_held.append([p.grad is not None for p in ours.parameters()])
        opt.step()
        ref_opt.zero_grad()
        _loss(ref, x, y).backward()
        ref_opt.step()
    out = {"ours": {k: v.detach().clone() for k, v in ours.module.state_dict().items()},
           "torch": {k: v.detach().clone() for k, v in ref_model.state_dict().items()},
           "allreduce_bytes": ours.communicated_bytes, "n_params": sum(p.numel() for p in ours.parameters())}
    out["grads_held"] = grads_held
    if sharded:
        out["owned_mask"] = [any(p is q for q in opt.owned) for p in ours.parameters()]
        out["broadcast_bytes"] = opt.communicated_bytes
        out["state_bytes"] = optimizer_state_bytes(opt.optim)[0] if opt.optim is not None else 0
        out["owned"] = sum(p.numel() for p in opt.owned)
    return out


@pytest.mark.parametrize("bucket_size_mb", [None, 0.004, 25.0], ids=["per-parameter", "small buckets", "one bucket"])
def test_data_parallel_equals_single_process_and_torch_ddp(bucket_size_mb):
    ranks = launch(_ddp_worker, 2, bucket_size_mb, False)
    single = _single_process()
    for r in ranks:
        for k, v in single.items():
            torch.testing.assert_close(r["ours"][k], v, rtol=0, atol=1e-12)
            torch.testing.assert_close(r["torch"][k], v, rtol=0, atol=1e-12)
        # one all-reduce of every gradient entry per step: Psi float64 values
        assert r["allreduce_bytes"] == STEPS * r["n_params"] * 8


@pytest.mark.parametrize("bucket_size_mb, to_owner", [(0.004, False), (None, True), (0.004, True)],
                         ids=["all-reduce", "reduce to owner", "reduce to owner, buckets"])
def test_sharded_optimizer_equals_single_process_and_zero_redundancy_optimizer(bucket_size_mb, to_owner):
    ranks = launch(_ddp_worker, 2, bucket_size_mb, True, to_owner)
    single = _single_process()
    for r in ranks:
        for k, v in single.items():
            torch.testing.assert_close(r["ours"][k], v, rtol=0, atol=1e-12)
            torch.testing.assert_close(r["torch"][k], v, rtol=0, atol=1e-12)
    n = ranks[0]["n_params"]
    assert sum(r["owned"] for r in ranks) == n and all(r["owned"] < n for r in ranks)  # a real split
    for r in ranks:  # Adam's m and v for the owned shard only: 2 x 8 bytes per owned parameter
        assert r["state_bytes"] == 16 * r["owned"]
    assert sum(r["broadcast_bytes"] for r in ranks) == STEPS * n * 8  # each shard sent once per step
    for r in ranks:  # all-reduce or reduce: every gradient value handed over once per step
        assert r["allreduce_bytes"] == STEPS * n * 8
        held = [r["owned_mask"]] * STEPS if to_owner else [[True] * len(r["owned_mask"])] * STEPS
        assert r["grads_held"] == held  # with reduce-to-owner only the owner keeps a (correct) gradient


def _misuse_worker() -> str:
    model = DataParallel(nn.Linear(2, 2).double())
    try:
        ShardedOptimizer([], AdamW, lr=1.0)
    except TypeError as e:
        return str(e) + f" | {model.world_size}"
    return "no error"


def test_errors_are_clear_outside_and_inside_a_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        DataParallel(nn.Linear(2, 2))
    out = launch(_misuse_worker, 2)
    assert out[0].startswith("params must be a non-empty iterable") and out[0].endswith("| 2")
    out = launch(_bad_owner_worker, 2)
    assert out == ["owner(p) must be a rank in 0..1, got 2 for a parameter of shape (2, 2)"] * 2


def _bad_owner_worker() -> str:
    try:
        DataParallel(nn.Linear(2, 2).double(), owner=lambda p: 2)
    except ValueError as e:
        return str(e)
    return "no error"


def _rank_worker() -> int:
    return dist.get_rank()


def _init_that_hangs_once(real, marker: str):
    """``init_process_group`` whose rank 1 hangs for good the first time (a stand-in for a child that inherited a
    held lock); forked children inherit the patch from the test process."""
    import os
    import time

    def init(*args, rank, **kwargs):
        if rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(3600)
        return real(*args, rank=rank, **kwargs)

    return init


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="the patch reaches the children only by fork")
def test_launch_restarts_when_a_rank_never_joins(monkeypatch, tmp_path):
    marker = tmp_path / "hung"
    monkeypatch.setattr(dist, "init_process_group", _init_that_hangs_once(dist.init_process_group, str(marker)))
    assert launch(_rank_worker, 2, join_timeout=2.0, start_method="fork") == [0, 1]
    assert marker.exists()  # the first attempt did hang, and the second one finished
    marker.unlink()
    with pytest.raises(TimeoutError, match="did not join the group within 2.0 s, in 1 attempts"):
        launch(_rank_worker, 2, join_timeout=2.0, retries=0, start_method="fork")
    with pytest.raises(ValueError, match="retries"):
        launch(_rank_worker, 2, retries=-1)
