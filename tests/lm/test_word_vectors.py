"""Skip-gram (15.05), CBOW (15.06), GloVe (15.07) and fastText subword vectors (15.08) against oracles.

Oracles: float64 closed forms written here with numpy / math (``log(1 + exp(-s))`` by ``np.logaddexp``,
explicit loops over GloVe's pairs), ``torch.nn.functional.logsigmoid`` / ``log_softmax`` /
``cross_entropy``, closed-form gradients against autograd, and gensim 4.4 (``ft_ngram_hashes``,
``compute_ngrams_bytes`` and a trained ``FastText`` model's vectors). Tolerances: 1e-12 in float64,
1e-5 in float32, 1e-6 against gensim's float32 vectors; hashes and n-grams exactly.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmbook.data import corpus
from llmbook.lm import word_vectors as wv


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.equation("15.05", oracle="float64 closed form with np.logaddexp; F.logsigmoid; closed-form gradient")
def test_sgns_loss_matches_closed_form_and_logsigmoid():
    B, k, D = 6, 4, 5
    v_w, v_c, v_n = (torch.randn(*s, generator=_g(i), dtype=torch.float64) * 2 for i, s in
                     enumerate([(B, D), (B, D), (B, k, D)]))
    ours = wv.sgns_loss(v_w, v_c, v_n, reduction="none")
    a, c, n = v_w.numpy(), v_c.numpy(), v_n.numpy()
    s_pos, s_neg = (a * c).sum(-1), np.einsum("bkd,bd->bk", n, a)
    ref = np.logaddexp(0, -s_pos) + np.logaddexp(0, s_neg).sum(-1)  # -log sigma(s) = log(1 + e^{-s})
    np.testing.assert_allclose(ours.numpy(), ref, rtol=0, atol=1e-12)
    torch_ref = -(F.logsigmoid((v_c * v_w).sum(-1)) + F.logsigmoid(-(v_n @ v_w[..., None])[..., 0]).sum(-1))
    torch.testing.assert_close(ours, torch_ref, rtol=0, atol=1e-12)
    assert wv.sgns_loss(v_w, v_c, v_n).item() == pytest.approx(ref.mean(), abs=1e-12)
    # gradient: d/dv_w = -(1 - sigma(s_pos)) v_c + sum_i sigma(s_neg_i) v_n_i
    v = v_w.clone().requires_grad_(True)
    wv.sgns_loss(v, v_c, v_n, reduction="sum").backward()
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    grad = -(1 - sig(s_pos))[:, None] * c + (sig(s_neg)[..., None] * n).sum(1)
    np.testing.assert_allclose(v.grad.numpy(), grad, rtol=0, atol=1e-12)
    # float32, and scores far beyond exp's range stay finite and exact
    torch.testing.assert_close(wv.sgns_loss(v_w.float(), v_c.float(), v_n.float(), "none"), ours.float(),
                               rtol=0, atol=1e-5)
    big = wv.sgns_loss(torch.full((1, 1), 100.0), torch.full((1, 1), -100.0), torch.zeros(1, 0, 1))
    assert big.item() == pytest.approx(1e4)


def test_noise_distribution_and_skipgram_training_loss_falls():
    P = wv.noise_distribution(torch.tensor([1.0, 8.0, 27.0, 0.0], dtype=torch.float64))
    ref = np.array([1.0, 8.0, 27.0, 0.0]) ** 0.75
    np.testing.assert_allclose(P.numpy(), ref / ref.sum(), atol=1e-15)
    text = corpus()[:20_000]
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(ch) for ch in text])
    _, _, losses = wv.train_skipgram(ids, len(chars), D=16, window=2, k=5, steps=100, batch_size=128, lr=0.05,
                                     generator=_g(0))
    assert losses[:10].mean() > 1.2 * losses[-10:].mean()
    assert losses[0].item() == pytest.approx(6 * math.log(2), abs=1e-5)  # W_out = 0 at the start: (1 + k) log 2


@pytest.mark.equation("15.06", oracle="F.log_softmax of the mean context vector times W^T (float64); F.cross_entropy")
def test_cbow_matches_log_softmax_and_cross_entropy():
    B, C, D, V = 5, 4, 6, 11
    v = torch.randn(B, C, D, generator=_g(1), dtype=torch.float64)
    W = torch.randn(V, D, generator=_g(2), dtype=torch.float64)
    y = torch.randint(0, V, (B,), generator=_g(3))
    ours = wv.cbow_log_probs(v, W)
    torch.testing.assert_close(ours, F.log_softmax(v.sum(1) / C @ W.T, -1), rtol=0, atol=1e-12)
    assert wv.cbow_loss(v, W, y).item() == pytest.approx(F.cross_entropy(v.mean(1) @ W.T, y).item(), abs=1e-12)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True], [False, True, False, False],
                         [True, False, True, True], [True, True, True, False]])
    masked = wv.cbow_log_probs(v, W, mask)
    for b in range(B):
        h = v[b, mask[b]].mean(0)  # the mean over the real context words only
        torch.testing.assert_close(masked[b], F.log_softmax(W @ h, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(wv.cbow_log_probs(v.float(), W.float()), ours.float(), rtol=0, atol=1e-5)


def test_fit_matches_torch_adam():
    """wv.fit's Adam against torch.optim.Adam on the same quadratic, 20 steps, float64."""
    target = torch.randn(5, generator=_g(12), dtype=torch.float64)
    ours = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    theirs = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    losses = wv.fit(lambda: ((ours - target) ** 2).sum(), [ours], steps=20, lr=0.1)
    opt = torch.optim.Adam([theirs], lr=0.1)
    for _ in range(20):
        opt.zero_grad()
        ((theirs - target) ** 2).sum().backward()
        opt.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-12)
    assert losses[0] == pytest.approx(float((target ** 2).sum()), abs=1e-12) and losses[-1] < losses[0]


