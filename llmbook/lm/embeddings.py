r"""Embeddings and the LM head (chapter 2, ids 02.01-02.04).

A language model starts and ends in the vocabulary. The *token embedding* :math:`E \in \mathbb{R}^{V\times d}`
turns token ids into vectors (a row lookup), learned *absolute position* vectors :math:`P \in
\mathbb{R}^{T_{max}\times d}` may be added to them, and the *LM head* :math:`W_U \in \mathbb{R}^{d\times V}`
turns the last hidden state back into one logit per token. Tying :math:`W_U = E^\top` shares one
matrix between both ends.

Shapes: ``B`` batch, ``T`` positions, ``V`` vocabulary, ``d`` (``d_model``) width. Batch-first.
Matrices follow the equations: ``E`` is ``(V, d)`` and ``W_U`` is ``(d, V)`` (an ``nn.Linear`` stores the
transpose, ``(V, d)``: :class:`LMHead` keeps that layout, :func:`lm_head` takes the equation's).
:func:`linear` is the plain affine map in torch's layout, ``y = x W^T + b``, for readers wiring their own
model from a state dict of ``nn.Linear`` weights.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_same_dtype,
    check_token_ids,
)
from llmbook.lm.positions import LearnedPositionEmbedding
from llmbook.registry import implements

__all__ = [
    "check_token_ids",
    "embedding_lookup",
    "one_hot_embedding",
    "token_position_embedding",
    "linear",
    "lm_head",
    "tied_lm_head",
    "TokenEmbedding",
    "TokenPositionEmbedding",
    "LMHead",
]


def _table(M, name: str, contract: str) -> Tensor:
    M = as_tensor(M, name)
    if M.ndim != 2:
        raise ValueError(f"{name} must be a matrix of shape {contract}, got {tuple(M.shape)}")
    return M


@implements("02.01")
def embedding_lookup(ids: Int[Tensor, "..."], E: Float[Tensor, "V d"]) -> Float[Tensor, "... d"]:
    r"""Token embedding lookup :math:`X = E[\mathrm{ids}]`, :math:`E \in \mathbb{R}^{V\times d}`.

    Row :math:`x_i` of the output is row ``ids[i]`` of ``E``: an index, not a multiplication, although it
    equals :math:`\mathrm{onehot}(x_i)\,E` (:func:`one_hot_embedding`, the slow form kept for comparison).
    ``ids`` holds integers in ``[0, V)`` with any shape; ``E`` is ``(V, d)``. Shape ``(...) -> (..., d)``.
    Gradients flow to the rows that were looked up (repeated ids add up).

    >>> E = torch.arange(6.0).reshape(3, 2)  # V = 3 tokens, d = 2
    >>> embedding_lookup(torch.tensor([[2, 0]]), E)
    tensor([[[4., 5.],
             [0., 1.]]])
    """
    E = _table(E, "E", "(V, d)")
    ids = check_token_ids(ids, E.shape[0])
    return E[ids]


def one_hot_embedding(ids: Int[Tensor, "..."], E: Float[Tensor, "V d"]) -> Float[Tensor, "... d"]:
    r"""The lookup written as a product, :math:`X = \mathrm{onehot}(\mathrm{ids})\,E`: ``V`` times more work.

    >>> one_hot_embedding(torch.tensor([1]), torch.eye(3))
    tensor([[0., 1., 0.]])
    """
    E = _table(E, "E", "(V, d)")
    ids = check_token_ids(ids, E.shape[0])
    return torch.nn.functional.one_hot(ids, E.shape[0]).to(E.dtype) @ E


@implements("02.02")
def token_position_embedding(
    ids: Int[Tensor, "B T"], E: Float[Tensor, "V d"], P: Float[Tensor, "T_max d"], offset: int = 0,
) -> Float[Tensor, "B T d"]:
    r"""Input of the first block with learned absolute positions: :math:`h_i^{(0)} = E_{x_i} + P_i`.

    ``E`` is the ``(V, d)`` token table, ``P`` the ``(T_max, d)`` position table (GPT-2 style). Token
    :math:`i` of every sequence gets position ``offset + i``, so ``offset`` continues a sequence whose
    first ``offset`` tokens were processed before (decoding with a cache). Positions beyond ``T_max``
    have no vector: a model with learned positions cannot read longer inputs. Shape ``(B, T) -> (B, T, d)``.

    >>> E, P = torch.zeros(5, 2), torch.tensor([[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]])
    >>> token_position_embedding(torch.tensor([[3, 4]]), E, P, offset=1)
    tensor([[[10., 11.],
             [20., 21.]]])
    """
    E = _table(E, "E", "(V, d)")
    P = _table(P, "P", "(T_max, d)")
    if E.shape[1] != P.shape[1]:
        raise ValueError(f"E (V, d) = {tuple(E.shape)} and P (T_max, d) = {tuple(P.shape)} disagree on d")
    ids = check_token_ids(ids, E.shape[0])
    check_dim(ids, "ids", "(B, T)", min_dim=2, max_dim=2)
    offset = check_nonnegative_int(offset, "offset")
    T, T_max = ids.shape[1], P.shape[0]
    if offset + T > T_max:
        raise ValueError(f"positions {offset}..{offset + T - 1} exceed the position table: T_max = {T_max}")
    return E[ids] + P[offset:offset + T]


def linear(x: Float[Tensor, "... d_in"], W: Float[Tensor, "d_out d_in"], b: Float[Tensor, " d_out"] | None = None
           ) -> Float[Tensor, "... d_out"]:
    r"""An affine map in ``torch.nn.Linear``'s weight layout: :math:`y = x W^\top + b`.

    ``x`` is ``(..., d_in)``, ``W`` the ``(d_out, d_in)`` matrix an ``nn.Linear`` stores as ``weight`` (so
    each row of ``W`` is one output unit), ``b`` an optional ``(d_out,)`` bias. Shape
    ``(..., d_in) -> (..., d_out)``; the same as ``torch.nn.functional.linear``, with errors that name
    the shapes. Every projection of a transformer is one (``q_proj``, the FFN's ``w1``, the LM head
    :func:`lm_head` with :math:`W = W_U^\top`); no catalogue equation is this map alone.

    >>> linear(torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, -1.0]]), torch.ones(3))
    tensor([ 2.,  4., -1.])
    """
    x, W = as_tensor(x, "x"), _table(W, "W", "(d_out, d_in)")
    check_dim(x, "x", "(..., d_in)")
    if x.shape[-1] != W.shape[1]:
        raise ValueError(f"x (..., d_in) = {tuple(x.shape)} and W (d_out, d_in) = {tuple(W.shape)} disagree on "
                         f"d_in ({x.shape[-1]} != {W.shape[1]}); W is in nn.Linear's layout, (out, in)")
    y = x @ W.T
    if b is not None:
        b = as_tensor(b, "b")
        if b.shape != (W.shape[0],):
            raise ValueError(f"b must have shape (d_out,) = ({W.shape[0]},), got {tuple(b.shape)}")
        y = y + b
    return y


@implements("02.03")
def lm_head(
    h: Float[Tensor, "... d"], W_U: Float[Tensor, "d V"], b_U: Float[Tensor, " V"] | None = None,
) -> Float[Tensor, "... V"]:
    r"""LM head: logits :math:`z_t = h_t W_U + b_U`, one real number per vocabulary entry.

    ``h`` is the final hidden state ``(..., d)`` (after the final norm), ``W_U`` the unembedding
    ``(d, V)`` as in the equation, ``b_U`` an optional ``(V,)`` bias (most LLMs have none).
    Shape ``(..., d) -> (..., V)``. The softmax of chapter 1 turns ``z`` into next-token probabilities.

    >>> W_U = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])  # d = 2, V = 3
    >>> lm_head(torch.tensor([1.0, 2.0]), W_U, torch.tensor([0.0, 0.0, -3.0]))
    tensor([1., 2., 0.])
    """
    h = as_tensor(h, "h")
    W_U = _table(W_U, "W_U", "(d, V)")
    check_dim(h, "h", "(..., d)")
    check_finite(h, "h")
    check_same_dtype(h, W_U, "h", "W_U")
    if h.shape[-1] != W_U.shape[0]:
        raise ValueError(f"h (..., d) = {tuple(h.shape)} and W_U (d, V) = {tuple(W_U.shape)} disagree on d")
    z = h @ W_U
    if b_U is not None:
        b_U = as_tensor(b_U, "b_U")
        check_same_dtype(b_U, W_U, "b_U", "W_U")
        if b_U.shape != (W_U.shape[1],):
            raise ValueError(f"b_U must have shape (V,) = ({W_U.shape[1]},), got {tuple(b_U.shape)}")
        z = z + b_U
    return z


@implements("02.04")
def tied_lm_head(h: Float[Tensor, "... d"], E: Float[Tensor, "V d"]) -> Float[Tensor, "... V"]:
    r"""Tied input-output embeddings: the head reuses the embedding, :math:`W_U = E^\top`, so :math:`z_t = h_t E^\top`.

    Logit :math:`z_{t,v} = \langle h_t, E_v \rangle`: the score of token :math:`v` is how well the hidden
    state aligns with that token's own input vector. One ``(V, d)`` matrix serves both ends, which
    saves :math:`V d` parameters and lets rare tokens' input rows learn from the output loss.
    Shape ``(..., d), (V, d) -> (..., V)``.

    >>> tied_lm_head(torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]))
    tensor([ 1., -1.,  0.])
    """
    E = _table(E, "E", "(V, d)")
    return lm_head(h, E.T)


class TokenEmbedding(nn.Module):
    r"""Learned token table :math:`E \in \mathbb{R}^{V\times d}` (``weight``), read by :func:`embedding_lookup`.

    Initialised :math:`E_{ij} \sim \mathcal{N}(0, \mathrm{std}^2)` (``std = 0.02`` as GPT-2 and Llama).

    >>> emb = TokenEmbedding(10, 4)
    >>> emb(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 4])
    """

    def __init__(self, V: int, d: int, std: float = 0.02):
        super().__init__()
        V, d = check_positive_int(V, "V"), check_positive_int(d, "d")
        std = check_range(std, "std", 0.0, low_open=True)
        self.V, self.d = V, d
        self.weight = nn.Parameter(torch.empty(V, d))
        nn.init.normal_(self.weight, std=std)

    def forward(self, ids: Int[Tensor, "..."]) -> Float[Tensor, "... d"]:
        return embedding_lookup(ids, self.weight)

    def extra_repr(self) -> str:
        return f"V={self.V}, d={self.d}"


class TokenPositionEmbedding(nn.Module):
    r"""Token table ``wte`` plus learned absolute-position table ``wpe``, as GPT-2: :math:`h_i^{(0)} = E_{x_i} + P_i`.

    ``wte`` is a :class:`TokenEmbedding`, ``wpe`` the position table of chapter 4
    (:class:`llmbook.lm.positions.LearnedPositionEmbedding`); :func:`token_position_embedding` is the
    same sum in functional form. ``forward(ids (B, T), offset=0) -> (B, T, d)``.

    >>> emb = TokenPositionEmbedding(V=10, d=4, T_max=8)
    >>> emb(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 4])
    """

    def __init__(self, V: int, d: int, T_max: int):
        super().__init__()
        self.wte = TokenEmbedding(V, d)
        self.wpe = LearnedPositionEmbedding(T_max, d)

    def forward(self, ids: Int[Tensor, "B T"], offset: int = 0) -> Float[Tensor, "B T d"]:
        ids = torch.as_tensor(ids)
        check_dim(ids, "ids", "(B, T)", min_dim=2, max_dim=2)
        return self.wpe(self.wte(ids), offset)


class LMHead(nn.Module):
    r"""The LM head :math:`z = h W_U + b_U` as a module; ``tied_to`` shares the embedding (:math:`W_U = E^\top`).

    The parameter ``weight`` has the ``nn.Linear`` layout ``(V, d)``, i.e. it holds :math:`W_U^\top`. When
    ``tied_to`` is a :class:`TokenEmbedding`, ``weight`` *is* that embedding's parameter (one tensor, one
    gradient that sums both uses) and no new matrix is created.

    >>> emb = TokenEmbedding(10, 4)
    >>> head = LMHead(4, 10, tied_to=emb)
    >>> head.weight is emb.weight
    True
    """

    def __init__(self, d: int, V: int, bias: bool = False, tied_to: TokenEmbedding | None = None,
                 std: float = 0.02):
        super().__init__()
        d, V = check_positive_int(d, "d"), check_positive_int(V, "V")
        std = check_range(std, "std", 0.0, low_open=True)
        if tied_to is not None:
            if tuple(tied_to.weight.shape) != (V, d):
                raise ValueError(f"tied_to has E (V, d) = {tuple(tied_to.weight.shape)}, expected ({V}, {d})")
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(V, d))
            nn.init.normal_(self.weight, std=std)
        self.bias = nn.Parameter(torch.zeros(V)) if bias else None

    def forward(self, h: Float[Tensor, "... d"]) -> Float[Tensor, "... V"]:
        return lm_head(h, self.weight.T, self.bias)
