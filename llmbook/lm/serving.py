r"""Serving many requests (chapter 17, ids 17.12 and 17.13): paged KV memory and continuous batching.

**Paged KV memory** (PagedAttention, Kwon et al., 2023). A static cache reserves ``S_max`` tokens for
every sequence, although most stop far earlier. vLLM instead cuts the cache into fixed *blocks* of
``block_size`` tokens, hands a sequence a new block only when its last one is full, and keeps a *block
table* from the sequence's logical blocks to physical ones, like pages of virtual memory. What is
reserved is

.. math:: M_{alloc} = N_{blocks} \cdot \mathit{block\_size} \cdot H_{kv} \cdot d_h \cdot 2 \cdot \mathrm{bytes}

per layer (:func:`paged_kv_bytes`), and at most ``block_size - 1`` slots per sequence are wasted.
:class:`PagedKVAllocator` is such an allocator with a real tensor pool; :class:`PagedSequenceCache`
lets :func:`llmbook.lm.kv_cache.forward_cached` decode through it.

**Continuous batching** (Orca, Yu et al., 2022). A server runs one decode step for every sequence in
its batch at a time. Static batching admits a new batch only when the whole previous one has finished,
so slots of short requests idle while the longest one runs; continuous (iteration-level) batching
refills a slot the step after its request finishes. The utilisation of the ``B_max`` slots is

.. math:: U = \frac{\sum_i \mathit{tokens}_i}{B_{max} \cdot \mathit{steps}}

(:func:`batching_utilization`); :func:`simulate_batching` runs the step-by-step schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmbook._checks import check_choice, check_int, check_nonnegative_int, check_positive_int, check_range
from llmbook.registry import implements

__all__ = ["paged_kv_bytes", "blocks_needed", "PagedKVAllocator", "PagedSequenceCache", "batching_utilization",
           "BatchingRun", "simulate_batching"]


# --------------------------------------------------------------------------- 17.12 paged KV memory


@implements("17.12")
def paged_kv_bytes(N_blocks: int, block_size: int, H_kv: int, d_h: int, bytes_per_elem: float = 2,
                   n_layers: int = 1) -> float:
    r"""Memory of ``N_blocks`` KV blocks of ``block_size`` tokens each.

    .. math:: M_{alloc} = N_{blocks} \cdot block\_size \cdot H_{kv} \cdot d_h \cdot 2 \cdot bytes

    Per layer, as the catalogue writes it; ``n_layers`` multiplies (vLLM allocates one block id across all
    layers). A sequence of :math:`S` tokens needs :func:`blocks_needed` :math:`= \lceil S / block\_size\rceil`
    blocks, so it wastes fewer than ``block_size`` slots, against :math:`S_{max} - S` in a static cache.

    >>> paged_kv_bytes(1, 16, 32, 128, n_layers=32) // 1024   # one 16-token block of Llama-2-7B in fp16: KiB
    8192
    """
    N_blocks, block_size = check_nonnegative_int(N_blocks, "N_blocks"), check_positive_int(block_size, "block_size")
    H_kv, d_h = check_positive_int(H_kv, "H_kv"), check_positive_int(d_h, "d_h")
    n_layers = check_nonnegative_int(n_layers, "n_layers")
    b = check_range(bytes_per_elem, "bytes_per_elem", 0.0, low_open=True)
    return N_blocks * block_size * H_kv * d_h * 2 * n_layers * (int(b) if float(b).is_integer() else b)


def blocks_needed(S: int, block_size: int) -> int:
    r""":math:`\lceil S / block\_size \rceil`: the blocks a sequence of ``S`` tokens occupies.

    >>> blocks_needed(33, 16)
    3
    """
    S, block_size = check_nonnegative_int(S, "S"), check_positive_int(block_size, "block_size")
    return -(-S // block_size)


class PagedKVAllocator:
    r"""A paged KV cache: a pool of ``num_blocks`` physical blocks and a block table per sequence.

    The pool holds real tensors, keys and values of shape ``(n_layers, num_blocks, block_size, H_kv, d_h)``.
    :meth:`append` grows a sequence by ``n`` tokens and takes a block from the free list only when its
    last block is full; :meth:`free` returns all of a sequence's blocks. :meth:`write` stores keys and
    values at a sequence's logical positions through its block table, and :meth:`gather` reads them back
    in order. :meth:`allocated_bytes` is :func:`paged_kv_bytes` of the blocks in use (per layer times
    ``n_layers``); :meth:`wasted_slots` counts reserved but unfilled token slots.

    >>> pool = PagedKVAllocator(num_blocks=8, block_size=4, n_layers=1, H_kv=2, d_h=4)
    >>> pool.append("a", 5); pool.append("b", 2)
    >>> pool.block_table("a"), pool.block_table("b"), pool.wasted_slots()
    ([0, 1], [2], 5)
    """

    def __init__(self, num_blocks: int, block_size: int, n_layers: int, H_kv: int, d_h: int,
                 dtype: torch.dtype = torch.float32, device=None):
        self.num_blocks = check_positive_int(num_blocks, "num_blocks")
        self.block_size = check_positive_int(block_size, "block_size")
        self.n_layers = check_positive_int(n_layers, "n_layers")
        self.H_kv, self.d_h = check_positive_int(H_kv, "H_kv"), check_positive_int(d_h, "d_h")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        shape = (self.n_layers, self.num_blocks, self.block_size, self.H_kv, self.d_h)
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(self.num_blocks))  # lowest id first
        self._tables: dict = {}
        self._lengths: dict = {}

    # ---- bookkeeping
    @property
    def num_free(self) -> int:
        return len(self._free)

    def sequences(self) -> list:
        return list(self._tables)

    def length(self, seq) -> int:
        return self._lengths[self._known(seq)]

    def block_table(self, seq) -> list[int]:
        """The physical block ids of ``seq``, in logical order."""
        return list(self._tables[self._known(seq)])

    def _known(self, seq):
        if seq not in self._tables:
            raise ValueError(f"unknown sequence {seq!r}; known: {list(self._tables)}")
        return seq

    def can_append(self, seq, n: int) -> bool:
        """Whether ``n`` more tokens for ``seq`` (new or known) fit in the free blocks."""
        S = self._lengths.get(seq, 0)
        have = len(self._tables.get(seq, ()))
        return blocks_needed(S + check_nonnegative_int(n, "n"), self.block_size) - have <= self.num_free

    def append(self, seq, n: int) -> None:
        """Grow ``seq`` (created if new) by ``n`` tokens, taking blocks from the free list as needed."""
        n = check_nonnegative_int(n, "n")
        if not self.can_append(seq, n):
            raise ValueError(f"out of KV blocks: {seq!r} needs more than the {self.num_free} free blocks")
        table = self._tables.setdefault(seq, [])
        self._lengths[seq] = self._lengths.get(seq, 0) + n
        while len(table) < blocks_needed(self._lengths[seq], self.block_size):
            table.append(self._free.pop(0))

    def free(self, seq) -> None:
        """Return every block of ``seq`` to the free list and forget the sequence."""
        self._free.extend(self._tables.pop(self._known(seq)))
        self._free.sort()
        del self._lengths[seq]

    def allocated_blocks(self) -> int:
        return self.num_blocks - self.num_free

    def allocated_bytes(self) -> int:
        """Bytes of the pool's blocks in use, counted on the real tensors (keys and values, all layers)."""
        used = [b for t in self._tables.values() for b in t]
        return sum(p[:, used].numel() * p.element_size() for p in (self.k_pool, self.v_pool))

    def wasted_slots(self) -> int:
        """Token slots reserved in allocated blocks but not filled (internal fragmentation)."""
        return self.allocated_blocks() * self.block_size - sum(self._lengths.values())

    # ---- data
    def _slots(self, seq, start: int, n: int) -> tuple[Tensor, Tensor]:
        pos = torch.arange(start, start + n)
        table = torch.tensor(self._tables[seq], dtype=torch.long)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, seq, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Store ``k, v (n, H_kv, d_h)`` at logical positions ``start .. start + n - 1`` of ``seq`` in ``layer``."""
        layer = check_int(layer, "layer", low=0, high=self.n_layers - 1)
        n = k.shape[0]
        if k.shape != v.shape or tuple(k.shape[1:]) != (self.H_kv, self.d_h):
            raise ValueError(f"k and v must have shape (n, H_kv, d_h) = (n, {self.H_kv}, {self.d_h}), "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if start + n > self.length(seq):
            raise ValueError(f"positions {start}..{start + n - 1} lie beyond the {self.length(seq)} tokens of {seq!r}")
        blocks, offsets = self._slots(seq, start, n)
        self.k_pool[layer, blocks, offsets] = k
        self.v_pool[layer, blocks, offsets] = v

    def gather(self, seq, layer: int, end: int | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values of positions ``0 .. end - 1`` of ``seq`` in ``layer``, in order: ``(S, H_kv, d_h)`` each."""
        end = self.length(seq) if end is None else end
        blocks, offsets = self._slots(seq, 0, end)
        return self.k_pool[layer, blocks, offsets], self.v_pool[layer, blocks, offsets]


