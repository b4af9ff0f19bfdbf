"""Chapter 25 (ids 25.01-25.08) against torch.nn.functional, transformers, scikit-learn, brute force and autograd.

Tolerances, stated once:

* scores and losses in float64 against ``torch.nn.functional`` / transformers: ``atol = 1e-12``;
* Plackett-Luce probabilities over all permutations (``itertools.permutations``, N <= 6) sum to 1 within
  ``1e-12`` in float64; ListMLE against ``-log`` of the enumerated PL product: ``1e-12``;
* DCG / NDCG against ``sklearn.metrics.dcg_score`` / ``ndcg_score`` (continuous scores, no ties): ``1e-12``;
  |ΔNDCG| against swapping each pair's scores and re-running ``ndcg_score``: ``1e-12``;
* lambdas against autograd of RankNet's pair loss (``F.binary_cross_entropy_with_logits``) times the
  brute-force |ΔNDCG|: ``1e-12``; per-document lambdas against autograd of ``lambdarank_loss``: ``1e-12``.
"""

import itertools
import math

import numpy as np
import pytest
import sklearn.metrics
import torch
import torch.nn.functional as F

from llmbook.rag import ranking as rk
from tests.try_it import assert_states

NOTEBOOK = "25-learning-to-rank.ipynb"
ATOL = 1e-12


def gen(seed):
    return torch.Generator().manual_seed(seed)


def lists(B, N, seed, grades=4):
    g = gen(seed)
    s = torch.randn(B, N, generator=g, dtype=torch.float64)
    y = torch.randint(0, grades, (B, N), generator=g)
    return s, y


def ragged_mask(B, N, seed):
    lengths = torch.randint(2, N + 1, (B,), generator=gen(seed + 99))
    return torch.arange(N)[None, :] < lengths[:, None]


# ----------------------------------------------------------------------------- 25.01, 25.02


