r"""RAG's two marginal likelihoods: RAG-Sequence and RAG-Token (chapter 29).

Lewis et al.'s retrieval-augmented generator treats the retrieved passage :math:`z` as a latent
variable. A retriever :math:`p_\eta(z\mid x)` (a softmax over the scores of the top :math:`k`
passages) and a generator :math:`p_\theta(y_i\mid x, z, y_{<i})` (a language model reading the passage
before the prompt) combine in two ways:

* **RAG-Sequence** (29.01, :func:`rag_sequence_log_likelihood`): one passage for the whole answer,
  :math:`p(y\mid x)=\sum_z p_\eta(z\mid x)\prod_i p_\theta(y_i\mid x,z,y_{<i})`, a mixture of sequence
  probabilities;
* **RAG-Token** (29.02, :func:`rag_token_log_likelihood`): a fresh mixture at every position,
  :math:`p(y\mid x)=\prod_i\sum_z p_\eta(z\mid x, y_{<i})\,p_\theta(y_i\mid x,z,y_{<i})`; in Lewis et al.
  the weights do not depend on :math:`i`, :math:`p_\eta(z\mid x, y_{<i}) = p_\eta(z\mid x)`.

Both work in log space on the same two inputs: ``scores`` ``(B, k)``, the retrieval scores of the top
:math:`k` passages of each of ``B`` queries (normalised here by a log-softmax over the :math:`k`
passages, as RAG renormalises :math:`p_\eta` over its top :math:`k`; already-normalised log-probabilities
pass through unchanged), and ``token_log_probs`` ``(B, k, N)``, the generator's
:math:`\log p_\theta(y_i\mid x, z, y_{<i})` of the :math:`N` answer tokens under each passage.

:func:`sequence_posterior` gives the weights :math:`p(z\mid x, y_{<i})\propto p_\eta(z\mid x)\prod_{j<i}
p_\theta(y_j\mid x,z,y_{<j})` under which the RAG-Token product equals RAG-Sequence exactly (the chain
rule); :func:`generator_log_probs` scores an answer under a character language model (the book's tiny
GPT) with each passage prepended.

>>> scores = torch.tensor([[0.0, 0.0]])                       # two passages, equally likely
>>> lp = torch.log(torch.tensor([[[0.9, 0.9], [0.1, 0.1]]]))  # passage 0 explains both tokens
>>> rag_sequence_log_likelihood(scores, lp).exp().round(decimals=4)   # (0.81 + 0.01) / 2
tensor([0.4100])
>>> rag_token_log_likelihood(scores, lp).exp().round(decimals=4)      # 0.5 * 0.5
tensor([0.2500])
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_finite, check_int, check_real
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["generator_log_probs", "rag_sequence_log_likelihood", "rag_token_log_likelihood",
           "retriever_gradient", "retriever_log_probs", "sequence_posterior"]


def _inputs(scores, token_log_probs, *, per_position: bool):
    """Check the pair; return (log p_eta normalised over k, token log-probs, input dtype), computed >= float32."""
    scores = as_tensor(scores, "scores")
    token_log_probs = as_tensor(token_log_probs, "token_log_probs")
    check_dim(token_log_probs, "token_log_probs", "(B, k, N)", min_dim=3, max_dim=3)
    B, k, N = token_log_probs.shape
    shapes = [(B, k)] + ([(B, k, N)] if per_position else [])
    if tuple(scores.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"scores must have shape {want} to match token_log_probs (B, k, N) = {(B, k, N)}, "
                         f"got {tuple(scores.shape)}")
    if k == 0:
        raise ValueError("k must be >= 1: the marginal needs at least one retrieved passage (got k = 0)")
    check_finite(scores, "scores", allow_neg_inf=True)
    check_finite(token_log_probs, "token_log_probs", allow_neg_inf=True)
    if token_log_probs.numel() and token_log_probs.max() > 0:
        raise ValueError(f"token_log_probs are log-probabilities and must be <= 0, got "
                         f"{token_log_probs.max().item():g}")
    dtype = torch.promote_types(scores.dtype, token_log_probs.dtype)
    s, lp = upcast_half(scores.to(dtype)), upcast_half(token_log_probs.to(dtype))
    if (s == -torch.inf).all(dim=1).any():
        raise ValueError("every passage of a query has score -inf: p_eta(z | x) is undefined")
    s = s - s.amax(dim=1, keepdim=True)  # a shift that leaves the softmax unchanged and keeps 1e30 finite
    return torch.log_softmax(s, dim=1), lp, dtype


@implements("29.01")
def rag_sequence_log_likelihood(scores, token_log_probs) -> Tensor:
    r"""RAG-Sequence: :math:`\log p(y\mid x)=\log\sum_{z}p_\eta(z\mid x)\prod_{i=1}^{N}p_\theta(y_i\mid x,z,y_{<i})`.

    The sum runs over the top :math:`k` passages of the retriever, :math:`z\in\mathrm{top}k(p_\eta(\cdot\mid x))`.

    Computed as :math:`\mathrm{logsumexp}_z\big(\log p_\eta(z\mid x)+\sum_i\log p_\theta(y_i\mid x,z,y_{<i})\big)`:
    the products of up to hundreds of token probabilities underflow, their log-sums do not.

    Symbols: ``scores`` :math:`(B, k)` are retrieval scores of the top :math:`k` passages, turned into
    :math:`\log p_\eta(z\mid x)` by a log-softmax over :math:`k` (``-inf`` = a passage with weight 0;
    log-probabilities pass through unchanged); ``token_log_probs`` :math:`(B, k, N)` holds
    :math:`\log p_\theta(y_i\mid x,z,y_{<i})` (``<= 0``). Returns ``(B,)`` in the input's floating dtype
    (fp16/bf16 computed in float32).

    >>> rag_sequence_log_likelihood(torch.zeros(1, 1), torch.full((1, 1, 3), -1.0))   # k = 1: a plain LM
    tensor([-3.])
    """
    log_p_z, lp, dtype = _inputs(scores, token_log_probs, per_position=False)
    out = torch.logsumexp(log_p_z + lp.sum(dim=2), dim=1)
    return restore_half(out, dtype)


@implements("29.02")
def rag_token_log_likelihood(scores, token_log_probs) -> Tensor:
    r"""RAG-Token: :math:`\log p(y\mid x)=\sum_{i}\log\sum_z p_\eta(z\mid x,y_{<i})\,p_\theta(y_i\mid x,z,y_{<i})`.

    Each position mixes the :math:`k` passages afresh, so one answer can draw its tokens from different
    passages. ``scores`` is ``(B, k)`` (Lewis et al.: :math:`p_\eta(z\mid x)`, the same weights at every
    position) or ``(B, k, N)`` (weights per position, normalised over :math:`k` at each :math:`i`; with
    :func:`sequence_posterior` the result is RAG-Sequence's). ``token_log_probs`` ``(B, k, N)`` as in
    :func:`rag_sequence_log_likelihood`. Returns ``(B,)``.

    >>> rag_token_log_likelihood(torch.zeros(1, 2), torch.full((1, 2, 3), -1.0))  # z ignored: same as a plain LM
    tensor([-3.])
    """
    log_p_z, lp, dtype = _inputs(scores, token_log_probs, per_position=True)
    if log_p_z.ndim == 2:
        log_p_z = log_p_z.unsqueeze(-1)
    out = torch.logsumexp(log_p_z + lp, dim=1).sum(dim=1)
    return restore_half(out, dtype)


def sequence_posterior(scores, token_log_probs) -> Tensor:
    r"""Log posterior :math:`\log p(z\mid x, y_{<i})` of each passage before token :math:`i`, shape ``(B, k, N)``.

    :math:`p(z\mid x,y_{<i})\propto p_\eta(z\mid x)\prod_{j<i}p_\theta(y_j\mid x,z,y_{<j})`: the retriever's
    prior updated by the answer so far. Fed to :func:`rag_token_log_likelihood` as per-position weights it
    turns RAG-Token into RAG-Sequence exactly, because :math:`\prod_i p(y_i\mid x, y_{<i}) = p(y\mid x)`.

    >>> lp = torch.log(torch.tensor([[[0.9, 0.9], [0.1, 0.1]]]))
    >>> sequence_posterior(torch.zeros(1, 2), lp).exp()[0, :, 1]   # after y_1 the first passage gained weight
    tensor([0.9000, 0.1000])
    """
    log_p_z, lp, dtype = _inputs(scores, token_log_probs, per_position=False)
    before = torch.cat([torch.zeros_like(lp[..., :1]), torch.cumsum(lp[..., :-1], dim=2)], dim=2)  # sum over j < i
    logits = log_p_z.unsqueeze(-1) + before
    safe = torch.where((logits == -torch.inf).all(dim=1, keepdim=True), torch.zeros_like(logits), logits)
    return restore_half(torch.log_softmax(safe, dim=1), dtype)


def retriever_gradient(scores, token_log_probs, tau: float = 1.0) -> Tensor:
    r"""How RAG-Sequence trains its retriever with no passage labels: :math:`\partial\log p(y\mid x)/\partial s_z`.

    With :math:`p_\eta(z\mid x)=\mathrm{softmax}_z(s/\tau)` over the top :math:`k` and
    :math:`p(y\mid x)=\sum_z p_\eta(z\mid x)\,p_\theta(y\mid x,z)`,

    .. math:: \frac{\partial \log p(y\mid x)}{\partial s_z}
              = \frac{1}{\tau}\Big(p(z\mid x, y) - p_\eta(z\mid x)\Big),
              \qquad p(z\mid x,y)=\frac{p_\eta(z\mid x)\,p_\theta(y\mid x,z)}{p(y\mid x)} ,

    the posterior minus the prior: a passage under which the answer is likelier than average gains score.
    ``scores`` ``(B, k)`` are the raw retrieval scores :math:`s` (``-inf`` = weight 0, gradient 0);
    ``token_log_probs`` ``(B, k, N)``. Returns ``(B, k)``; it sums to zero over :math:`k`.

    >>> g = retriever_gradient(torch.zeros(1, 2), torch.log(torch.tensor([[[0.9], [0.1]]])))
    >>> g.tolist()   # prior (0.5, 0.5), posterior (0.9, 0.1)
    [[0.4, -0.4]]
    """
    tau = check_real(tau, "tau")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    scores = as_tensor(scores, "scores")
    log_p_z, lp, dtype = _inputs(scores / tau, token_log_probs, per_position=False)
    joint = log_p_z + lp.sum(dim=2)
    finite = (joint > -torch.inf).any(dim=1, keepdim=True)
    posterior = torch.softmax(torch.where(finite, joint, torch.zeros_like(joint)), dim=1)
    out = (posterior - log_p_z.exp()) / tau
    return restore_half(torch.where(log_p_z == -torch.inf, torch.zeros_like(out), out), dtype)


def retriever_log_probs(scores, k: int, tau: float = 1.0) -> tuple[Tensor, Tensor]:
    r"""The top ``k`` passages of each query and :math:`\log p_\eta(z\mid x)=\log\mathrm{softmax}(s/\tau)` over them.

    ``scores`` ``(B, N)`` retrieval scores of every passage (``-inf``: not retrieved); returns the column
    indices ``(B, k)`` in descending score order and their log-probabilities ``(B, k)``. ``tau`` > 0 is a
    temperature: cosine scores of a sentence encoder lie in a narrow band, so :math:`\tau=1` would give
    nearly uniform weights (DPR's inner products span a wider range and use none).

    >>> idx, lp = retriever_log_probs(torch.tensor([[0.1, 0.9, 0.5]]), k=2, tau=0.1)
    >>> idx.tolist(), lp.exp().round(decimals=4).tolist()
    ([[1, 2]], [[0.982, 0.018]])
    """
    scores = as_tensor(scores, "scores")
    check_dim(scores, "scores", "(B, N)", min_dim=2, max_dim=2)
    check_finite(scores, "scores", allow_neg_inf=True)
    k = check_int(k, "k", low=1, high=scores.shape[1])
    tau = check_real(tau, "tau")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    top = torch.topk(upcast_half(scores), k, dim=1)
    return top.indices, torch.log_softmax(top.values / tau, dim=1)


@torch.no_grad()
def generator_log_probs(model, tok, contexts, answer: str) -> Tensor:
    r""":math:`\log p_\theta(y_i\mid z, y_{<i})` of the characters of ``answer`` after each context, shape ``(k, N)``.

    ``model`` is a causal character LM returning logits ``(1, T, V)`` (the book's tiny GPT), ``tok`` its
    tokenizer; each of the ``k`` strings of ``contexts`` is the conditioning text (a passage followed by the
    prompt); characters outside the tokenizer's vocabulary are dropped from it (the tiny GPT knows 100).
    The window holds ``model.config.max_seq_len`` tokens, so each context is cut from the left to leave
    room for the answer. Returns float64.
    """
    if isinstance(contexts, str) or not all(isinstance(c, str) for c in contexts):
        raise TypeError("contexts must be a sequence of strings")
    if not isinstance(answer, str) or not answer:
        raise ValueError("answer must be a non-empty string")
    T_max = model.config.max_seq_len
    y = torch.as_tensor(tok.encode(answer), dtype=torch.long)
    N = len(y)
    if N >= T_max:
        raise ValueError(f"the answer has {N} tokens; the model's window of {T_max} needs N < {T_max}")
    rows = []
    known = set(tok.chars)
    for c in contexts:
        ctx = torch.as_tensor(tok.encode("".join(ch for ch in c if ch in known)), dtype=torch.long)
        if len(ctx) == 0:
            raise ValueError("a context must not be empty (the first answer token needs a predecessor)")
        seq = torch.cat([ctx, y])[-(T_max + 1):]
        logits = model(seq[:-1][None])[0].double()
        logp = torch.log_softmax(logits[-N:], dim=-1)
        rows.append(logp.gather(-1, y[:, None])[:, 0])
    return torch.stack(rows)
