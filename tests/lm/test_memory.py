"""Tests of llmbook.lm.memory (claim C08): byte accounting, measured optimiser state, ZeRO on torch.distributed.

Oracles: the ZeRO paper's published per-device memory (Rajbhandari et al. 2020, Figure 1), the
``nbytes`` of the tensors that ``torch.optim.AdamW`` really allocates, ``torch.optim.AdamW`` stepping
fp32 copies (mixed precision), and single-process training (the sharded run must equal it).
"""

import pytest
import torch

from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.memory import (
    MixedPrecisionAdamW,
    TrainingBytes,
    measure_training_bytes,
    optimizer_state_bytes,
    training_bytes,
    zero_bytes_per_device,
    zero_memory_demo,
)


def _small_model(dtype=torch.float32):
    return TinyGPT(GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=40)).to(dtype)


def _backward(model):
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids).float().logsumexp(-1).mean().backward()


def test_mixed_precision_adam_is_16_bytes_per_parameter_and_70b_needs_1_1_tb():
    tb = training_bytes(1)
    assert (tb.weights, tb.grads, tb.master, tb.optimizer_state, tb.total) == (2, 2, 4, 8, 16)
    assert training_bytes(70e9).total == 1.12e12  # C08: about 1.1 TB
    fp32 = training_bytes(1, weight_bytes=4, grad_bytes=4, master_bytes=0)
    assert fp32.total == 16  # plain fp32 Adam holds the same 16 bytes
    with pytest.raises(ValueError, match="n_params"):
        training_bytes(-1)
    with pytest.raises(ValueError, match="state_bytes"):
        training_bytes(10, state_bytes=-4)


def test_zero_stages_match_the_papers_figure_1():
    # Rajbhandari et al. (2020), Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.88 GB per device
    published = [120.0, 31.4, 16.6, 1.88]
    got = [zero_bytes_per_device(7.5e9, 64, stage).total / 1e9 for stage in range(4)]
    assert got == pytest.approx(published, abs=0.05)
    # stage 3 is 16 Psi / N_d for every N_d; N_d = 1 is plain data parallelism for every stage
    for N_d in (1, 2, 8, 1024):
        assert zero_bytes_per_device(1e9, N_d, 3).total == pytest.approx(16e9 / N_d, rel=1e-12)
        assert zero_bytes_per_device(1e9, 1, N_d % 4).total == 16e9
    with pytest.raises(ValueError, match="stage"):
        zero_bytes_per_device(1e9, 8, 4)
    with pytest.raises(ValueError, match="N_d"):
        zero_bytes_per_device(1e9, 0, 1)


def test_accounting_matches_the_state_torch_adamw_really_allocates():
    model = _small_model()
    Psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # oracle: torch's allocation, not ours
    _backward(model)
    opt.step()
    measured = measure_training_bytes(model.parameters(), opt)
    want = training_bytes(Psi, weight_bytes=4, grad_bytes=4, master_bytes=0)  # fp32 Adam
    assert (measured.weights, measured.grads, measured.master, measured.optimizer_state) == (
        want.weights, want.grads, want.master, want.optimizer_state)
    n_tensors = len(list(model.parameters()))
    assert measured.bookkeeping == 4 * n_tensors  # torch keeps one float32 step counter per tensor
    assert optimizer_state_bytes(opt) == (8 * Psi, 4 * n_tensors)


def test_mixed_precision_adamw_holds_exactly_16_bytes_per_parameter_and_steps_like_torch():
    model = _small_model(torch.bfloat16)
    Psi = sum(p.numel() for p in model.parameters())
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = MixedPrecisionAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        _backward(model)
        for r, p in zip(reference, model.parameters(), strict=True):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    measured = measure_training_bytes(model.parameters(), opt.optimizer, opt.master)
    assert measured == TrainingBytes(2.0 * Psi, 2.0 * Psi, 4.0 * Psi, 8.0 * Psi, 0.0)  # exact: C08
    assert measured.total == training_bytes(Psi).total == 16 * Psi
    for r, w, p in zip(reference, opt.master, model.parameters(), strict=True):
        torch.testing.assert_close(w, r, rtol=1e-6, atol=1e-7)  # fp32 masters step like torch.optim.AdamW
        assert torch.equal(p, w.to(torch.bfloat16))  # the bf16 weights are the masters rounded


@pytest.mark.parametrize("start_method", [None, "spawn"])  # None: fork on Linux (the notebook's); spawn: macOS
def test_zero_on_two_gloo_ranks_equals_single_process_and_halves_the_state(start_method):
    """Starts 2 CPU processes (gloo, 127.0.0.1): DDP + ZeroRedundancyOptimizer with llmbook's AdamW, float64.

    Tolerance 1e-12: the all-reduce averages two half-batch gradients, a different float64 rounding
    order from the single-process mean, over 3 Adam steps.
    """
    single = zero_memory_demo(1, steps=3)
    sharded = zero_memory_demo(2, steps=3, timeout=60, start_method=start_method)
    Psi = single["n_params"]
    assert single["state_bytes"] == [16 * Psi]  # m and v in float64
    assert sum(sharded["owned_params"]) == Psi and sum(sharded["state_bytes"]) == 16 * Psi
    for share in sharded["state_bytes"]:
        assert 0.4 < share / (16 * Psi) < 0.6  # each rank holds about half of the optimiser state
    assert single["params"].keys() == sharded["params"].keys()
    for k, v in single["params"].items():
        torch.testing.assert_close(sharded["params"][k], v, rtol=0, atol=1e-12)
    moved = (single["params"]["embed.weight"] - _demo_init()["embed.weight"]).abs().max()
    assert moved > 1e-3  # the steps did train (the comparison is not between two untouched models)


def _demo_init():
    from llmbook.lm import memory

    return memory._demo_model(0, torch.float64).state_dict()


def test_zero_memory_demo_checks_its_arguments():
    with pytest.raises(ValueError, match="world_size"):
        zero_memory_demo(0)
    with pytest.raises(ValueError, match="divide"):
        zero_memory_demo(3)
    with pytest.raises(ValueError, match="start_method"):
        zero_memory_demo(2, start_method="thread")