class PagedSequenceCache:
    """One sequence of a :class:`PagedKVAllocator`, with the interface of :class:`~llmbook.lm.kv_cache.KVCache`.

    :func:`llmbook.lm.kv_cache.forward_cached` can then decode the sequence (``B = 1``) through the
    block table: each layer's new keys and values are written into the sequence's blocks and all of its
    keys and values gathered back for attention.
    """

    def __init__(self, allocator: PagedKVAllocator, seq):
        if not isinstance(allocator, PagedKVAllocator):
            raise TypeError(f"allocator must be a PagedKVAllocator, got {type(allocator).__name__}")
        self.allocator, self.seq, self.length = allocator, seq, 0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if k.ndim != 4 or k.shape[0] != 1:
            raise ValueError(f"a paged sequence holds one sequence: k must be (1, H_kv, T, d_h), got {tuple(k.shape)}")
        T, pool = k.shape[2], self.allocator
        if layer == 0:  # the first layer reserves the slots of the new tokens (for every layer at once)
            pool.append(self.seq, T)
        pool.write(self.seq, layer, self.length, k[0].transpose(0, 1), v[0].transpose(0, 1))
        K, V = pool.gather(self.seq, layer, self.length + T)
        return K.transpose(0, 1).unsqueeze(0), V.transpose(0, 1).unsqueeze(0)

    def advance(self, T: int) -> None:
        self.length += check_nonnegative_int(T, "T")


