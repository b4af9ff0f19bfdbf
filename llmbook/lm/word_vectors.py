r"""Static word vectors: skip-gram with negative sampling, CBOW, GloVe and fastText's subword vectors.

Before contextual embeddings, a word was one vector learned from the company it keeps:

* **Skip-gram with negative sampling** (Mikolov et al., 2013): the centre word's vector :math:`v_w`
  should score high against the vector :math:`v_c` of a word seen in its window and low against
  :math:`k` noise words drawn from :math:`P_n(w) \propto U(w)^{3/4}` (:func:`sgns_loss`,
  :func:`noise_distribution`, :func:`train_skipgram`);
* **CBOW**: the mean of the :math:`2m` context vectors predicts the centre word through a softmax
  over the vocabulary (:func:`cbow_log_probs`, :func:`cbow_loss`);
* **GloVe** (Pennington et al., 2014): a weighted least-squares fit of
  :math:`w_i^\top \tilde w_j + b_i + \tilde b_j` to :math:`\log X_{ij}`, the log co-occurrence count
  (:func:`glove_loss`, :func:`glove_weight`, :func:`cooccurrence_matrix`);
* **fastText** (Bojanowski et al., 2017): a word's vector is the sum of the vectors of its character
  n-grams (``"<where>"`` -> ``"<wh"``, ``"whe"``, ...), each hashed into one of a fixed number of
  buckets, so unseen words get vectors too (:func:`char_ngrams`, :func:`fasttext_hash`,
  :func:`subword_vector`).

Shapes: ``B`` examples, ``D`` the vector width, ``V`` the vocabulary, ``k`` negatives, ``2m`` context words.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_positive_int,
    check_range,
    check_shape,
    check_token_ids,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.losses import REDUCTIONS, reduce_loss
from llmbook.lm.probability import log_softmax
from llmbook.registry import implements

__all__ = ["cbow_log_probs", "cbow_loss", "char_ngrams", "cooccurrence_matrix", "fasttext_hash", "fit", "glove_loss",
           "glove_weight", "ngram_buckets", "noise_distribution", "sgns_loss", "subword_vector", "train_skipgram"]


def _float(x, name, contract, ndim):
    x = as_tensor(x, name)
    check_dim(x, name, contract, min_dim=ndim, max_dim=ndim)
    check_finite(x, name)
    return x


@implements("15.05")
def sgns_loss(v_w: Float[Tensor, "B D"], v_c: Float[Tensor, "B D"], v_n: Float[Tensor, "B k D"],
              reduction: str = "mean") -> Tensor:
    r"""Skip-gram with negatives: :math:`L = -\log\sigma(v_c^\top v_w) - \sum_{i=1}^{k}\log\sigma(-v_{n_i}^\top v_w)`.

    ``v_w`` are the centre words' (input) vectors, ``v_c`` the (output) vectors of one context word each,
    ``v_n`` the output vectors of ``k`` negatives drawn from :math:`P_n` (the expectation of the equation is
    estimated by those ``k`` draws). :math:`-\log\sigma(s)` is computed as ``softplus(-s)``, exact for any
    score. Shapes ``(B, D), (B, D), (B, k, D) -> ()`` (``reduction="none"``: ``(B,)``).

    >>> sgns_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3, 2))  # 4 log 2
    tensor(2.7726)
    """
    v_w = _float(v_w, "v_w", "(B, D)", 2)
    v_c = _float(v_c, "v_c", "(B, D)", 2)
    v_n = _float(v_n, "v_n", "(B, k, D)", 3)
    check_shape(v_c, v_w.shape, "v_c", "v_w (B, D)")
    if v_n.shape[0] != v_w.shape[0] or v_n.shape[2] != v_w.shape[1]:
        raise ValueError(f"v_n must have shape (B, k, D) with B, D = {tuple(v_w.shape)} of v_w, got {tuple(v_n.shape)}")
    check_choice(reduction, "reduction", REDUCTIONS)
    dtype = v_w.dtype
    v_w, v_c, v_n = (upcast_half(t) for t in (v_w, v_c, v_n))
    v_c, v_n = v_c.to(v_w.dtype), v_n.to(v_w.dtype)
    s_pos = (v_c * v_w).sum(-1)  # v_c . v_w, (B,)
    s_neg = (v_n * v_w[:, None, :]).sum(-1)  # v_{n_i} . v_w, (B, k)
    loss = F.softplus(-s_pos) + F.softplus(s_neg).sum(-1)
    return restore_half(reduce_loss(loss, None, reduction, "example"), dtype)


def noise_distribution(counts, alpha: float = 0.75) -> Tensor:
    r"""word2vec's noise distribution :math:`P_n(w) = U(w)^\alpha / \sum_{w'} U(w')^\alpha` from counts ``(V,)``.

    :math:`\alpha = 3/4` flattens the unigram distribution: rare words are drawn as negatives more
    often than their frequency says, frequent ones less.

    >>> noise_distribution(torch.tensor([1.0, 16.0]))  # 1 : 8 instead of 1 : 16
    tensor([0.1111, 0.8889])
    """
    U = _float(counts, "counts", "(V,)", 1)
    check_range(alpha, "alpha", 0.0)
    if (U < 0).any() or not (U > 0).any():
        raise ValueError("counts must be non-negative with at least one positive count")
    w = torch.where(U > 0, U.double() ** alpha, 0.0)
    return (w / w.sum()).to(U.dtype)


@implements("15.06")
def cbow_log_probs(v_context: Float[Tensor, "B C D"], W: Float[Tensor, "V D"],
                   mask=None) -> Float[Tensor, "B V"]:
    r"""CBOW: :math:`\log p(w_t \mid \text{ctx}) = \log\mathrm{softmax}\big(W \tfrac{1}{2m}\sum_{j} v_{w_{t+j}}\big)`.

    ``v_context`` holds the ``2m`` context words' input vectors (``C = 2m``), ``W`` the output vectors of
    the ``V`` words. ``mask`` ``(B, 2m)`` (bool, optional) marks the real context words near a text's
    edges; the mean then runs over those. Shapes ``(B, 2m, D), (V, D) -> (B, V)``.

    >>> cbow_log_probs(torch.ones(1, 2, 3), torch.zeros(4, 3)).exp()  # W = 0: uniform over V = 4
    tensor([[0.2500, 0.2500, 0.2500, 0.2500]])
    """
    v = _float(v_context, "v_context", "(B, 2m, D)", 3)
    W = _float(W, "W", "(V, D)", 2)
    if W.shape[1] != v.shape[2]:
        raise ValueError(f"W (V, D) and v_context (B, 2m, D) disagree on D: {W.shape[1]} != {v.shape[2]}")
    if W.shape[0] == 0:
        raise ValueError("W must hold at least one word (V >= 1)")
    dtype = v.dtype
    v, W = upcast_half(v), upcast_half(W).to(upcast_half(v).dtype)
    if mask is None:
        if v.shape[1] == 0:
            raise ValueError("v_context must hold at least one context word (2m >= 1)")
        h = v.mean(1)
    else:
        mask = as_tensor(mask, "mask", floating=False)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
        check_shape(mask, v.shape[:2], "mask", "v_context's (B, 2m)")
        n = mask.sum(1)
        if (n == 0).any():
            raise ValueError("every row of mask needs at least one real context word")
        h = (v * mask[..., None]).sum(1) / n[:, None]
    return restore_half(log_softmax(h @ W.T, -1), dtype)


def cbow_loss(v_context, W, targets, mask=None, reduction: str = "mean") -> Tensor:
    """CBOW's training loss, :math:`-\\log p(w_t \\mid \\text{context})` of the centre words ``targets`` ``(B,)``."""
    logp = cbow_log_probs(v_context, W, mask)
    y = check_token_ids(targets, logp.shape[-1], "targets")
    check_shape(y, logp.shape[:1], "targets", "the batch axis B of v_context")
    nll = -logp.gather(-1, y[:, None])[:, 0]
    return reduce_loss(nll, None, reduction, "example")


def glove_weight(X, x_max: float = 100.0, alpha: float = 0.75) -> Tensor:
    r"""GloVe's weight :math:`f(x) = (x/x_{max})^\alpha` below :math:`x_{max}`, 1 above; :math:`f(0) = 0`.

    >>> glove_weight(torch.tensor([0.0, 10.0, 100.0, 500.0]))
    tensor([0.0000, 0.1778, 1.0000, 1.0000])
    """
    X = as_tensor(X, "X")
    check_finite(X, "X")
    if (X < 0).any():
        raise ValueError("X must hold non-negative co-occurrence counts")
    x_max = check_range(x_max, "x_max", 0.0, low_open=True)
    alpha = check_range(alpha, "alpha", 0.0)
    dtype = X.dtype
    X = upcast_half(X)
    return restore_half(torch.where(X < x_max, (X / x_max) ** alpha, torch.ones_like(X)), dtype)


@implements("15.07")
def glove_loss(W: Float[Tensor, "V D"], W_tilde: Float[Tensor, "V D"], b: Float[Tensor, " V"],
               b_tilde: Float[Tensor, " V"], X: Float[Tensor, "V V"], x_max: float = 100.0, alpha: float = 0.75,
               reduction: str = "sum") -> Tensor:
    r"""GloVe's objective :math:`J=\sum_{i,j} f(X_{ij})\,(w_i^\top\tilde w_j + b_i + \tilde b_j - \log X_{ij})^2`.

    ``W``/``b`` are the word vectors and biases, ``W_tilde``/``b_tilde`` the context ones, ``X`` the
    co-occurrence counts. Pairs that never co-occur (:math:`X_{ij}=0`) have :math:`f=0` and are left out
    (their :math:`\log X_{ij}` is never computed). ``reduction``: ``"sum"`` (the paper's :math:`J`),
    ``"mean"`` over the non-zero :math:`X_{ij}`, or ``"none"`` (the ``(V, V)`` terms).

    >>> X = torch.tensor([[0.0, 100.0], [100.0, 0.0]])
    >>> glove_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2), torch.zeros(2), X)  # 2 (log 100)^2
    tensor(42.4152)
    """
    W, W_tilde = _float(W, "W", "(V, D)", 2), _float(W_tilde, "W_tilde", "(V, D)", 2)
    b, b_tilde = _float(b, "b", "(V,)", 1), _float(b_tilde, "b_tilde", "(V,)", 1)
    check_shape(W_tilde, W.shape, "W_tilde", "W (V, D)")
    V = W.shape[0]
    check_shape(b, (V,), "b", "the vocabulary V of W")
    check_shape(b_tilde, (V,), "b_tilde", "the vocabulary V of W")
    f = glove_weight(X, x_max, alpha)
    X = as_tensor(X, "X")
    check_shape(X, (V, V), "X", "the vocabulary V of W")
    check_choice(reduction, "reduction", REDUCTIONS)
    dtype = W.dtype
    ct = upcast_half(W).dtype
    W, W_tilde, b, b_tilde, X, f = (upcast_half(t).to(ct) for t in (W, W_tilde, b, b_tilde, X, f))
    seen = X > 0
    log_X = torch.log(torch.where(seen, X, torch.ones_like(X)))
    err = W @ W_tilde.T + b[:, None] + b_tilde[None, :] - log_X
    terms = torch.where(seen, f * err.square(), torch.zeros_like(err))
    if reduction == "mean" and not seen.any():
        raise ValueError("reduction='mean' over no co-occurring pair (X is all zero)")
    out = terms if reduction == "none" else terms.sum() if reduction == "sum" else terms.sum() / seen.sum()
    return restore_half(out, dtype)


def cooccurrence_matrix(ids: Int[Tensor, " N"], V: int, window: int = 5) -> Tensor:
    """GloVe's counts ``X (V, V)`` (float64): each pair at distance ``d <= window`` adds ``1/d``, both ways.

    >>> cooccurrence_matrix(torch.tensor([0, 1, 0]), 2, window=2)
    tensor([[1.0000, 2.0000],
            [2.0000, 0.0000]], dtype=torch.float64)
    """
    V = check_positive_int(V, "V")
    window = check_positive_int(window, "window")
    ids = check_token_ids(ids, V)
    check_dim(ids, "ids", "(N,)", min_dim=1, max_dim=1)
    X = torch.zeros(V * V, dtype=torch.float64)
    for d in range(1, min(window, len(ids) - 1) + 1):
        a, c = ids[:-d], ids[d:]
        X.index_add_(0, a * V + c, torch.full((len(a),), 1.0 / d, dtype=torch.float64))
        X.index_add_(0, c * V + a, torch.full((len(a),), 1.0 / d, dtype=torch.float64))
    return X.view(V, V)


def fit(loss_fn, params: list[Tensor], steps: int, lr: float = 0.01) -> Tensor:
    """Minimise ``loss_fn()`` over ``params`` (leaf tensors with ``requires_grad``, updated in place) with Adam.

    The steps are the update rules of :mod:`llmbook.lm.optim` (``adam_moments``, ``adam_update``, betas
    0.9 / 0.999), which avoids the one-time import cost of ``torch.optim`` on the first step. Returns the
    ``(steps,)`` losses.
    """
    from llmbook.lm.optim import adam_moments, adam_update

    steps = check_positive_int(steps, "steps")
    lr = check_range(lr, "lr", 0.0, low_open=True)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    losses = []
    for t in range(1, steps + 1):
        loss = loss_fn()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads, strict=False)):
                m[i], v[i] = adam_moments(m[i], v[i], g)
                p.copy_(adam_update(p, m[i], v[i], t, lr))
        losses.append(loss.item())
    return torch.tensor(losses)