@pytest.mark.equation("25.01", oracle="transformers BertForSequenceClassification(num_labels=1) head; torch.nn.Linear")
def test_cross_encoder_score_matches_bert_head():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     num_labels=1)
    model = BertForSequenceClassification(cfg).double().eval()
    ids = torch.randint(0, 50, (3, 7), generator=gen(1))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        h_cls = model.bert.pooler(out.hidden_states[-1])  # the pooled [CLS] vector the head reads
    w, b = model.classifier.weight[0].detach(), float(model.classifier.bias.detach())
    assert torch.allclose(rk.cross_encoder_score(h_cls, w, b), out.logits[:, 0], atol=ATOL, rtol=0)
    lin = torch.nn.Linear(16, 1).double()
    h = torch.randn(2, 5, 16, generator=gen(2), dtype=torch.float64)
    with torch.no_grad():
        ref = lin(h)[..., 0]
    ours = rk.cross_encoder_score(h, lin.weight[0].detach(), float(lin.bias.detach()))
    assert torch.allclose(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.equation("25.02", oracle="torch.nn.functional.log_softmax over the two tokens and over the vocabulary")
def test_monot5_score_matches_log_softmax():
    z = 3 * torch.randn(4, 6, 32, generator=gen(3), dtype=torch.float64)
    t, f = 7, 11
    ref_two = F.log_softmax(z[..., [f, t]], -1)[..., 1]
    assert torch.allclose(rk.monot5_score(z, t, f), ref_two, atol=ATOL, rtol=0)
    ref_full = F.log_softmax(z, -1)[..., t]
    assert torch.allclose(rk.monot5_score(z, t, f, restrict=False), ref_full, atol=ATOL, rtol=0)
    # restricting = renormalising the full-vocabulary probabilities over {true, false}
    p = z.softmax(-1)
    assert torch.allclose(rk.monot5_score(z, t, f).exp(), p[..., t] / (p[..., t] + p[..., f]), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="two different tokens"):
        rk.monot5_score(z, 3, 3)
    with pytest.raises(ValueError, match="true_id"):
        rk.monot5_score(z, 32, 3)


# ----------------------------------------------------------------------------- 25.03


@pytest.mark.equation("25.03", oracle="torch.nn.functional.binary_cross_entropy / mse_loss")
def test_pointwise_matches_torch():
    s, y = lists(3, 8, 4)
    yb = (y >= 2).double()
    assert torch.allclose(rk.pointwise_loss(s, yb), F.binary_cross_entropy(torch.sigmoid(s), yb), atol=ATOL, rtol=0)
    assert torch.allclose(rk.pointwise_loss(s, y, kind="mse"), F.mse_loss(s, y.double()), atol=ATOL, rtol=0)
    # soft labels, and a padded batch: each list is averaged over its own real candidates
    ys = torch.rand(3, 8, generator=gen(5), dtype=torch.float64)
    mask = ragged_mask(3, 8, 5)
    per = [F.binary_cross_entropy(torch.sigmoid(s[b][mask[b]]), ys[b][mask[b]]) for b in range(3)]
    assert torch.allclose(rk.pointwise_loss(s, ys, mask, reduction="none"), torch.stack(per), atol=ATOL, rtol=0)
    # stable for large logits where sigmoid saturates
    big = torch.tensor([[40.0, -40.0]], dtype=torch.float64)
    assert torch.allclose(rk.pointwise_loss(big, torch.tensor([[0.0, 1.0]]), reduction="sum"), torch.tensor(40.0,
                          dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rk.pointwise_loss(s, y)


# ----------------------------------------------------------------------------- 25.04, 25.05


def brute_pairs(y_row, keep):
    N = len(y_row)
    return [(i, j) for i in range(N) for j in range(N) if keep[i] and keep[j] and y_row[i] > y_row[j]]


@pytest.mark.equation("25.04", oracle="torch.nn.functional.margin_ranking_loss over brute-force pairs")
@pytest.mark.parametrize("margin", [0.0, 0.5, 1.0])
def test_pairwise_hinge_matches_margin_ranking_loss(margin):
    s, y = lists(4, 7, 6)
    mask = ragged_mask(4, 7, 6)
    per = []
    for b in range(4):
        pairs = brute_pairs(y[b].tolist(), mask[b].tolist())
        i, j = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
        per.append(F.margin_ranking_loss(s[b, i], s[b, j], torch.ones(len(pairs), dtype=torch.float64), margin=margin)
                   if pairs else torch.tensor(0.0, dtype=torch.float64))
    ours = rk.pairwise_hinge_loss(s, y, mask, margin=margin, reduction="none")
    assert torch.allclose(ours, torch.stack(per), atol=ATOL, rtol=0)
    # logistic variant = RankNet with sigma = 1 and no ties; a list whose labels all tie has no pair: 0
    assert torch.allclose(rk.pairwise_hinge_loss(s, y, mask, kind="logistic"), rk.ranknet_loss(s, y, mask), atol=ATOL)
    assert rk.pairwise_hinge_loss(s[:1], torch.ones(1, 7)).item() == 0.0


@pytest.mark.equation("25.05", oracle="torch.nn.functional.binary_cross_entropy_with_logits over all pairs "
                                       "by brute force")
@pytest.mark.parametrize("sigma,ties", [(1.0, False), (2.5, False), (1.0, True)])
def test_ranknet_matches_bce_with_logits(sigma, ties):
    s, y = lists(3, 6, 7, grades=3)
    mask = ragged_mask(3, 6, 7)
    per = []
    for b in range(3):
        z, t = [], []
        for i, j in itertools.combinations(range(6), 2):
            if not (mask[b, i] and mask[b, j]) or (y[b, i] == y[b, j] and not ties):
                continue
            z.append(sigma * (s[b, i] - s[b, j]))
            t.append(1.0 if y[b, i] > y[b, j] else 0.0 if y[b, i] < y[b, j] else 0.5)
        per.append(F.binary_cross_entropy_with_logits(torch.stack(z), torch.tensor(t, dtype=torch.float64))
                   if z else torch.tensor(0.0, dtype=torch.float64))  # a list without a pair contributes 0
    ours = rk.ranknet_loss(s, y, mask, sigma=sigma, ties=ties, reduction="none")
    assert torch.allclose(ours, torch.stack(per), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- 25.06, 25.07


def pl_prob_enumerated(s_row, perm):
    """prod_i exp(s_{pi_i}) / sum_{j >= i} exp(s_{pi_j}), in plain Python floats."""
    p, left = 1.0, list(perm)
    for item in perm:
        p *= math.exp(s_row[item]) / sum(math.exp(s_row[j]) for j in left)
        left.remove(item)
    return p


@pytest.mark.equation("25.06", oracle="Plackett-Luce enumerated over itertools.permutations (sums to 1, float64)")
@pytest.mark.parametrize("N", [1, 3, 5, 6])
def test_plackett_luce_sums_to_one_and_listmle_is_its_nll(N):
    s, y = lists(2, N, 8 + N, grades=10)
    perms = torch.tensor(list(itertools.permutations(range(N))))
    for b in range(2):
        logp = rk.plackett_luce_log_prob(s[b].expand(len(perms), N), perms)
        assert abs(logp.exp().sum().item() - 1.0) < 1e-12
        brute = [pl_prob_enumerated(s[b].tolist(), p) for p in perms.tolist()]
        assert np.allclose(logp.exp().numpy(), brute, atol=1e-12, rtol=0)
        label_perm = sorted(range(N), key=lambda i: (-y[b, i].item(), i))  # best first, ties in input order
        nll = -math.log(pl_prob_enumerated(s[b].tolist(), label_perm))
        assert abs(rk.listmle_loss(s[b:b + 1], y[b:b + 1]).item() - nll) < 1e-12


@pytest.mark.equation("25.06", oracle="-log of the Plackett-Luce product (Python floats) over the unpadded prefix")
def test_listmle_mask_and_gradient():
    s, y = lists(4, 6, 9, grades=10)
    mask = ragged_mask(4, 6, 9)
    s = s.clone().requires_grad_(True)
    ours = rk.listmle_loss(s, y, mask, reduction="none")
    for b in range(4):
        n = int(mask[b].sum())
        label_perm = sorted(range(n), key=lambda i: (-y[b, i].item(), i))  # best first, ties in input order
        nll = -math.log(pl_prob_enumerated(s[b, :n].tolist(), label_perm))
        assert abs(ours[b].item() - nll) < 1e-12
    ours.sum().backward()
    assert torch.isfinite(s.grad).all() and (s.grad[~mask] == 0).all()
    # the reversed log-cumsum-exp is stable where a naive exp overflows
    big = torch.tensor([[1000.0, 999.0]], dtype=torch.float64)
    assert abs(rk.listmle_loss(big, torch.tensor([[1, 0]])).item() - math.log1p(math.exp(-1))) < 1e-12


@pytest.mark.equation("25.07", oracle="torch.nn.functional.cross_entropy (probability targets) and kl_div + entropy")
def test_listnet_matches_cross_entropy_and_kl():
    s, y = lists(5, 9, 10)
    y = y.double()
    ref = F.cross_entropy(s, torch.softmax(y, -1))
    assert torch.allclose(rk.listnet_loss(s, y), ref, atol=ATOL, rtol=0)
    P_y = torch.softmax(y, -1)
    kl = F.kl_div(torch.log_softmax(s, -1), P_y, reduction="none").sum(-1)
    H = -(P_y * P_y.log()).sum(-1)
    assert torch.allclose(rk.listnet_loss(s, y, reduction="none"), kl + H, atol=ATOL, rtol=0)
    mask = ragged_mask(5, 9, 10)
    per = [F.cross_entropy(s[b][mask[b]][None], torch.softmax(y[b][mask[b]], -1)[None]) for b in range(5)]
    assert torch.allclose(rk.listnet_loss(s, y, mask, reduction="none"), torch.stack(per), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- 25.08 and its DCG


@pytest.mark.equation("25.08", oracle="sklearn.metrics.dcg_score / ndcg_score")
@pytest.mark.parametrize("k", [None, 1, 3, 5])
def test_private_dcg_matches_sklearn(k):
    s, y = lists(6, 8, 11)
    for gain, y_true in (("linear", y.numpy()), ("exp", 2.0 ** y.numpy() - 1)):
        ref = [sklearn.metrics.dcg_score(y_true[b:b + 1], s[b:b + 1].numpy(), k=k) for b in range(6)]
        assert np.allclose(rk._dcg(s, y, k=k, gain=gain).numpy(), ref, atol=ATOL, rtol=0)
        ref_n = [sklearn.metrics.ndcg_score(y_true[b:b + 1], s[b:b + 1].numpy(), k=k) for b in range(6)]
        assert np.allclose(rk._ndcg(s, y, k=k, gain=gain).numpy(), ref_n, atol=ATOL, rtol=0)


def delta_ndcg_brute(s, y_true, k):
    """|NDCG after swapping the scores of i and j - NDCG before|, with sklearn's ndcg_score."""
    N = len(s)
    base = sklearn.metrics.ndcg_score(y_true[None], s[None], k=k)
    out = np.zeros((N, N))
    for i in range(N):
        for j in range(N):
            t = s.copy()
            t[i], t[j] = t[j], t[i]
            out[i, j] = abs(sklearn.metrics.ndcg_score(y_true[None], t[None], k=k) - base)
    return out


@pytest.mark.equation("25.08", oracle="swap each pair and recompute sklearn.metrics.ndcg_score (brute force); "
                                       "autograd of F.binary_cross_entropy_with_logits times |ΔNDCG|")
@pytest.mark.parametrize("k,gain,sigma", [(None, "exp", 1.0), (3, "exp", 2.0), (5, "linear", 0.5)])
def test_lambdas_are_ranknet_gradient_times_delta_ndcg(k, gain, sigma):
    B, N = 3, 7
    s, y = lists(B, N, 12 + (k or 0))
    dN = rk.delta_ndcg(s, y, k=k, gain=gain)
    lam = rk.lambdarank_lambdas(s, y, sigma=sigma, k=k, gain=gain)
    for b in range(B):
        y_true = y[b].numpy() if gain == "linear" else 2.0 ** y[b].numpy() - 1
        brute = delta_ndcg_brute(s[b].numpy(), y_true, k)
        assert np.allclose(dN[b].numpy(), brute, atol=ATOL, rtol=0)
        for i in range(N):
            for j in range(N):
                if y[b, i] <= y[b, j]:
                    assert lam[b, i, j] == 0
                    continue
                s_i = s[b, i].clone().requires_grad_(True)
                one = torch.tensor(1.0, dtype=torch.float64)
                pair = F.binary_cross_entropy_with_logits(sigma * (s_i - s[b, j]), one)
                (grad,) = torch.autograd.grad(pair, s_i)
                assert abs(lam[b, i, j].item() - grad.item() * brute[i, j]) < ATOL
    # the per-document lambdas are the gradient of the lambda loss
    s_req = s.clone().requires_grad_(True)
    rk.lambdarank_loss(s_req, y, sigma=sigma, k=k, gain=gain, reduction="sum").backward()
    assert torch.allclose(rk.lambda_gradients(s, y, sigma=sigma, k=k, gain=gain), s_req.grad, atol=ATOL, rtol=0)


def test_lambdas_padding_and_no_relevant_item():
    s, y = lists(3, 6, 13)
    mask = ragged_mask(3, 6, 13)
    lam = rk.lambdarank_lambdas(s, y, mask)
    for b in range(3):
        n = int(mask[b].sum())
        assert torch.allclose(lam[b, :n, :n], rk.lambdarank_lambdas(s[b:b + 1, :n], y[b:b + 1, :n])[0], atol=ATOL)
        assert (lam[b, n:] == 0).all() and (lam[b, :, n:] == 0).all()
    assert (rk.lambdarank_lambdas(s, torch.zeros(3, 6)) == 0).all()  # no gain anywhere: no push


# ----------------------------------------------------------------------------- contracts


def test_bad_input_is_rejected_clearly():
    s, y = lists(2, 4, 14)
    with pytest.raises(ValueError, match=r"\(B, N\)"):
        rk.listmle_loss(s[0], y[0])
    with pytest.raises(ValueError, match="same shape"):
        rk.ranknet_loss(s, y[:, :3])
    with pytest.raises(ValueError, match="NaN"):
        rk.listnet_loss(torch.tensor([[0.0, math.nan]]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="empty"):
        rk.pointwise_loss(torch.zeros(0, 3), torch.zeros(0, 3))
    with pytest.raises(TypeError, match="bool tensor"):
        rk.listmle_loss(s, y, mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="sigma"):
        rk.ranknet_loss(s, y, sigma=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        rk.lambdarank_lambdas(s, -y.double())
    with pytest.raises(ValueError, match="overflows"):
        rk.lambdarank_lambdas(s, y.double() * 1e4)
    with pytest.raises(ValueError, match="permutation"):
        rk.plackett_luce_log_prob(s, torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="reduction"):
        rk.listnet_loss(s, y, reduction="avg")


def test_half_precision_is_computed_in_float32():
    s, y = lists(2, 6, 15)
    for fn in (rk.listmle_loss, rk.listnet_loss, rk.ranknet_loss):
        out = fn(s.half(), y)
        assert out.dtype == torch.float16
        assert abs(out.item() - fn(s.half().double(), y).item()) < 2e-3


# ----------------------------------------------------------------------------- the chapter's Try-it numbers


def test_try_it_numbers():
    s3 = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    p_fwd = rk.plackett_luce_log_prob(s3, torch.tensor([[0, 1, 2]])).exp().item()
    p_rev = rk.plackett_luce_log_prob(s3, torch.tensor([[2, 1, 0]])).exp().item()
    assert abs(p_fwd - math.exp(2) / (math.exp(2) + math.e + 1) * math.e / (math.e + 1)) < 1e-12
    assert round(p_fwd / p_rev) == 20
    y = torch.tensor([[3, 3, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0]])
    s = -torch.arange(12.0, dtype=torch.float64)[None]  # scores decreasing down the list: the ideal order
    d, d5 = rk.delta_ndcg(s, y)[0], rk.delta_ndcg(s, y, k=5)[0]
    assert d5[7, 8].item() == 0.0 and round(d[0, 4].item() / d[7, 8].item(), -1) == 250
    loss = rk.listmle_loss(torch.zeros(1, 12, dtype=torch.float64), y).item()
    assert abs(loss - math.lgamma(13)) < 1e-12
    assert_states(NOTEBOOK, [
        f"gives {p_fwd:.4f}", f"probability {p_rev:.4f}", "twenty times",
        f"$|\\Delta NDCG_{{1,5}}| = {d[0, 4].item():.4f}$", f"$|\\Delta NDCG_{{8,9}}| = {d[7, 8].item():.4f}$",
        "about 250 times", f"first becomes {d5[0, 4].item():.4f}", "second is exactly 0",
        f"$\\log 12! = {loss:.4f}$",
    ])