def test_cbow_training_loss_falls():
    text = corpus()[:5000]
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(ch) for ch in text])
    V, D, m = len(chars), 16, 2
    g = _g(4)
    E = (torch.randn(V, D, generator=g) * 0.1).requires_grad_(True)
    W = torch.zeros(V, D, requires_grad=True)
    ctx = torch.stack([ids[m + j: len(ids) - m + j] for j in (-2, -1, 1, 2)], 1)  # (N, 2m)
    tgt = ids[m: len(ids) - m]
    losses = wv.fit(lambda: wv.cbow_loss(E[ctx], W, tgt), [E, W], steps=60, lr=0.05)
    assert losses[0] == pytest.approx(math.log(V), abs=1e-5) and losses[-1] < 0.75 * losses[0]


def _glove_loop(W, Wt, b, bt, X, x_max=100.0, alpha=0.75):
    """J in float64 with explicit loops over the co-occurring pairs."""
    J = []
    for i in range(X.shape[0]):
        for j in range(X.shape[1]):
            x = float(X[i, j])
            if x > 0:
                f = (x / x_max) ** alpha if x < x_max else 1.0
                J.append(f * (float(W[i] @ Wt[j]) + float(b[i]) + float(bt[j]) - math.log(x)) ** 2)
    return J


@pytest.mark.equation("15.07", oracle="float64 loops over co-occurring pairs with math.log; autograd-free closed form")
def test_glove_loss_matches_loops():
    V, D = 7, 3
    W, Wt = (torch.randn(V, D, generator=_g(i), dtype=torch.float64) for i in (5, 6))
    b, bt = (torch.randn(V, generator=_g(i), dtype=torch.float64) for i in (7, 8))
    X = torch.randint(0, 300, (V, V), generator=_g(9)).double() * (torch.rand(V, V, generator=_g(10)) < 0.6)
    terms = _glove_loop(W.numpy(), Wt.numpy(), b.numpy(), bt.numpy(), X.numpy())
    assert wv.glove_loss(W, Wt, b, bt, X).item() == pytest.approx(math.fsum(terms), rel=1e-12)
    assert wv.glove_loss(W, Wt, b, bt, X, reduction="mean").item() == pytest.approx(math.fsum(terms) / len(terms),
                                                                                    rel=1e-12)
    alt = _glove_loop(W.numpy(), Wt.numpy(), b.numpy(), bt.numpy(), X.numpy(), x_max=10.0, alpha=0.5)
    assert wv.glove_loss(W, Wt, b, bt, X, x_max=10.0, alpha=0.5).item() == pytest.approx(math.fsum(alt), rel=1e-12)
    np.testing.assert_allclose(wv.glove_weight(torch.tensor([0.0, 1.0, 50.0, 100.0, 1e4], dtype=torch.float64)),
                               [0.0, 0.01 ** 0.75, 0.5 ** 0.75, 1.0, 1.0], atol=1e-15)
    # gradient w.r.t. b_i: sum_j 2 f(X_ij) err_ij over co-occurring j
    bb = b.clone().requires_grad_(True)
    wv.glove_loss(W, Wt, bb, bt, X).backward()
    err = W @ Wt.T + b[:, None] + bt[None, :] - torch.log(X.clamp_min(1e-300))
    f = torch.where(X < 100, (X / 100) ** 0.75, 1.0) * (X > 0)
    torch.testing.assert_close(bb.grad, (2 * f * err).sum(1), rtol=0, atol=1e-10)


