"""Chapter 6's parameter-matched FFN experiment (llmbook.lm.ffn_experiment): counts against a Counter loop, the
loss against F.cross_entropy over the raw sequence, the additive model without an FFN, and the paired draws."""

from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmbook.lm import ffn_experiment as fx

V = 7


def _sequence(n=400, seed=0):
    return np.random.default_rng(seed).integers(0, V, n).astype("uint8")


def test_context_counts_match_a_counter_loop():
    data = _sequence()
    pairs, counts = fx.context_counts(data, V)
    expected = Counter((int(a), int(b), int(c)) for a, b, c in zip(data[:-2], data[1:-1], data[2:], strict=True))
    got = {(a, b, c): int(counts[p, c]) for p, (a, b) in enumerate(pairs.tolist()) for c in range(V) if counts[p, c]}
    assert got == dict(expected)
    assert counts.dtype == torch.float64 and (counts.sum(1) > 0).all()  # only contexts that occur
    assert [a * V + b for a, b in pairs.tolist()] == sorted(a * V + b for a, b in pairs.tolist())


def test_nats_per_char_equals_cross_entropy_over_the_raw_sequence():
    data = _sequence(seed=1)
    pairs, counts = fx.context_counts(data, V)
    torch.manual_seed(0)
    model = fx.PairModel(V, fx.ffn_factories(4)["SwiGLU FFN, d_ff = 8d/3 = 10"](), e=2).double()
    x = torch.as_tensor(data.astype("int64"))
    logits = model(torch.stack([x[:-2], x[1:-1]], 1))  # one row per position, no grouping
    oracle = F.cross_entropy(logits, x[2:])
    torch.testing.assert_close(fx.nats_per_char(model, pairs, counts), oracle, rtol=0, atol=1e-12)


def test_without_an_ffn_the_logits_are_additive_in_the_two_characters():
    """z(a, b) + z(a', b') = z(a, b') + z(a', b) with no FFN (no interaction); an FFN breaks it."""
    torch.manual_seed(0)
    plain = fx.PairModel(V, None, e=3).double()
    torch.manual_seed(0)
    with_ffn = fx.PairModel(V, fx.ffn_factories(6)["GELU FFN, d_ff = 4d = 24"](), e=3).double()
    quad = torch.tensor([[1, 2], [4, 5], [1, 5], [4, 2]])
    for model, additive in ((plain, True), (with_ffn, False)):
        with torch.no_grad():
            z = model(quad)
        gap = (z[0] + z[1] - z[2] - z[3]).abs().max().item()
        assert (gap < 1e-12) == additive, gap


def test_train_pair_model_pairs_the_draws_and_restores_the_default_dtype():
    """A seed gives every model the same embeddings and head (lr = 0 keeps the initial draw); another seed does not."""
    train = fx.context_counts(_sequence(seed=2), V)
    start = {(name, seed): fx.train_pair_model(V, make, seed=seed, train=train, steps=1, lr=0.0, e=2)[0]
             for name, make in fx.ffn_factories(4).items() for seed in (3, 4)}
    assert torch.get_default_dtype() == torch.float32
    assert all(p.dtype == torch.float64 for m in start.values() for p in m.parameters())
    names = list(fx.ffn_factories(4))
    for part in ("embed", "head"):
        first = getattr(start[(names[0], 3)], part).weight
        assert all(torch.equal(getattr(start[(n, 3)], part).weight, first) for n in names[1:])
        assert not torch.equal(getattr(start[(names[0], 4)], part).weight, first)


def test_train_pair_model_learns_and_rejects_bad_input():
    data = _sequence(seed=4)
    train = fx.context_counts(data, V)
    _, curve = fx.train_pair_model(V, fx.ffn_factories(4)["no FFN"], seed=0, train=train, steps=40, e=2)
    assert curve[-1] < curve[0] - 0.05  # Adam lowers the loss of an untrained model
    with pytest.raises(ValueError, match="steps must be at least 1"):
        fx.train_pair_model(V, lambda: None, seed=0, train=train, steps=0)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, V = 7\)"):
        fx.context_counts(np.array([0, 1, 9]), V)
    with pytest.raises(ValueError, match="at least 3 ids"):
        fx.context_counts(np.array([0, 1]), V)