def train_skipgram(ids, V: int, D: int = 16, window: int = 2, k: int = 5, steps: int = 200,
                   batch_size: int = 256, lr: float = 0.05, generator: torch.Generator | None = None):
    """A small skip-gram run with negative sampling and Adam (:func:`fit`); returns ``(W_in, W_out, losses)``.

    Each step draws ``batch_size`` (centre, context) pairs within ``window`` and ``k`` negatives per pair
    from :func:`noise_distribution` of the token counts, and takes one step on :func:`sgns_loss`.
    """
    V, D, k = check_positive_int(V, "V"), check_positive_int(D, "D"), check_positive_int(k, "k")
    window, steps = check_positive_int(window, "window"), check_positive_int(steps, "steps")
    batch_size = check_positive_int(batch_size, "batch_size")
    ids = check_token_ids(ids, V)
    if ids.ndim != 1 or len(ids) <= 2 * window:
        raise ValueError(f"ids must be a 1-d token stream longer than 2 * window = {2 * window}, got shape "
                         f"{tuple(ids.shape)}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    P_n = noise_distribution(torch.bincount(ids, minlength=V).double())
    W_in = ((torch.rand(V, D, generator=g) - 0.5) / D).requires_grad_(True)
    W_out = torch.zeros(V, D, requires_grad=True)  # word2vec's initialisation

    def loss_fn():
        pos = torch.randint(window, len(ids) - window, (batch_size,), generator=g)
        sign = torch.randint(0, 2, (batch_size,), generator=g) * 2 - 1
        off = torch.randint(1, window + 1, (batch_size,), generator=g) * sign
        neg = torch.multinomial(P_n, batch_size * k, replacement=True, generator=g).view(batch_size, k)
        return sgns_loss(W_in[ids[pos]], W_out[ids[pos + off]], W_out[neg])

    losses = fit(loss_fn, [W_in, W_out], steps, lr)
    return W_in.detach(), W_out.detach(), losses


def char_ngrams(word: str, n_min: int = 3, n_max: int = 6) -> list[str]:
    """fastText's character n-grams of ``"<" + word + ">"``: by start position, then by length.

    >>> char_ngrams("where", 3, 3)
    ['<wh', 'whe', 'her', 'ere', 're>']
    """
    if not isinstance(word, str):
        raise TypeError(f"word must be a str, got {type(word).__name__}")
    n_min = check_positive_int(n_min, "n_min")
    n_max = check_positive_int(n_max, "n_max")
    w = "<" + word + ">"
    return [w[i:i + n] for i in range(len(w)) for n in range(n_min, n_max + 1)
            if i + n <= len(w) and not (n == 1 and (i == 0 or i + n == len(w)))]


def fasttext_hash(s: str | bytes) -> int:
    """fastText's 32-bit FNV-1a hash of the UTF-8 bytes, with its quirk: each byte is sign-extended first.

    >>> fasttext_hash("a"), fasttext_hash("é")
    (3826002220, 1023043777)
    """
    data = s.encode("utf-8") if isinstance(s, str) else s
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"s must be a str or bytes, got {type(s).__name__}")
    h = 2166136261
    for byte in data:
        h ^= byte if byte < 128 else (byte - 256) & 0xFFFFFFFF  # int8 -> uint32, as the C++ code does
        h = (h * 16777619) & 0xFFFFFFFF
    return h


