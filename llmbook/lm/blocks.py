r"""Transformer blocks (chapter 2, ids 02.05-02.09): pre- and post-norm blocks, the FFN, dropout, stochastic depth.

A block is two residual sublayers, attention then an MLP, each wrapped with a normalisation. The blocks
here are generic: they take the attention and MLP sublayers as modules and the normalisation as a factory
``norm(d_model) -> nn.Module`` (default :class:`llmbook.lm.norms.LayerNorm`; the tiny GPT of
:mod:`llmbook.lm.gpt` passes :class:`~llmbook.lm.norms.RMSNorm`). The attention sublayer is called as
``attn(x, **attn_kwargs)`` on a ``(B, T, d_model)`` tensor and must return the same shape; the keyword
arguments given to the block's ``forward`` (a mask, ``is_causal``, RoPE tables) are passed through.

Regularisers: :func:`dropout` zeroes single activations, :func:`stochastic_depth` skips a whole residual
branch. Both are *inverted*: surviving values are divided by the survival probability during training,
so the expectation is unchanged and evaluation is the identity. Initialisers live in :mod:`llmbook.lm.init`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import as_tensor, check_dim, check_module_input, check_positive_int, check_range, check_same_shape
from llmbook.lm.activations import ACTIVATIONS
from llmbook.lm.norms import LayerNorm
from llmbook.registry import implements

__all__ = [
    "FeedForward",
    "dropout_mask",
    "dropout",
    "Dropout",
    "stochastic_depth",
    "linear_decay_survival",
    "PreNormBlock",
    "PostNormBlock",
]

NormFactory = Callable[[int], nn.Module]



# --------------------------------------------------------------------------- 02.07 feed-forward network


@implements("02.07")
class FeedForward(nn.Module):
    r"""Position-wise feed-forward network :math:`\mathrm{FFN}(x) = \phi(x W_1 + b_1) W_2 + b_2`.

    Applied to every position independently: ``w1`` (:math:`W_1`, ``d_model -> d_ff``) expands, the
    non-linearity :math:`\phi` (``activation``: a name in ``llmbook.lm.activations.ACTIVATIONS``, e.g.
    ``relu``, ``gelu``, ``gelu_tanh``, ``silu``, or a callable) acts
    element-wise, ``w2`` (:math:`W_2`, ``d_ff -> d_model``) projects back. ``d_ff`` is usually
    ``4 * d_model``. ``bias=False`` drops :math:`b_1, b_2`; ``dropout`` is applied to the hidden
    activations, as in ``nn.TransformerEncoderLayer``. The ``nn.Linear`` weights store the transposes
    (``w1.weight`` is :math:`W_1^\top`, shape ``(d_ff, d_model)``). Shape ``(..., d_model) -> (..., d_model)``.

    >>> ffn = FeedForward(4, 16, activation="relu")
    >>> ffn(torch.zeros(2, 3, 4)).shape
    torch.Size([2, 3, 4])
    """

    def __init__(self, d_model: int, d_ff: int, activation: str | Callable[[Tensor], Tensor] = "gelu",
                 bias: bool = True, dropout: float = 0.0):
        super().__init__()
        d_model, d_ff = check_positive_int(d_model, "d_model"), check_positive_int(d_ff, "d_ff")
        if isinstance(activation, str):
            if activation not in ACTIVATIONS:
                raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a callable, got {activation!r}")
            self.activation_name, self.phi = activation, ACTIVATIONS[activation]
        elif callable(activation):
            self.activation_name, self.phi = getattr(activation, "__name__", "custom"), activation
        else:
            raise TypeError(f"activation must be a name or a callable, got {type(activation).__name__}")
        self.d_model, self.d_ff = d_model, d_ff
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        self.drop = Dropout(dropout)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x = check_module_input(self, x, d=self.d_model)
        return self.w2(self.drop(self.phi(self.w1(x))))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation_name}"


# --------------------------------------------------------------------------- 02.08 dropout


def dropout_mask(shape, p: float, generator: torch.Generator | None = None, device=None) -> Tensor:
    r"""Boolean keep-mask :math:`m_i \sim \mathrm{Bernoulli}(1-p)`, drawn i.i.d. (``True`` = kept).

    >>> dropout_mask((4,), 0.0)
    tensor([True, True, True, True])
    """
    check_range(p, "p", 0.0, 1.0)
    return torch.rand(shape, generator=generator, device=device) >= p


@implements("02.08")
def dropout(x: Float[Tensor, "..."], p: float, training: bool = True,
            generator: torch.Generator | None = None) -> Float[Tensor, "..."]:
    r"""Inverted dropout :math:`\mathrm{Dropout}(x) = \frac{m \odot x}{1-p}`, :math:`m_i \sim \mathrm{Bernoulli}(1-p)`.

    Each entry is zeroed with probability ``p`` (:math:`p`, in ``[0, 1]``) and the survivors are scaled
    by :math:`1/(1-p)`, so :math:`\mathbb{E}[\mathrm{Dropout}(x)] = x` and the variance of a constant input
    ``c`` becomes :math:`c^2 p/(1-p)`. With ``training=False`` it is the identity (nothing to rescale at
    test time). ``p = 1`` returns zeros (the limit; no division by zero). ``generator`` makes the mask
    reproducible. Shape preserved.

    >>> dropout(torch.ones(5), 0.5, training=False)
    tensor([1., 1., 1., 1., 1.])
    >>> dropout(torch.ones(6), 0.5, generator=torch.Generator().manual_seed(0)).unique().tolist()
    [0.0, 2.0]
    """
    x = as_tensor(x, "x")
    check_range(p, "p", 0.0, 1.0)
    if not training or p == 0:
        return x
    if p == 1:
        return torch.zeros_like(x)
    m = dropout_mask(x.shape, p, generator, device=x.device)
    return x * m.to(x.dtype) / (1 - p)


class Dropout(nn.Module):
    r""":func:`dropout` as a module: active in ``train()`` mode, the identity in ``eval()`` mode.

    >>> Dropout(0.3).eval()(torch.ones(3))
    tensor([1., 1., 1.])
    """

    def __init__(self, p: float = 0.1):
        super().__init__()
        check_range(p, "p", 0.0, 1.0)
        self.p = p
        self.generator: torch.Generator | None = None  # set to make the masks reproducible

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training, self.generator)

    def extra_repr(self) -> str:
        return f"p={self.p}"


# --------------------------------------------------------------------------- 02.09 stochastic depth


@implements("02.09")
def stochastic_depth(
    h: Float[Tensor, "B ..."], f_h: Float[Tensor, "B ..."], p_l: float, training: bool = True,
    mode: str = "row", inverted: bool = True, generator: torch.Generator | None = None,
) -> Float[Tensor, "B ..."]:
    r"""Stochastic depth: keep a residual branch with probability :math:`p_l`, else skip it.

    .. math:: h^{(l+1)} = h^{(l)} + b_l\, f_l(h^{(l)}), \qquad b_l \sim \mathrm{Bernoulli}(p_l)

    ``h`` is the residual stream :math:`h^{(l)}`, ``f_h`` the branch output :math:`f_l(h^{(l)})` (same
    shape, batch first), ``p_l`` the *survival* probability in ``(0, 1]``. ``mode="row"`` draws one
    :math:`b_l` per batch element (each example sees a different shallower network, as ``timm`` and
    ``torchvision``); ``mode="batch"`` draws one for the whole batch (Huang et al., 2016).

    ``inverted=True`` (default) trains with :math:`b_l / p_l` and evaluates with the full branch, so the
    expectation matches and evaluation is a plain residual. ``inverted=False`` is the paper's form:
    train with :math:`b_l`, evaluate with :math:`h + p_l f_l(h)`. Shape preserved.

    >>> h, f_h = torch.zeros(4, 2), torch.ones(4, 2)
    >>> stochastic_depth(h, f_h, 0.5, training=False)
    tensor([[1., 1.],
            [1., 1.],
            [1., 1.],
            [1., 1.]])
    >>> stochastic_depth(h, f_h, 0.5, training=False, inverted=False)[0]
    tensor([0.5000, 0.5000])
    """
    h, f_h = as_tensor(h, "h"), as_tensor(f_h, "f_h")
    check_same_shape(h, f_h, "h", "f_h")
    check_dim(h, "h", "(B, ...)")
    check_range(p_l, "p_l", 0.0, 1.0, low_open=True)
    if mode not in ("row", "batch"):
        raise ValueError(f"mode must be 'row' (one draw per example) or 'batch' (one draw), got {mode!r}")
    if not training:
        return h + f_h if inverted else h + p_l * f_h
    if p_l == 1:
        return h + f_h
    shape = (h.shape[0],) + (1,) * (h.ndim - 1) if mode == "row" else (1,) * h.ndim
    b = dropout_mask(shape, 1 - p_l, generator, device=h.device).to(h.dtype)
    return h + (b / p_l if inverted else b) * f_h


def linear_decay_survival(L: int, p_L: float = 0.5) -> list[float]:
    r"""The linear schedule of Huang et al. (2016): :math:`p_l = 1 - \frac{l}{L}(1 - p_L)` for layers :math:`l = 1..L`.

    The first layers are almost always kept, the last survives with probability ``p_L``; the expected
    depth is :math:`\sum_l p_l`.

    >>> linear_decay_survival(4, 0.5)
    [0.875, 0.75, 0.625, 0.5]
    """
    L = check_positive_int(L, "L")
    check_range(p_L, "p_L", 0.0, 1.0, low_open=True)
    return [1 - l / L * (1 - p_L) for l in range(1, L + 1)]


# --------------------------------------------------------------------------- 02.05 / 02.06 blocks


class _Block(nn.Module):
    """Shared state of the two block layouts: sublayers, two norms, residual dropout, stochastic depth."""

    def __init__(self, d_model: int, attn: nn.Module, mlp: nn.Module, norm: NormFactory = LayerNorm,
                 dropout: float = 0.0, p_survive: float = 1.0):
        super().__init__()
        self.d_model = check_positive_int(d_model, "d_model")
        for name, sub in (("attn", attn), ("mlp", mlp)):
            if not callable(sub):
                raise TypeError(f"{name} must be a module (or callable) mapping (B, T, d_model) to itself")
        if not callable(norm):
            raise TypeError("norm must be a factory norm(d_model) -> nn.Module, e.g. LayerNorm or RMSNorm")
        check_range(p_survive, "p_survive", 0.0, 1.0, low_open=True)
        self.attn, self.mlp = attn, mlp
        self.norm1, self.norm2 = norm(d_model), norm(d_model)
        self.drop = Dropout(dropout)
        self.p_survive = p_survive

    def _residual(self, h: Tensor, branch: Tensor) -> Tensor:
        """``h + branch`` with residual dropout and stochastic depth on the branch (both off in eval)."""
        return stochastic_depth(h, self.drop(branch), self.p_survive, self.training)

    def _check(self, h: Tensor) -> Tensor:
        """``h (..., T, d_model)``: any leading axes (the sublayers accept them; attention flattens them)."""
        h = check_module_input(self, h, "h", d=self.d_model, contract="(..., T, d_model)")
        if h.ndim < 2:
            raise ValueError(f"h must have shape (..., T, d_model), got {tuple(h.shape)}")
        return h


@implements("02.05")
class PreNormBlock(_Block):
    r"""Pre-norm block (GPT-2, Llama): normalise the *input* of each sublayer, keep the residual stream raw.

    .. math::
        \tilde h^{(l)} = h^{(l)} + \mathrm{Attn}(\mathrm{LN}(h^{(l)})), \qquad
        h^{(l+1)} = \tilde h^{(l)} + \mathrm{MLP}(\mathrm{LN}(\tilde h^{(l)}))

    ``norm1``/``norm2`` are the two LN (built by ``norm(d_model)``), ``attn``/``mlp`` the sublayers.
    The stream is never normalised, so a stack of pre-norm blocks needs one final norm before the LM
    head (``nn.TransformerEncoderLayer(norm_first=True)`` has none either). ``dropout`` acts on each
    branch output, ``p_survive`` < 1 adds :func:`stochastic_depth` to each branch (training only).
    ``forward(h, **attn_kwargs)``: shape ``(B, T, d_model) -> (B, T, d_model)``.

    >>> blk = PreNormBlock(4, attn=nn.Identity(), mlp=FeedForward(4, 8))
    >>> blk(torch.zeros(1, 3, 4)).shape
    torch.Size([1, 3, 4])
    """

    def forward(self, h: Float[Tensor, "B T d_model"], **attn_kwargs) -> Float[Tensor, "B T d_model"]:
        h = self._check(h)
        h_tilde = self._residual(h, self.attn(self.norm1(h), **attn_kwargs))
        return self._residual(h_tilde, self.mlp(self.norm2(h_tilde)))


@implements("02.06")
class PostNormBlock(_Block):
    r"""Post-norm block (the original Transformer, BERT): normalise *after* each residual addition.

    .. math::
        \tilde h^{(l)} = \mathrm{LN}(h^{(l)} + \mathrm{Attn}(h^{(l)})), \qquad
        h^{(l+1)} = \mathrm{LN}(\tilde h^{(l)} + \mathrm{MLP}(\tilde h^{(l)}))

    Every residual path passes through a norm, so gradients to early layers are rescaled at every
    block; deep post-norm stacks need learning-rate warm-up to train. Same arguments and shapes as
    :class:`PreNormBlock`.

    >>> blk = PostNormBlock(4, attn=nn.Identity(), mlp=FeedForward(4, 8))
    >>> blk(torch.randn(1, 3, 4)).mean(-1).abs().max() < 1e-6  # every output row is normalised
    tensor(True)
    """

    def forward(self, h: Float[Tensor, "B T d_model"], **attn_kwargs) -> Float[Tensor, "B T d_model"]:
        h = self._check(h)
        h_tilde = self.norm1(self._residual(h, self.attn(h, **attn_kwargs)))
        return self.norm2(self._residual(h_tilde, self.mlp(h_tilde)))

