r"""Post-training quantisation of weights and activations (chapter 12): GPTQ, AWQ, SmoothQuant, LLM.int8.

Round-to-nearest (:func:`llmbook.lm.quantization.per_channel_quantize`) quantises every weight on its
own. The methods here look at the *layer's output* on real inputs instead:

* :func:`gptq_quantize` quantises one input column at a time and moves the rounding error onto the
  columns not yet quantised, weighted by the inverse Hessian :math:`H = 2XX^\top` of the inputs;
* :func:`awq_quantize` scales the input channels that carry large activations up before rounding
  (and the activations down), so that the weights that matter most lose the least;
* :func:`smooth_quant` moves the outliers of the *activations* into the weights, so that both can be
  quantised to 8 bits;
* :func:`llm_int8_matmul` keeps the few outlier feature columns in floating point and multiplies the
  rest in int8.

:func:`quantize_model` applies a weight method to every ``nn.Linear`` of a model (the book's tiny GPT)
and returns a new model. Convention: ``W`` is ``(d_out, d_in)`` as in ``nn.Linear.weight``, inputs are
rows, ``X`` is ``(N, d_in)`` and a layer computes ``X @ W.T``; the papers' :math:`WX` (inputs as columns)
is the same product transposed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_positive_int,
    check_range,
    check_same_dtype,
    check_same_last_dim,
    check_shape,
)
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.lm.nf4 import nf4_dequantize, nf4_quantize
from llmbook.lm.quantization import _bits, _grid, absmax_quantize
from llmbook.registry import implements

__all__ = ["gptq_quantize", "gptq_quantize_naive", "AWQResult", "awq_quantize", "smooth_quant", "llm_int8_matmul",
           "linear_inputs", "quantize_model", "METHODS"]


def _matrix(W, name: str = "W") -> Tensor:
    W = as_tensor(W, name)
    check_finite(W, name)
    check_dim(W, name, "(d_out, d_in)", min_dim=2, max_dim=2)
    return W


def _inputs(X, W: Tensor, name: str = "X", contract: str = "(N, d_in)") -> Tensor:
    X = as_tensor(X, name)
    check_finite(X, name)
    check_dim(X, name, contract, min_dim=2 if contract == "(N, d_in)" else 1,
              max_dim=2 if contract == "(N, d_in)" else None)
    check_same_last_dim(X, W, name, "W", "d_in")
    return X


def _sym(symmetric) -> bool:
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    return symmetric


# --------------------------------------------------------------------------- 12.05 GPTQ


def _gptq_problem(W, H, b, symmetric, damp):
    """Checked inputs of GPTQ: (W, its working copy, damped H, the grid fixed from W); dead inputs zeroed."""
    W = _matrix(W)
    d_in = W.shape[1]
    H = as_tensor(H, "H")
    check_finite(H, "H")
    check_shape(H, (d_in, d_in), "H", "(d_in, d_in), d_in of W")
    b, symmetric = _bits(b), _sym(symmetric)
    damp = check_range(damp, "damp", 0.0)
    dt = compute_dtype(W.dtype)
    Wc, H = W.to(dt).clone(), H.to(dt).clone()
    if W.numel() == 0:
        return W, Wc, H, None
    g = _grid(Wc, b, symmetric, -1)  # the grid is fixed before any column moves
    dead = torch.diagonal(H) <= 0
    H[dead, dead] = 1.0
    Wc[:, dead] = 0.0
    H += damp * torch.diagonal(H).mean() * torch.eye(d_in, dtype=dt)
    return W, Wc, H, g


@implements("12.05")
def gptq_quantize(W: Tensor, H: Tensor, b: int = 4, symmetric: bool = False, block_size: int = 128,
                  damp: float = 0.01) -> Tensor:
    r"""GPTQ: quantise ``W`` column by column, compensating each rounding error on the remaining columns.

    .. math:: \min_{\hat W}\ \|WX-\hat WX\|_2^2

    The objective is a quadratic in each row of :math:`\hat W` with Hessian :math:`H = 2XX^\top` (``H``,
    ``(d_in, d_in)``, from calibration inputs: ``2 * X.T @ X`` for rows ``X``). After column :math:`i` is
    rounded to :math:`q_i`, the optimal change of the columns :math:`F` still to come is the OBS update
    :math:`\delta_F = -\frac{w_i-q_i}{[H_F^{-1}]_{ii}}\,(H_F^{-1})_{:,i}`. GPTQ takes the columns in a fixed
    order, so all the :math:`H_F^{-1}` needed are rows of one upper Cholesky factor of :math:`H^{-1}`; the
    updates are applied lazily, ``block_size`` columns at a time. ``damp`` adds
    :math:`\lambda = \text{damp}\cdot\overline{\mathrm{diag}(H)}` to the diagonal; a column with
    :math:`H_{ii}=0` (an input that is always 0) is set to 0.

    The grid is that of :func:`~llmbook.lm.quantization.per_channel_quantize` (``b`` bits, one scale per row,
    min/max unless ``symmetric``), fixed from ``W`` before the loop. With :math:`H \propto I` nothing is
    moved and the result is round-to-nearest. Returns :math:`\hat W` (dequantised, dtype of ``W``).

    >>> W = torch.tensor([[0.3, -0.2, 0.9]])
    >>> gptq_quantize(W, torch.eye(3), b=2, symmetric=True)  # H = I: round to nearest
    tensor([[0.0000, 0.0000, 0.9000]])
    """
    block_size = check_positive_int(block_size, "block_size")
    W, Wc, H, g = _gptq_problem(W, H, b, symmetric, damp)
    if W.numel() == 0:
        return W.clone()
    d_in = Wc.shape[1]
    L, info = torch.linalg.cholesky_ex(H)
    if info != 0:
        raise ValueError("H + damp * mean(diag H) * I is not positive definite; H must be 2 X^T X of real inputs "
                         "(raise damp)")
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    Q = torch.zeros_like(Wc)
    for i1 in range(0, d_in, block_size):
        i2 = min(i1 + block_size, d_in)
        W1, Hinv1 = Wc[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            w, d = W1[:, i:i + 1], Hinv1[i, i]
            q = g.fake(w)                                 # round column i to the grid
            err = (w - q) / d
            W1[:, i:] -= err * Hinv1[i:i + 1, i:]         # OBS update of the columns to its right
            Q[:, i1 + i:i1 + i + 1], Err1[:, i:i + 1] = q, err
        Wc[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]            # lazy update of the later blocks
    return restore_half(Q, W.dtype)


def gptq_quantize_naive(W: Tensor, H: Tensor, b: int = 4, symmetric: bool = False, damp: float = 0.01) -> Tensor:
    r"""GPTQ as the textbook states it, for checking :func:`gptq_quantize`: one explicit inverse per column.

    For :math:`i = 1..d_{in}`: round column :math:`i`, then move the columns :math:`F = \{i, \dots\}` by
    :math:`-\frac{w_i - q_i}{[H_F^{-1}]_{11}}\,(H_F^{-1})_{1,\cdot}` with :math:`H_F^{-1}` inverted from the submatrix
    ``H[i:, i:]`` (``torch.linalg.inv``), no Cholesky factor and no blocks: :math:`O(d_{in}^4)`, for small
    layers. Same grid, damping and dead-input rule as :func:`gptq_quantize`, so the two agree to rounding.

    >>> W, H = torch.tensor([[0.3, -0.2, 0.9]]), torch.tensor([[2.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 1.0]])
    >>> torch.allclose(gptq_quantize_naive(W, H, b=2, damp=0.0), gptq_quantize(W, H, b=2, damp=0.0))
    True
    """
    W, Wr, H, g = _gptq_problem(W, H, b, symmetric, damp)
    if W.numel() == 0:
        return W.clone()
    d_in = Wr.shape[1]
    Q = torch.zeros_like(Wr)
    for i in range(d_in):
        Hinv_F = torch.linalg.inv(H[i:, i:])
        Q[:, i:i + 1] = g.fake(Wr[:, i:i + 1])
        Wr[:, i:] -= (Wr[:, i:i + 1] - Q[:, i:i + 1]) / Hinv_F[0, 0] * Hinv_F[0:1, :]
    return restore_half(Q, W.dtype)


# --------------------------------------------------------------------------- 12.06 AWQ


@dataclass(frozen=True)
class AWQResult:
    r"""What :func:`awq_quantize` returns.

    ``W_hat`` :math:`=Q(W\,\mathrm{diag}(s))\,\mathrm{diag}(s)^{-1}` (the effective weight), the chosen
    per-channel scales ``s`` and exponent ``alpha``, the grid ``alphas`` and the objective ``losses`` at each.
    """

    W_hat: Tensor
    s: Tensor
    alpha: float
    alphas: Tensor
    losses: Tensor


@implements("12.06")
def awq_quantize(W: Tensor, X: Tensor, b: int = 4, n_grid: int = 20, symmetric: bool = False) -> AWQResult:
    r"""AWQ: scale salient input channels up before rounding, choosing the scales on calibration inputs.

    .. math:: \min_s\ \big\|Q(W\,\mathrm{diag}(s))\,\mathrm{diag}(s)^{-1}X-WX\big\|_2^2

    Scaling input channel :math:`j` of ``W`` by :math:`s_j > 1` (and its activation by :math:`1/s_j`) leaves
    the product unchanged but divides that channel's relative rounding error by about :math:`s_j`. AWQ
    searches :math:`s = \bar{|x|}^{\alpha}` (:math:`\bar{|x|}_j` the mean magnitude of input channel :math:`j`
    over ``X``, normalised so that :math:`\max s\cdot\min s = 1`) over the grid :math:`\alpha = k/n`,
    ``k = 0..n_grid-1``, and keeps the :math:`\alpha` of smallest mean squared output error (``losses``,
    evaluated through :math:`X^\top X` in float64, so its cost does not grow with ``N``); :math:`\alpha = 0`
    is round-to-nearest. :math:`Q` is the per-row grid of :func:`~llmbook.lm.quantization.per_channel_quantize`.

    ``W`` ``(d_out, d_in)``, ``X`` ``(N, d_in)``. In a deployed model :math:`\mathrm{diag}(s)^{-1}` is folded into
    the preceding norm; here it is folded into ``W_hat``, which computes the same product.

    >>> r = awq_quantize(torch.randn(8, 16), torch.randn(64, 16), b=3, n_grid=4)
    >>> tuple(r.W_hat.shape), r.losses.shape[0]
    ((8, 16), 4)
    """
    W = _matrix(W)
    X = _inputs(X, W)
    b, symmetric = _bits(b), _sym(symmetric)
    n_grid = check_positive_int(n_grid, "n_grid")
    dt = compute_dtype(W.dtype)
    Wc, Xc = W.to(dt), X.to(dt)
    mean_abs = Xc.abs().mean(0) if len(Xc) else torch.ones(W.shape[1], dtype=dt)
    log_m = torch.where(mean_abs > 0, mean_abs, torch.ones_like(mean_abs)).log()
    G = Xc.double().T @ Xc.double()  # mean ||X D^T||^2 = sum((D G) * D) / (N d_out) for D = W_hat - W
    n_out = max(X.shape[0] * W.shape[0], 1)
    alphas = torch.arange(n_grid, dtype=torch.float64) / n_grid
    losses, best = [], None
    for alpha in alphas.tolist():
        log_s = torch.clamp(alpha * log_m, min=math.log(1e-4))  # s = mean|x|^alpha >= 1e-4, in logs:
        s = (log_s - (log_s.amax() + log_s.amin()) / 2).exp() if log_s.numel() else log_s  # max s * min s = 1
        W_hat = _grid(Wc * s, b, symmetric, -1).fake(Wc * s) / s
        D = (W_hat - Wc).double()
        loss = ((D @ G) * D).sum() / n_out
        losses.append(loss)
        if best is None or loss < best[0]:
            best = (loss, W_hat, s, alpha)
    _, W_hat, s, alpha = best
    return AWQResult(restore_half(W_hat, W.dtype), restore_half(s, W.dtype), alpha, alphas, torch.stack(losses))


# --------------------------------------------------------------------------- 12.07 SmoothQuant


@implements("12.07")
def smooth_quant(X: Tensor, W: Tensor, alpha: float = 0.5) -> tuple[Tensor, Tensor, Tensor]:
    r"""SmoothQuant: divide each activation channel by :math:`s_j` and multiply the weights' channel by it.

    .. math:: \hat X = X\,\mathrm{diag}(s)^{-1},\qquad \hat W = \mathrm{diag}(s)\,W,\qquad
              s_j=\frac{\max|X_j|^{\alpha}}{\max|W_j|^{1-\alpha}}

    :math:`\hat X\hat W = XW` exactly (in exact arithmetic): the transform moves difficulty, it does not change
    the layer. Activations of LLMs have a few channels 10-100x larger than the rest, which ruin a per-tensor
    int8 grid; weights do not. With :math:`\alpha=0.5` the channel maxima of :math:`\hat X` and :math:`\hat W`
    become equal, :math:`\sqrt{\max|X_j|\max|W_j|}`. A channel whose activations or weights are all zero
    keeps :math:`s_j=1`.

    ``X`` ``(..., d_in)`` (the maxima run over every token), ``W`` ``(d_out, d_in)`` (so :math:`\mathrm{diag}(s)W`
    of the papers' ``(d_in, d_out)`` layout is ``W * s`` here). Returns ``(X_hat, W_hat, s)``.

    >>> X, W = torch.tensor([[100.0, 1.0]]), torch.tensor([[1.0, 1.0]])
    >>> X_hat, W_hat, s = smooth_quant(X, W)
    >>> s, X_hat, W_hat, (X_hat @ W_hat.T).item()
    (tensor([10.,  1.]), tensor([[10.,  1.]]), tensor([[10.,  1.]]), 101.0)
    """
    W = _matrix(W)
    X = _inputs(X, W, contract="(..., d_in)")
    alpha = check_range(alpha, "alpha", 0.0, 1.0)
    Xc, Wc = upcast_half(X), upcast_half(W)
    ax = Xc.abs().reshape(-1, X.shape[-1]).amax(0) if X.numel() else Xc.new_zeros(X.shape[-1])
    aw = Wc.abs().amax(0) if W.shape[0] else Wc.new_zeros(W.shape[1])
    ok = (ax > 0) & (aw > 0)
    s = torch.where(ok, ax.clamp(min=1e-30).pow(alpha) / aw.clamp(min=1e-30).pow(1 - alpha), torch.ones_like(ax))
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    return restore_half(Xc / s, X.dtype), restore_half(Wc * s, W.dtype), restore_half(s, W.dtype)


# --------------------------------------------------------------------------- 12.08 LLM.int8


@implements("12.08")
def llm_int8_matmul(X: Tensor, W: Tensor, threshold: float = 6.0) -> Tensor:
    r"""LLM.int8(): ``X @ W.T`` with the outlier feature columns in floating point and the rest in int8.

    .. math:: XW = X_{normal}W_{int8}+X_{outlier}W_{fp16}

    A feature column :math:`j` of ``X`` is an outlier when some token has :math:`|X_{t,j}| \ge` ``threshold``
    (6 in the paper); those columns, and the matching columns of ``W``, are multiplied in the input's float
    dtype (``X`` and ``W`` share one dtype). The rest use vector-wise int8: one absmax scale per token (row
    of ``X``) and one per output channel (row of ``W``), an integer matmul (exact: computed in float64 on
    integers), then the outer product of the scales. ``threshold = 0`` puts every column in floating
    point; ``inf`` none.

    ``X`` ``(..., d_in)``, ``W`` ``(d_out, d_in)``; returns ``(..., d_out)`` in the dtype of ``X``.

    >>> X = torch.tensor([[0.5, 20.0], [-1.0, 0.1]]); W = torch.tensor([[1.0, 2.0]])
    >>> llm_int8_matmul(X, W, threshold=6.0)  # column 1 is an outlier: in float
    tensor([[40.5000],
            [-0.8000]])
    """
    W = _matrix(W)
    X = _inputs(X, W, contract="(..., d_in)")
    check_same_dtype(X, W, "X", "W")
    threshold = check_range(threshold, "threshold", 0.0, math.inf, finite=False)
    Xc, Wc = upcast_half(X), upcast_half(W)
    X2 = Xc.reshape(math.prod(X.shape[:-1]), X.shape[-1])
    peak = X2.abs().amax(0) if X2.shape[0] else X2.new_zeros(X.shape[-1])
    out = peak >= threshold
    Y = X2[:, out] @ Wc[:, out].T
    qx, sx = absmax_quantize(X2[:, ~out], 8, dim=-1)
    qw, sw = absmax_quantize(Wc[:, ~out], 8, dim=-1)
    Y_int = (qx.double() @ qw.double().T).to(Y.dtype)
    Y = Y + Y_int * upcast_half(sx) * upcast_half(sw).T
    return restore_half(Y.reshape(*X.shape[:-1], W.shape[0]), X.dtype)


# --------------------------------------------------------------------------- a whole model

#: The weight methods of :func:`quantize_model`.
METHODS = ("rtn", "nf", "gptq", "awq")


@torch.no_grad()
def linear_inputs(model: nn.Module, calib_ids: Tensor) -> dict[str, Tensor]:
    r"""The ``(N, d_in)`` inputs every ``nn.Linear`` of ``model`` receives on ``calib_ids``, by module name.

    One forward pass with hooks (removed afterwards); ``N = B T`` for ``(B, T)`` token ids. These are the
    calibration inputs :math:`X` of GPTQ (:math:`H = 2X^\top X`) and AWQ; ``X @ W.T`` is the layer's output.
    """
    seen: dict[str, Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(
        name, args[0].reshape(-1, args[0].shape[-1]).detach())) for name, m in model.named_modules()
        if isinstance(m, nn.Linear)]
    try:
        model(calib_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "rtn", b: int = 4, calib_ids: Tensor | None = None, *,
                   symmetric: bool = False, block_size: int = 64) -> nn.Module:
    r"""A copy of ``model`` whose ``nn.Linear`` weights are quantised to ``b`` bits (stored dequantised).

    ``method``: ``"rtn"`` round-to-nearest per output channel (:func:`~llmbook.lm.quantization.per_channel_quantize`),
    ``"nf"`` NormalFloat in blocks of ``block_size`` (:func:`~llmbook.lm.nf4.nf4_quantize`; ``b = 4``
    is NF4), ``"gptq"`` (:func:`gptq_quantize`) and ``"awq"`` (:func:`awq_quantize`), both with the per-channel
    grid of ``"rtn"`` and calibration inputs recorded on ``calib_ids`` (``(B, T)`` token ids, required for
    them) in one pass of the unquantised model. Embeddings, norms and a tied LM head stay in float, as in
    GPTQ and AWQ. ``model`` itself is not modified; the copy is in eval mode.

    >>> from llmbook.lm.gpt import GPTConfig, TinyGPT
    >>> m = TinyGPT(GPTConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=2))
    >>> m8 = quantize_model(m, "rtn", b=8)
    >>> (m8.blocks[0].mlp.w_up.weight - m.blocks[0].mlp.w_up.weight).abs().max().item() < 1e-3
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_choice(method, "method", METHODS)
    b, symmetric = _bits(b, high=8), _sym(symmetric)
    block_size = check_int(block_size, "block_size", low=1)
    inputs = {}
    if method in ("gptq", "awq"):
        if calib_ids is None:
            raise ValueError(f"method {method!r} needs calib_ids, (B, T) token ids of calibration text")
        calib_ids = check_integer_tensor(calib_ids, "calib_ids", "a (B, T) tensor of token ids")
        was = model.training
        model.eval()
        inputs = linear_inputs(model, calib_ids)
        model.train(was)
    new = copy.deepcopy(model).eval()
    for name, lin in new.named_modules():
        if not isinstance(lin, nn.Linear):
            continue
        W = lin.weight.detach()
        if method == "rtn":
            W_hat = _grid(W, b, symmetric, -1).fake(W)
        elif method == "nf":
            W_hat = nf4_dequantize(*nf4_quantize(W, block_size, b), block_size=block_size, b=b)
        elif method == "gptq":
            X = inputs[name].double()
            W_hat = gptq_quantize(W, 2 * X.T @ X / len(X), b, symmetric)
        else:
            W_hat = awq_quantize(W, inputs[name], b, symmetric=symmetric).W_hat
        lin.weight.copy_(W_hat.to(W.dtype))
    return new