def ngram_buckets(word: str, n_min: int = 3, n_max: int = 6, num_buckets: int = 2_000_000) -> list[int]:
    """The bucket (row of the n-gram table) of each n-gram of ``word``: ``fasttext_hash(g) % num_buckets``."""
    num_buckets = check_positive_int(num_buckets, "num_buckets")
    return [fasttext_hash(g) % num_buckets for g in char_ngrams(word, n_min, n_max)]


@implements("15.08")
def subword_vector(word: str, Z: Float[Tensor, "num_buckets D"], n_min: int = 3, n_max: int = 6,
                   word_vector: Float[Tensor, " D"] | None = None, reduce: str = "sum") -> Float[Tensor, " D"]:
    r"""fastText's word vector :math:`v_w = \sum_{g \in G_w} z_g`, the n-gram vectors hashed into ``Z``'s rows.

    :math:`G_w` holds the character n-grams of ``"<word>"`` (lengths ``n_min..n_max``) and, for a word in
    the vocabulary, the word itself (pass its own vector as ``word_vector``). ``reduce="mean"`` divides by
    :math:`|G_w|`: gensim's convention. An out-of-vocabulary word still gets a vector, from its n-grams.
    Shape ``Z (num_buckets, D) -> (D,)``.

    >>> Z = torch.eye(5)
    >>> subword_vector("ab", Z, 3, 3), ngram_buckets("ab", 3, 3, 5)  # '<ab' -> row 3, 'ab>' -> row 1
    (tensor([0., 1., 0., 1., 0.]), [3, 1])
    """
    Z = _float(Z, "Z", "(num_buckets, D)", 2)
    if Z.shape[0] == 0:
        raise ValueError("Z must hold at least one bucket")
    check_choice(reduce, "reduce", ("sum", "mean"))
    rows = ngram_buckets(word, n_min, n_max, Z.shape[0])
    dtype = Z.dtype
    Zc = upcast_half(Z)
    v = Zc[torch.tensor(rows, dtype=torch.long)].sum(0) if rows else Zc.new_zeros(Z.shape[1])
    n = len(rows)
    if word_vector is not None:
        u = _float(word_vector, "word_vector", "(D,)", 1)
        check_shape(u, (Z.shape[1],), "word_vector", "the width D of Z")
        v, n = v + upcast_half(u).to(v.dtype), n + 1
    if reduce == "mean":
        if n == 0:
            raise ValueError(f"word {word!r} has no n-gram of length {n_min}..{n_max} to average")
        v = v / n
    return restore_half(v, dtype)
