r"""Training memory: bytes per parameter, ZeRO sharding, and a real sharded optimiser on ``torch.distributed``.

**Accounting.** Mixed-precision training with Adam keeps, for each of the :math:`\Psi` parameters,
the bf16 weights (2 bytes) and gradients (2 bytes) that the forward and backward passes use, plus
:math:`K = 12` bytes of fp32 optimiser state: a master copy of the weights (4), Adam's first moment
:math:`m` (4) and second moment :math:`v` (4). That is

.. math:: M = (2 + 2 + K)\,\Psi = 16\,\Psi \text{ bytes},

so a 70B model needs :math:`1.12 \times 10^{12}` bytes (about 1.1 TB) of training state before a
single activation is stored (:func:`training_bytes`). ZeRO (Rajbhandari et al., 2020) shards these
parts over :math:`N_d` data-parallel devices (:func:`zero_bytes_per_device`):

.. math::
    M_1 = 2\Psi + 2\Psi + \frac{K\Psi}{N_d}, \qquad
    M_2 = 2\Psi + \frac{(2 + K)\Psi}{N_d}, \qquad
    M_3 = \frac{(2 + 2 + K)\Psi}{N_d} = \frac{16\Psi}{N_d}

(stage 1 shards the optimiser state, stage 2 also the gradients, stage 3 also the weights).

**Measurement.** :func:`measure_training_bytes` adds up the ``nbytes`` of the tensors a training step
really holds (weights, gradients, master copies, every tensor in ``optimizer.state``), and
:class:`MixedPrecisionAdamW` is the 16-byte recipe as running code: bf16 model, fp32 master weights and
moments. :func:`zero_memory_demo` trains with :class:`torch.distributed.optim.ZeroRedundancyOptimizer`
(ZeRO stage 1) on ``N_d`` CPU processes (gloo backend, 127.0.0.1) and reports the optimiser-state
bytes each rank holds: about :math:`1/N_d` of the single-process state.

**Scaling out.** The same data-parallel code runs on many GPUs. Put the loop of
:func:`zero_memory_demo`'s worker in a ``train.py`` that calls
``torch.distributed.init_process_group("nccl")`` (NCCL is the GPU backend; ``torchrun`` sets
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``), moves the model to
``cuda:LOCAL_RANK``, and launch one process per GPU::

    torchrun --nproc_per_node=8 train.py                      # one node, 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
             --rdzv_endpoint=HOST:29500 train.py              # two nodes

The production form of ZeRO-3 in PyTorch is FSDP2: ``from torch.distributed.fsdp import fully_shard``,
then ``fully_shard(block)`` for every transformer block and ``fully_shard(model)`` for the root; each
rank then stores :math:`1/N_d` of the weights, gradients and optimiser state (:math:`16\Psi/N_d`) and
gathers a block's weights only while it computes. (DeepSpeed's ZeRO stages 1-3 are the other common
implementation.)

>>> training_bytes(70e9).total / 1e12   # 16 bytes per parameter for a 70B model, in TB
1.12
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmbook._checks import check_choice, check_nonnegative_int, check_positive_int, check_range
from llmbook.lm.data_parallel import DataParallel, ShardedOptimizer, launch
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.optim import AdamW
from llmbook.lm.probability import cross_entropy_loss

__all__ = ["TrainingBytes", "training_bytes", "zero_bytes_per_device", "tensor_bytes", "optimizer_state_bytes",
           "measure_training_bytes", "MixedPrecisionAdamW", "zero_memory_demo", "data_parallel_demo"]


@dataclass(frozen=True)
class TrainingBytes:
    """Bytes of training state, by part; ``total`` adds them up.

    ``weights`` and ``grads`` are those the model computes with (bf16 in mixed precision), ``master`` the
    fp32 master weights, ``optimizer_state`` the optimiser's per-parameter state (Adam's ``m`` and ``v``),
    ``bookkeeping`` the optimiser's other tensors (e.g. torch's per-tensor ``step`` counters: a few
    bytes per tensor, not per parameter; zero in the formulas).
    """

    weights: float
    grads: float
    master: float
    optimizer_state: float
    bookkeeping: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.optimizer_state + self.bookkeeping


def training_bytes(n_params, *, weight_bytes: float = 2, grad_bytes: float = 2, master_bytes: float = 4,
                   state_bytes: float = 8) -> TrainingBytes:
    r"""Bytes of training state for :math:`\Psi` = ``n_params``: :math:`(2 + 2 + 4 + 8)\Psi = 16\Psi` by default.

    The defaults are mixed-precision Adam: bf16 ``weight_bytes`` and ``grad_bytes``, fp32 ``master_bytes``
    and ``state_bytes = 8`` for Adam's two fp32 moments. Plain fp32 Adam is ``weight_bytes=4,
    grad_bytes=4, master_bytes=0`` (16 bytes too); SGD with momentum in fp32 has ``state_bytes=4``.

    >>> tb = training_bytes(1000)
    >>> tb.weights, tb.grads, tb.master, tb.optimizer_state, tb.total
    (2000.0, 2000.0, 4000.0, 8000.0, 16000.0)
    """
    Psi = float(check_range(n_params, "n_params (Psi)", 0.0))
    for name, b in (("weight_bytes", weight_bytes), ("grad_bytes", grad_bytes), ("master_bytes", master_bytes),
                    ("state_bytes", state_bytes)):
        check_range(b, name, 0.0)
    return TrainingBytes(weight_bytes * Psi, grad_bytes * Psi, master_bytes * Psi, state_bytes * Psi)


def zero_bytes_per_device(n_params, N_d: int, stage: int, **bytes_per_param) -> TrainingBytes:
    r"""Bytes of training state per device under ZeRO ``stage`` (0-3) with ``N_d`` data-parallel devices.

    Stage 0 is plain data parallelism (every device holds all :math:`16\Psi`); stage 1 divides the
    optimiser state (master weights and moments, :math:`K\Psi`) by :math:`N_d`, stage 2 also the
    gradients, stage 3 also the weights: :math:`16\Psi / N_d`. ``bytes_per_param`` is passed to
    :func:`training_bytes` (mixed-precision Adam by default). The ZeRO paper's Figure 1 example,
    :math:`\Psi = 7.5` B on :math:`N_d = 64` devices:

    >>> [round(zero_bytes_per_device(7.5e9, 64, s).total / 1e9, 1) for s in range(4)]  # GB
    [120.0, 31.4, 16.6, 1.9]
    """
    N_d = check_positive_int(N_d, "N_d (data-parallel devices)")
    check_choice(stage, "stage (ZeRO stage)", (0, 1, 2, 3))
    full = training_bytes(n_params, **bytes_per_param)
    shard = [1.0, 1.0, 1.0, 1.0]  # divisors of weights, grads, master, optimizer_state
    if stage >= 1:
        shard[2] = shard[3] = N_d
    if stage >= 2:
        shard[1] = N_d
    if stage >= 3:
        shard[0] = N_d
    return TrainingBytes(full.weights / shard[0], full.grads / shard[1], full.master / shard[2],
                         full.optimizer_state / shard[3])


def _unique(tensors) -> list[Tensor]:
    """Tensors with distinct storage (a tied weight counts once)."""
    seen, out = set(), []
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def tensor_bytes(tensors) -> int:
    """Sum of ``nbytes`` of distinct tensors (``None`` entries are skipped; a shared tensor counts once)."""
    return sum(t.nbytes for t in _unique(t for t in tensors if t is not None))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """``(per_parameter, bookkeeping)`` bytes of the tensors in ``optimizer.state``.

    A state tensor with as many elements as its parameter (Adam's ``exp_avg`` and ``exp_avg_sq``,
    a momentum buffer) counts as per-parameter state; any other tensor (a scalar ``step``) as bookkeeping.
    """
    per_param, other = [], []
    for p, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, Tensor):
                (per_param if value.numel() == p.numel() else other).append(value)
    return tensor_bytes(per_param), tensor_bytes(other)


def measure_training_bytes(params, optimizer: torch.optim.Optimizer, master_params=()) -> TrainingBytes:
    """The bytes of training state really held: ``params`` and their ``.grad``, ``master_params``, optimiser state.

    ``params`` are the weights the model computes with (e.g. ``model.parameters()``), ``master_params``
    the optimiser's separate fp32 copies when there are any (:class:`MixedPrecisionAdamW`),
    ``optimizer`` the optimiser that holds the state (split by :func:`optimizer_state_bytes`).
    """
    params = list(params)
    per_param, other = optimizer_state_bytes(optimizer)
    return TrainingBytes(float(tensor_bytes(params)), float(tensor_bytes(p.grad for p in params)),
                         float(tensor_bytes(master_params)), float(per_param), float(other))


class MixedPrecisionAdamW:
    """Mixed-precision AdamW: the model computes in bf16, the optimiser updates fp32 master weights.

    ``params`` are the model's (bf16) parameters. The optimiser (``optimizer_class``, default
    :class:`llmbook.lm.optim.AdamW`, with ``kwargs``) works on fp32 copies ``master``; ``step``
    upcasts each bf16 gradient into its master's ``.grad``, steps, rounds the masters back into the bf16
    weights and frees the fp32 gradients. Per parameter: 2 (weights) + 2 (grads) + 4 (master) + 8 (m, v)
    = 16 bytes, what :func:`measure_training_bytes` finds.

    >>> model = nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    >>> opt = MixedPrecisionAdamW(model.parameters(), lr=1e-3)
    >>> model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward(); opt.step()
    >>> measure_training_bytes(model.parameters(), opt.optimizer, opt.master).total  # 16 bytes x 12 parameters
    192.0
    """

    def __init__(self, params, optimizer_class=None, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.master = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = (AdamW if optimizer_class is None else optimizer_class)(self.master, **kwargs)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, w in zip(self.params, self.master, strict=True):
            w.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for p, w in zip(self.params, self.master, strict=True):
            p.copy_(w)
            w.grad = None


# ---------------------------------------------------------------------------------------------- ZeRO on CPU

_DEMO_CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=88, max_seq_len=16)
_DEMO_B, _DEMO_T = 4, 16


def _demo_model(seed: int, dtype: torch.dtype) -> TinyGPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyGPT(_DEMO_CONFIG).to(dtype)


def _demo_steps(model: nn.Module, optimizer, steps: int, seed: int, rank: int, world_size: int,
                after_backward=None) -> None:
    """``steps`` AdamW steps on seeded random token batches; each rank takes its ``1/world_size`` of the rows.

    ``after_backward`` (optional) runs between ``backward`` and ``step`` (a gradient synchronisation)."""
    for t in range(steps):
        g = torch.Generator().manual_seed(seed * 100_003 + t)
        ids = torch.randint(0, _DEMO_CONFIG.vocab_size, (_DEMO_B, _DEMO_T + 1), generator=g)
        x, y = ids[:, :-1].chunk(world_size)[rank], ids[:, 1:].chunk(world_size)[rank]
        loss = cross_entropy_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()


def _result(model: nn.Module, optimizer, owned) -> dict:
    per_param, other = optimizer_state_bytes(optimizer)
    return {"state_bytes": per_param, "bookkeeping": other, "owned_params": sum(p.numel() for p in owned),
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _zero_worker(steps: int, seed: int, dtype: torch.dtype, lr: float) -> dict:
    """One rank of :func:`zero_memory_demo`: DDP (gradient all-reduce) + ZeroRedundancyOptimizer (sharded AdamW)."""
    _, ZeroRedundancyOptimizer, DistributedDataParallel = _distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _demo_model(seed, dtype)
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=AdamW, lr=lr, weight_decay=0.1)
    _demo_steps(ddp, zero, steps, seed, rank, world_size)
    local = zero.optim  # the AdamW over this rank's shard of the parameters
    return _result(model, local, [p for g in local.param_groups for p in g["params"]])


def _distributed():
    """``torch.distributed``, its ``ZeroRedundancyOptimizer`` and DDP, imported on first use (about a second;
    torch's functional optimisers warn about ``torch.jit`` while importing)."""
    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer
    return dist, ZeroRedundancyOptimizer, DistributedDataParallel


def zero_memory_demo(world_size: int = 2, steps: int = 3, seed: int = 0, dtype: torch.dtype = torch.float64,
                     lr: float = 1e-2, timeout: float = 120.0, start_method: str | None = None) -> dict:
    r"""Train a small :class:`~llmbook.lm.gpt.TinyGPT` with ZeRO-1 on ``world_size`` CPU processes; measure each rank.

    ``world_size = 1`` is ordinary single-process training (the reference: plain
    :class:`llmbook.lm.optim.AdamW`, no ``torch.distributed``). ``world_size >= 2`` spawns that many
    processes (:func:`llmbook.lm.data_parallel.launch`: gloo on 127.0.0.1, meeting at a ``TCPStore`` that
    this process opens first on a free port the OS picks); each takes its share
    of every batch, :class:`~torch.nn.parallel.DistributedDataParallel` averages the gradients and
    :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` gives each rank the AdamW state of only
    its shard of the parameters (largest tensors first, to the least-loaded rank) and broadcasts the
    updated shards. After ``steps`` steps the weights equal single-process training (to rounding).

    Returns ``{"world_size", "n_params", "state_bytes": [per rank], "bookkeeping": [per rank],
    "owned_params": [per rank], "params": rank 0's final state dict}``; ``state_bytes`` is Adam's
    ``m`` and ``v`` (``2 * 8`` bytes per owned float64 parameter), measured with
    :func:`optimizer_state_bytes`. ``timeout`` (seconds) bounds the whole run; on expiry the processes
    are killed and ``TimeoutError`` raised. ``start_method`` is ``torch.multiprocessing``'s: ``None``
    means ``"fork"`` on Linux (the children start at once, under a second for two ranks) and ``"spawn"``
    elsewhere (each child starts a fresh Python and imports torch: several seconds).
    """
    world_size = check_positive_int(world_size, "world_size")
    steps = check_nonnegative_int(steps, "steps")
    if world_size == 1:
        model = _demo_model(seed, dtype)
        opt = AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        _demo_steps(model, opt, steps, seed, 0, 1)
        results = [_result(model, opt, model.parameters())]
    else:
        if _DEMO_B % world_size:
            raise ValueError(f"world_size must divide the demo batch B = {_DEMO_B}, got {world_size}")
        _distributed()  # imported here, so that forked children inherit it
        results = launch(_zero_worker, world_size, steps, seed, dtype, lr, timeout=timeout, start_method=start_method)
    return {"world_size": world_size,
            "n_params": sum(p.numel() for p in _demo_model(seed, dtype).parameters()),
            "state_bytes": [r["state_bytes"] for r in results], "bookkeeping": [r["bookkeeping"] for r in results],
            "owned_params": [r["owned_params"] for r in results], "params": results[0]["params"]}


def _dp_worker(steps: int, seed: int, bucket_size_mb, sharded: bool, to_owner: bool = False) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = _demo_model(seed + rank, torch.float64)
    opt = (ShardedOptimizer(module.parameters(), AdamW, lr=1e-2, weight_decay=0.1) if sharded
           else AdamW(module.parameters(), lr=1e-2, weight_decay=0.1))
    owner = opt.owner_of if to_owner else None
    model = DataParallel(module, bucket_size_mb, owner=owner)  # rank 0's weights win
    _demo_steps(model, opt, steps, seed, rank, world_size, after_backward=model.finish_gradient_synchronization)
    local = opt.optim if sharded else opt
    return {"params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "allreduce_bytes": model.communicated_bytes,
            "broadcast_bytes": opt.communicated_bytes if sharded else 0,
            "state_bytes": optimizer_state_bytes(local)[0] if local is not None else 0,
            "owned_params": sum(p.numel() for p in opt.owned) if sharded else model.module.num_parameters(),
            "n_params": model.module.num_parameters()}


def data_parallel_demo(world_size: int = 2, steps: int = 3, seed: int = 0, bucket_size_mb: float | None = None,
                       sharded: bool = False, to_owner: bool = False, timeout: float = 120.0) -> dict:
    """Train the demo's small float64 TinyGPT with the book's DDP wrapper (and ZeRO-1), measure each rank.

    The wrapper is :class:`~llmbook.lm.data_parallel.DataParallel`; with ``sharded`` the optimiser is
    :class:`~llmbook.lm.data_parallel.ShardedOptimizer` over AdamW, and with ``to_owner`` (and ``sharded``)
    each gradient is reduced to the rank that owns it rather than all-reduced; ``world_size`` gloo processes,
    seeded token batches as in :func:`zero_memory_demo`.

    Each rank starts from its own random weights (the wrapper's broadcast makes them rank 0's) and takes its
    ``1/world_size`` of every batch. Returns ``{"n_params"`` (the model's parameters, a tied matrix once),
    ``"params"``: rank 0's final state dict, ``"same_on_every_rank"``, and per rank
    "allreduce_bytes" (all-reduce or reduce payload), "broadcast_bytes", "state_bytes" (Adam's m and v held),
    "owned_params"}``. Compare
    the weights with :func:`zero_memory_demo` ``(world_size=1)``, single-process training.
    """
    if to_owner and not sharded:
        raise ValueError("to_owner=True reduces each gradient to the rank whose shard it is: it needs sharded=True")
    results = launch(_dp_worker, world_size, steps, seed, bucket_size_mb, sharded, to_owner, timeout=timeout)
    out = {"n_params": results[0]["n_params"], "params": results[0]["params"],
           "same_on_every_rank": all(torch.equal(r["params"][k], v) for r in results
                                     for k, v in results[0]["params"].items())}
    for key in ("allreduce_bytes", "broadcast_bytes", "state_bytes", "owned_params"):
        out[key] = [r[key] for r in results]
    return out
