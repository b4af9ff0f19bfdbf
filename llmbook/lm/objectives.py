r"""Language-modelling objectives (chapter 7): masked LM (BERT), causal LM (GPT) and span corruption (T5).

All three are the same cross-entropy, :func:`llmbook.lm.probability.cross_entropy_loss`, over different
choices of *which* tokens are predicted from *what*:

* masked LM: a random 15 % of the tokens, from the sequence with those tokens hidden (:func:`mlm_mask`);
* causal LM: every token, from the tokens before it (the labels are the inputs shifted by one);
* span corruption: whole spans of tokens, each replaced by one sentinel in the encoder's input and
  spelled out after its sentinel in the decoder's target (:func:`random_spans_noise_mask`,
  :func:`span_corruption`).

Labels follow ``transformers``: the value ``ignore_index`` (``-100``) marks a position that is not
predicted. Shapes: ``B`` batch, ``T`` positions, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_int,
    check_integer_tensor,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_same_shape,
    check_token_ids,
    check_unit_interval,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.losses import REDUCTIONS, reduce_loss
from llmbook.lm.probability import cross_entropy_loss
from llmbook.registry import implements

__all__ = [
    "masked_lm_loss",
    "causal_lm_loss",
    "mlm_mask",
    "random_spans_noise_mask",
    "span_corruption",
    "span_corruption_loss",
]


def _token_loss(logits, labels, ignore_index, reduction, num_items_in_batch, shift: bool) -> Tensor:
    """Cross-entropy of ``logits`` ``(..., T, V)`` at ``labels`` ``(..., T)`` (shifted by one for causal LM)."""
    z = as_tensor(logits, "logits")
    check_dim(z, "logits", "(..., T, V)", min_dim=2)
    y = check_integer_tensor(labels, "labels", "an integer tensor of token ids").long()
    if z.shape[:-1] != y.shape:
        raise ValueError(f"logits (..., T, V) = {tuple(z.shape)} and labels (..., T) = {tuple(y.shape)} "
                         "disagree on (..., T)")
    ignore_index = check_int(ignore_index, "ignore_index")
    check_choice(reduction, "reduction", REDUCTIONS)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch) and num_items_in_batch.ndim == 0 \
                and not num_items_in_batch.is_floating_point():
            num_items_in_batch = num_items_in_batch.item()
        num_items_in_batch = check_positive_int(num_items_in_batch, "num_items_in_batch")
        if reduction != "mean":
            raise ValueError(f"num_items_in_batch replaces the count of a 'mean', got reduction={reduction!r}")
    dtype = z.dtype
    z = upcast_half(z)
    if shift:  # position t predicts token t + 1: drop the last prediction and the first label
        z, y = z[..., :-1, :], y[..., 1:]
    loss = cross_entropy_loss(z, y, reduction="none", ignore_index=ignore_index)
    if num_items_in_batch is not None:
        return restore_half(loss.sum() / num_items_in_batch, dtype)
    return restore_half(reduce_loss(loss, y != ignore_index, reduction, "labelled token"), dtype)


@implements("07.06")
def masked_lm_loss(logits: Float[Tensor, "... T V"], labels: Int[Tensor, "... T"], ignore_index: int = -100,
                   reduction: str = "mean", num_items_in_batch: int | None = None) -> Tensor:
    r"""Masked language modelling (BERT): :math:`L_{MLM}=-\sum_{i\in M}\log p_\theta(x_i \mid x_{\setminus M})`.

    ``logits[..., i, :]`` is the model's prediction at position ``i`` of the *corrupted* input
    :math:`x_{\setminus M}`; ``labels[..., i]`` is the original token :math:`x_i` where ``i`` is in the
    masked set :math:`M` and ``ignore_index`` elsewhere (what :func:`mlm_mask` returns). No shift: each
    position predicts its own token. ``reduction="sum"`` is the equation, ``"mean"`` (the default, as
    ``transformers``' ``ForMaskedLMLoss``) divides by :math:`|M|`, or by ``num_items_in_batch`` when given
    (the masked tokens of a whole gradient-accumulation batch). Shapes ``(..., T, V), (..., T) -> ()``.

    >>> labels = torch.tensor([[-100, 2, -100]])  # only position 1 was masked
    >>> round(masked_lm_loss(torch.zeros(1, 3, 4), labels).item(), 4)  # log 4
    1.3863
    """
    return _token_loss(logits, labels, ignore_index, reduction, num_items_in_batch, shift=False)


@implements("07.07")
def causal_lm_loss(logits: Float[Tensor, "... T V"], labels: Int[Tensor, "... T"], ignore_index: int = -100,
                   reduction: str = "mean", num_items_in_batch: int | None = None) -> Tensor:
    r"""Causal language modelling (GPT): :math:`L_{CLM}=-\sum_{t}\log p_\theta(x_t \mid x_{1:t-1})`.

    ``labels`` are aligned with the *inputs* (usually ``labels = input_ids``, with ``ignore_index`` at
    padding or prompt tokens): the shift happens here, as in ``transformers``' ``ForCausalLMLoss``, so
    ``logits[..., t, :]`` is scored against ``labels[..., t + 1]`` and the last logits predict nothing.
    ``reduction="sum"`` is the equation; ``"mean"`` (default) divides by the number of labelled targets,
    or by ``num_items_in_batch``. Shapes ``(..., T, V), (..., T) -> ()`` (``"none"``: ``(..., T - 1)``).

    >>> ids = torch.tensor([[0, 1, 2]])
    >>> round(causal_lm_loss(torch.zeros(1, 3, 4), ids).item(), 4)  # two predictions, each log 4
    1.3863
    """
    return _token_loss(logits, labels, ignore_index, reduction, num_items_in_batch, shift=True)


def mlm_mask(ids: Int[Tensor, "..."], mask_id: int, V: int, p: float = 0.15, generator: torch.Generator | None = None,
             special: Bool[Tensor, "..."] | None = None, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    r"""BERT's corruption: pick each token with probability ``p``; of those, 80 % become ``mask_id``,
    10 % a random token of ``[0, V)`` and 10 % stay unchanged (the model cannot trust what it sees).

    Returns ``(inputs, labels)``: the corrupted ids and the labels of :func:`masked_lm_loss` (the original
    id at picked positions, ``ignore_index`` elsewhere). ``special`` (bool, like ``ids``) marks tokens never
    picked (``[CLS]``, ``[SEP]``, padding). The same scheme as ``transformers``'
    ``DataCollatorForLanguageModeling``. Shapes ``(...) -> (...), (...)``.

    >>> inputs, labels = mlm_mask(torch.arange(8), mask_id=99, V=100, p=1.0, generator=torch.Generator().manual_seed(0))
    >>> labels.tolist() == list(range(8)), int((inputs == 99).sum()) >= 4
    (True, True)
    """
    V = check_positive_int(V, "V")
    ids = check_token_ids(ids, V, "ids")
    mask_id = check_nonnegative_int(mask_id, "mask_id")
    p = check_unit_interval(p, "p")
    ignore_index = check_int(ignore_index, "ignore_index")
    u = torch.rand((2, *ids.shape), generator=generator, dtype=torch.float64)
    picked = u[0] < p
    if special is not None:
        special = as_tensor(special, "special", floating=False)
        if special.dtype != torch.bool:
            raise TypeError(f"special must be a bool mask (True = never masked), got dtype {special.dtype}")
        check_same_shape(special, ids, "special", "ids")
        picked &= ~special
    labels = torch.where(picked, ids, torch.full_like(ids, ignore_index))
    random_ids = torch.randint(0, V, ids.shape, generator=generator)
    inputs = torch.where(picked & (u[1] < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(picked & (u[1] >= 0.8) & (u[1] < 0.9), random_ids, inputs)
    return inputs, labels


def _random_segmentation(n: int, k: int, generator) -> Tensor:
    """Lengths of ``k`` non-empty segments of ``n`` items, uniform over the compositions (T5's segmentation)."""
    first = torch.zeros(n, dtype=torch.long)
    first[torch.randperm(n - 1, generator=generator)[: k - 1] + 1] = 1  # k - 1 of the n - 1 gaps start a segment
    return torch.bincount(first.cumsum(0), minlength=k)


def random_spans_noise_mask(length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                            generator: torch.Generator | None = None) -> Bool[Tensor, " length"]:
    r"""T5's noise mask: ``round(length * noise_density)`` noise tokens in spans of mean ``mean_noise_span_length``.

    As ``random_spans_noise_mask`` of T5: the counts are fixed, :math:`n = \mathrm{round}(L\,d)` noise tokens
    (at least 1, at most :math:`L-1`) in :math:`k = \max(1, \mathrm{round}(n/\mu))` spans; the noise tokens
    and the :math:`L - n` others are each cut into :math:`k` non-empty spans uniformly at random, and the
    spans alternate, starting with a non-noise span (so position 0 is never noise). Deviation: :math:`k`
    is capped at :math:`L - n` where T5 would fail. ``length = 0`` or density 0 gives no noise.

    >>> m = random_spans_noise_mask(100, generator=torch.Generator().manual_seed(0))
    >>> int(m.sum()), int((m[1:] & ~m[:-1]).sum())  # 15 noise tokens in round(15 / 3) = 5 spans
    (15, 5)
    """
    length = check_nonnegative_int(length, "length")
    noise_density = check_unit_interval(noise_density, "noise_density")
    mean_noise_span_length = check_range(mean_noise_span_length, "mean_noise_span_length", 1.0)
    if length == 0 or noise_density == 0:
        return torch.zeros(length, dtype=torch.bool)
    L = max(length, 2)
    n_noise = min(max(round(L * noise_density), 1), L - 1)
    k = min(max(round(n_noise / mean_noise_span_length), 1), L - n_noise)
    spans = torch.stack([_random_segmentation(L - n_noise, k, generator), _random_segmentation(n_noise, k, generator)],
                        dim=1).reshape(-1)  # non-noise, noise, non-noise, ...
    span_start = torch.zeros(L, dtype=torch.long)
    span_start[spans.cumsum(0)[:-1]] = 1
    return (span_start.cumsum(0) % 2 == 1)[:length]  # odd-numbered spans are noise


def _sentinels(tokens: Tensor, noise: Tensor, sentinel_start: int) -> Tensor:
    """T5's ``noise_span_to_unique_sentinel``: each noise span becomes one sentinel, ``sentinel_start - j``."""
    prev = torch.cat([noise.new_zeros(1), noise[:-1]])
    first = noise & ~prev
    sentinel = sentinel_start + 1 - first.long().cumsum(0)
    return torch.where(first, sentinel, tokens)[~(noise & prev)]


def span_corruption(ids: Int[Tensor, "... L"], noise_mask: Bool[Tensor, "... L"], sentinel_start: int,
                    eos_id: int | None = None) -> tuple[Tensor, Tensor]:
    r"""T5's input and target: noise spans become sentinels in the input and are spelled out in the target.

    The :math:`j`-th noise span of ``ids`` is replaced by the sentinel ``sentinel_start - j`` in the input
    :math:`\tilde x` (T5's ``<extra_id_j>`` is ``32099 - j``); the target :math:`y` lists each sentinel
    followed by the tokens it hid (the non-noise spans become the sentinels there). ``eos_id`` is appended
    to both. ``ids`` ``(L,)`` or ``(B, L)`` with ``noise_mask`` of the same shape; the rows of a batch must
    give equal lengths (masks of :func:`random_spans_noise_mask` for one ``L`` always do).

    >>> ids, noise = torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([0, 1, 1, 0, 1, 0]).bool()
    >>> span_corruption(ids, noise, sentinel_start=99)
    (tensor([10, 99, 13, 98, 15]), tensor([99, 11, 12, 98, 14, 97]))
    """
    ids = check_integer_tensor(ids, "ids", "an integer tensor of token ids").long()
    check_dim(ids, "ids", "(L,) or (B, L)", max_dim=2)
    if ids.numel() and ids.min() < 0:
        raise ValueError(f"ids must be non-negative token ids, got {ids.min().item()}")
    noise_mask = as_tensor(noise_mask, "noise_mask", floating=False)
    if noise_mask.dtype != torch.bool:
        raise TypeError(f"noise_mask must be a bool mask (True = noise), got dtype {noise_mask.dtype}")
    check_same_shape(noise_mask, ids, "noise_mask", "ids")
    sentinel_start = check_nonnegative_int(sentinel_start, "sentinel_start")
    if eos_id is not None:
        eos_id = check_nonnegative_int(eos_id, "eos_id")
    rows_ids, rows_mask = (ids, noise_mask) if ids.ndim == 2 else (ids[None], noise_mask[None])
    outs = []
    for part in (rows_mask, ~rows_mask):  # the input hides the noise, the target hides the rest
        starts = part & ~torch.cat([torch.zeros_like(part[:, :1]), part[:, :-1]], dim=1)
        spans = int(starts.sum(-1).max()) if starts.numel() else 0
        if spans > sentinel_start + 1:
            raise ValueError(f"{spans} spans need the sentinels sentinel_start - j for j < {spans}: sentinel_start "
                             f"must be at least {spans - 1}, got {sentinel_start}")
        rows = [_sentinels(t, m, sentinel_start) for t, m in zip(rows_ids, part, strict=True)]
        if len({len(r) for r in rows}) > 1:
            raise ValueError("the rows of noise_mask give inputs or targets of different lengths; "
                             "corrupt them one at a time")
        out = torch.stack(rows) if rows else rows_ids[:, :0]
        if eos_id is not None:
            out = torch.cat([out, torch.full((out.shape[0], 1), eos_id)], dim=1)
        outs.append(out if ids.ndim == 2 else out[0])
    return outs[0], outs[1]


@implements("07.08")
def span_corruption_loss(model: Callable[[Tensor, Tensor], Tensor], ids: Int[Tensor, "B L"],
                         noise_mask: Bool[Tensor, "B L"], sentinel_start: int, eos_id: int | None = None,
                         decoder_start_id: int = 0, reduction: str = "mean") -> Tensor:
    r"""T5's span-corruption objective :math:`L_{span}=-\sum_{t}\log p_\theta(y_t \mid y_{1:t-1},\tilde{x})`.

    Builds :math:`(\tilde x, y)` with :func:`span_corruption`, feeds the decoder the target shifted right
    (``decoder_start_id`` first, T5's pad id 0) and scores every target token by teacher forcing.
    ``model(x_tilde, y_in)`` maps encoder ids ``(B, S)`` and decoder ids ``(B, U)`` to logits ``(B, U, V)``
    (for ``transformers``' T5: ``lambda x, y: t5(input_ids=x, decoder_input_ids=y).logits``).
    ``"mean"`` (default, as T5's ``labels=`` loss) averages over the :math:`U` target tokens; ``"sum"`` is
    the equation. Shapes ``(B, L), (B, L) -> ()``.
    """
    ids = check_integer_tensor(ids, "ids", "an integer tensor of token ids")
    check_dim(ids, "ids", "(B, L)", min_dim=2, max_dim=2)
    decoder_start_id = check_nonnegative_int(decoder_start_id, "decoder_start_id")
    check_choice(reduction, "reduction", REDUCTIONS)
    x_tilde, y = span_corruption(ids, noise_mask, sentinel_start, eos_id)
    if y.numel() == 0:
        raise ValueError(f"nothing to predict: the batch of shape {tuple(ids.shape)} gives an empty target")
    y_in = torch.cat([torch.full_like(y[:, :1], decoder_start_id), y[:, :-1]], dim=1)
    logits = model(x_tilde, y_in)
    if not torch.is_tensor(logits) or logits.ndim != 3 or logits.shape[:2] != y.shape:
        raise ValueError(f"model must return logits of shape (B, U, V) = ({y.shape[0]}, {y.shape[1]}, V), got "
                         f"{tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__}")
    return restore_half(cross_entropy_loss(upcast_half(logits), y, reduction=reduction, ignore_index=None),
                        logits.dtype)