def test_cooccurrence_matrix_and_glove_training_loss_falls():
    ids = torch.tensor([0, 1, 2, 0, 1, 1, 3])
    X = wv.cooccurrence_matrix(ids, 4, window=2)
    ref = np.zeros((4, 4))
    for i in range(len(ids)):
        for j in range(len(ids)):
            if 0 < abs(i - j) <= 2:
                ref[ids[i], ids[j]] += 1 / abs(i - j)
    np.testing.assert_allclose(X.numpy(), ref, atol=1e-15)
    text = corpus()[:20_000]
    chars = sorted(set(text))
    X = wv.cooccurrence_matrix(torch.tensor([chars.index(ch) for ch in text]), len(chars), window=4).float()
    V, g = len(chars), _g(11)
    params = [(torch.randn(V, 8, generator=g) * 0.1).requires_grad_(True) for _ in range(2)]
    params += [torch.zeros(V, requires_grad=True) for _ in range(2)]
    losses = wv.fit(lambda: wv.glove_loss(*params, X, reduction="mean"), params, steps=100, lr=0.05)
    assert losses[-1] < 0.2 * losses[0]


WORDS = ["hello", "where", "naïve", "東京", "a", "", "🙂ok", "internationalisation", "ab"]


@pytest.mark.equation("15.08", oracle="gensim ft_ngram_hashes / compute_ngrams_bytes; gensim FastText vectors")
def test_fasttext_ngrams_and_hashes_match_gensim():
    from gensim.models.fasttext import ft_ngram_hashes
    from gensim.models.fasttext_inner import compute_ngrams_bytes, ft_hash_bytes

    for w in WORDS:
        for n_min, n_max in ((3, 6), (1, 3), (2, 5)):
            assert [g.encode() for g in wv.char_ngrams(w, n_min, n_max)] == compute_ngrams_bytes(w, n_min, n_max)
            for buckets in (2_000_000, 1000, 7):
                assert wv.ngram_buckets(w, n_min, n_max, buckets) == ft_ngram_hashes(w, n_min, n_max, buckets)
        assert wv.fasttext_hash(w) == ft_hash_bytes(w.encode())


def test_subword_vector_matches_a_trained_gensim_model():
    from gensim.models import FastText

    sentences = [line.split() for line in corpus()[:20_000].lower().splitlines() if line.split()]
    model = FastText(sentences, vector_size=8, window=3, min_count=2, epochs=1, bucket=5000, min_n=3, max_n=5,
                     workers=1, seed=0)
    Z = torch.tensor(model.wv.vectors_ngrams)
    for w in ["statementz", "unassignable", "東京"]:  # out of vocabulary: the mean of the n-gram vectors
        assert w not in model.wv.key_to_index
        torch.testing.assert_close(wv.subword_vector(w, Z, 3, 5, reduce="mean"),
                                   torch.tensor(model.wv[w]), rtol=0, atol=1e-6)
    for w in ["the", "statement", "expression"]:  # in the vocabulary: (u_w + sum of n-grams) / (|G_w| + 1)
        u = torch.tensor(model.wv.vectors_vocab[model.wv.key_to_index[w]])
        torch.testing.assert_close(wv.subword_vector(w, Z, 3, 5, word_vector=u, reduce="mean"),
                                   torch.tensor(model.wv[w]), rtol=0, atol=1e-6)
    # the sum is |G_w| times the mean
    v_sum, v_mean = wv.subword_vector("hello", Z, 3, 5), wv.subword_vector("hello", Z, 3, 5, reduce="mean")
    torch.testing.assert_close(v_sum, len(wv.char_ngrams("hello", 3, 5)) * v_mean, rtol=1e-6, atol=1e-6)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="v_n"):
        wv.sgns_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match="v_c"):
        wv.sgns_loss(torch.zeros(2, 3), torch.zeros(3, 3), torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="mask"):
        wv.cbow_log_probs(torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.tensor([[False, False]]))
    with pytest.raises(ValueError, match="non-negative"):
        wv.glove_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2), torch.zeros(2), -torch.ones(2, 2))
    with pytest.raises(ValueError, match="x_max"):
        wv.glove_weight(torch.ones(2), x_max=0.0)
    with pytest.raises(ValueError, match="no n-gram"):
        wv.subword_vector("", torch.zeros(3, 2), 3, 5, reduce="mean")
    with pytest.raises(TypeError, match="word"):
        wv.char_ngrams(3)
