"""Adafactor (08.07) against torch.optim.Adafactor and a float64 closed form.

Tolerances: float64 against torch, every parameter and state tensor after every one of 100 steps on a
TinyGPT: ``atol = 1e-12``, ``rtol = 1e-10`` (``F64``; the two differ in the order of operations,
e.g. torch's ``||g||^2 / m`` against our ``mean(g^2)``); the factored estimate against the full
second moment when ``g^2`` has rank one: ``F64``; the state-dict round trip: bit for bit.
"""

from __future__ import annotations

import io

import pytest
import torch

from llmbook.lm.adafactor import Adafactor, adafactor_second_moment
from tests.lm.test_optim import STEPS, _model, _train

F64 = dict(rtol=1e-10, atol=1e-12)


@pytest.mark.equation("08.07", oracle="torch.optim.Adafactor (100 float64 steps on a TinyGPT)")
@pytest.mark.parametrize("kw", [dict(lr=1e-2), dict(lr=0.05, weight_decay=0.1, d=2.0, eps=(1e-20, 1e-3))])
def test_adafactor_matches_torch_for_100_steps(kw):
    m_ours, m_ref = _model(), _model()
    o_ours, o_ref = Adafactor(m_ours.parameters(), **kw), torch.optim.Adafactor(m_ref.parameters(), **kw)
    start = [p.detach().clone() for p in m_ours.parameters()]
    for i in range(STEPS):
        _train(m_ours, o_ours, 1, i)
        _train(m_ref, o_ref, 1, i)
        for a, b in zip(m_ours.parameters(), m_ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, **F64, msg=lambda s, i=i: f"step {i}: {s}")
    for p_o, p_r in zip(o_ours.param_groups[0]["params"], o_ref.param_groups[0]["params"], strict=True):
        s_o, s_r = o_ours.state[p_o], o_ref.state[p_r]
        assert sorted(s_o) == sorted(s_r)  # the same state keys (row_var/col_var or variance, step)
        for k in s_o:
            if k != "step":
                torch.testing.assert_close(s_o[k], s_r[k], **F64)
    moved = max((p - s).abs().max().item() for p, s in zip(m_ours.parameters(), start, strict=True))
    assert moved > 1e-2


@pytest.mark.equation("08.07", oracle="float64 closed form: the full second moment of a rank-one g^2")
def test_factored_estimate_is_exact_for_rank_one_squares_and_equals_torch_state():
    a = torch.rand(5, dtype=torch.float64) + 0.1
    b = torch.rand(7, dtype=torch.float64) + 0.1
    g = torch.outer(a, b) * torch.where(torch.rand(5, 7) > 0.5, 1.0, -1.0).double()  # g^2 = (a^2)(b^2)^T
    r, c, V = adafactor_second_moment(torch.zeros(5, dtype=torch.float64), torch.zeros(7, dtype=torch.float64), g, 0.0)
    torch.testing.assert_close(V, g**2, **F64)
    # a general g: the running factors equal the row / column means of g^2 (float64 closed form)
    g2 = torch.randn(3, 5, 7, dtype=torch.float64)
    r0, c0 = torch.rand(3, 5, dtype=torch.float64), torch.rand(3, 7, dtype=torch.float64)
    r, c, V = adafactor_second_moment(r0, c0, g2, beta2=0.9)
    torch.testing.assert_close(r, 0.9 * r0 + 0.1 * (g2**2).sum(-1) / 7, **F64)
    torch.testing.assert_close(c, 0.9 * c0 + 0.1 * (g2**2).sum(-2) / 5, **F64)
    torch.testing.assert_close(V, r[..., :, None] * c[..., None, :] / r.mean(-1)[..., None, None], **F64)
    # memory: n + m numbers instead of n m
    assert r.shape[-1] + c.shape[-1] == 12 < 35


def test_zero_gradient_gives_zero_estimate_not_nan():
    r, c, V = adafactor_second_moment(torch.zeros(2), torch.zeros(3), torch.zeros(2, 3), beta2=0.5)
    assert torch.equal(V, torch.zeros(2, 3))


def test_state_dict_round_trip():
    m_full = _model()
    o_full = Adafactor(m_full.parameters(), lr=1e-2)
    _train(m_full, o_full, 20)
    m_a = _model()
    o_a = Adafactor(m_a.parameters(), lr=1e-2)
    _train(m_a, o_a, 10)
    buf = io.BytesIO()
    torch.save({"model": m_a.state_dict(), "optim": o_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    m_b = _model(seed=1)
    m_b.load_state_dict(ckpt["model"])
    o_b = Adafactor(m_b.parameters(), lr=1e-2)
    o_b.load_state_dict(ckpt["optim"])
    _train(m_b, o_b, 10, start=10)
    for a, b in zip(m_full.parameters(), m_b.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw, err", [
    (dict(lr=-1.0), ValueError), (dict(beta2_decay=0.5), ValueError), (dict(eps=1e-3), TypeError),
    (dict(eps=(-1.0, 1e-3)), ValueError), (dict(d=0.5), ValueError), (dict(weight_decay=-0.1), ValueError),
])
def test_adafactor_rejects_bad_hyperparameters(kw, err):
    with pytest.raises(err):
        Adafactor([torch.nn.Parameter(torch.zeros(2, 2))], **kw)


def test_second_moment_rejects_bad_input():
    with pytest.raises(ValueError, match="shape"):
        adafactor_second_moment(torch.zeros(3), torch.zeros(3), torch.zeros(2, 3), 0.9)
    with pytest.raises(ValueError, match="non-negative"):
        adafactor_second_moment(-torch.ones(2), torch.zeros(3), torch.zeros(2, 3), 0.9)
    with pytest.raises(ValueError, match=r"\(\.\.\., n, m\)"):
        adafactor_second_moment(torch.zeros(()), torch.zeros(3), torch.zeros(3), 0.9)
    with pytest.raises(ValueError, match="beta2"):
        adafactor_second_moment(torch.zeros(2), torch.zeros(3), torch.zeros(2, 3), 1.5)


def test_try_it_llama2_mlp_matrix_state():
    """Chapter 8, Try it 4: Adam's v for a 4096 x 11008 matrix against Adafactor's r and c."""
    n, m = 4096, 11008
    # the factored state of a small matrix of the same aspect has n + m entries (the shapes carry over)
    r, c, V = adafactor_second_moment(torch.zeros(4), torch.zeros(11), torch.ones(4, 11), 0.0)
    assert r.numel() + c.numel() == 4 + 11 and V.numel() == 4 * 11
    assert (n * m, n + m) == (45_088_768, 15_104) and round(n * m / (n + m)) == 2985