# --------------------------------------------------------------------------- 17.13 continuous batching


@implements("17.13")
def batching_utilization(tokens, B_max: int, steps: int) -> float:
    r"""Effective utilisation of the batch slots: :math:`U = \sum_i \mathit{tokens}_i / (B_{max} \cdot \mathit{steps})`.

    ``tokens``: the tokens each request produced (a sequence of non-negative ints); ``B_max`` the batch
    slots; ``steps`` the decode steps the server ran. Each step produces one token per occupied slot, so
    :math:`U` is the fraction of slot-steps that did useful work (1 = never an idle slot).

    >>> batching_utilization([3, 10, 4, 7], B_max=2, steps=14)   # continuous: 24 tokens in 14 steps
    0.8571428571428571
    """
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise TypeError(f"tokens must be a sequence of ints (tokens per request), got {type(tokens).__name__}")
    tokens = [t.item() if isinstance(t, Tensor) and t.ndim == 0 else t for t in tokens]
    total = sum(check_nonnegative_int(t, "tokens[i]") for t in tokens)
    B_max, steps = check_positive_int(B_max, "B_max"), check_positive_int(steps, "steps")
    if total > B_max * steps:
        raise ValueError(f"{total} tokens cannot come out of {steps} steps of {B_max} slots (at most {B_max * steps})")
    return total / (B_max * steps)


@dataclass(frozen=True)
class BatchingRun:
    """A schedule: per request its ``admit`` step, ``finish`` step (exclusive); per step the ``occupancy``
    and the requests ``emitted`` that produced a token in it (the token timeline)."""

    admit: list[int]
    finish: list[int]
    occupancy: list[int]
    emitted: list[tuple[int, ...]]

    @property
    def steps(self) -> int:
        return len(self.occupancy)


def simulate_batching(lengths, B_max: int, arrivals=None, policy: str = "continuous") -> BatchingRun:
    r"""Run a batch scheduler step by step: request ``i`` needs ``lengths[i]`` decode steps (one token each).

    At the start of each step free slots are filled, first come first served, with requests that have
    arrived (``arrivals[i]``, a step number; default all at step 0). ``policy="continuous"`` refills a
    slot as soon as its request has finished (Orca's iteration-level scheduling); ``"static"`` admits
    only when every slot is free. A request admitted at step :math:`a` emits its first token in step
    :math:`a` (its prefill) and its last in step :math:`a + n_i - 1`. Steps with nothing to run still
    count while requests are yet to arrive.

    >>> run = simulate_batching([3, 10, 4, 7], B_max=2, policy="static")
    >>> run.steps, run.admit
    (17, [0, 0, 10, 10])
    """
    lengths = [check_positive_int(n, "lengths[i]") for n in lengths]
    B_max = check_positive_int(B_max, "B_max")
    check_choice(policy, "policy", ("continuous", "static"))
    arrivals = [0] * len(lengths) if arrivals is None else [check_nonnegative_int(a, "arrivals[i]") for a in arrivals]
    if len(arrivals) != len(lengths):
        raise ValueError(f"arrivals ({len(arrivals)}) and lengths ({len(lengths)}) must have one entry per request")
    order = sorted(range(len(lengths)), key=lambda i: (arrivals[i], i))
    admit, finish = [-1] * len(lengths), [-1] * len(lengths)
    running: dict[int, int] = {}  # request -> steps left
    occupancy, emitted, queue, step = [], [], 0, 0
    while queue < len(order) or running:
        if policy == "continuous" or not running:
            while len(running) < B_max and queue < len(order) and arrivals[order[queue]] <= step:
                i = order[queue]
                admit[i], running[i], queue = step, lengths[i], queue + 1
        occupancy.append(len(running))
        emitted.append(tuple(sorted(running)))  # every running request emits one token this step
        for i in list(running):
            running[i] -= 1
            if running[i] == 0:
                del running[i]
                finish[i] = step + 1
        step += 1
    return BatchingRun(admit, finish, occupancy, emitted)
