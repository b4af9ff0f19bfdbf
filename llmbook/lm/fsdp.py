r"""ZeRO stage 3 (FSDP-style parameter sharding) of the book's own on ``torch.distributed`` (chapter 8).

ZeRO-1 (:class:`~llmbook.lm.data_parallel.ShardedOptimizer`) shards the optimiser state; every rank still holds
all :math:`\Psi` weights and gradients. ZeRO-3 shards those too: each rank stores :math:`1/N_d` of every
parameter, so the model states per rank fall from :math:`(8 + 8 + 16)\Psi` bytes (float64 weights, gradients,
Adam's m and v) to :math:`32\Psi/N_d`. A *unit* (a block of the model) gets its full weights only while it runs:

* before a unit's forward, **all-gather** its parameters from the shards; after it, free them;
* when backward reaches the unit (the gradient of its output is ready), all-gather them again;
* as each gradient is accumulated, **reduce-scatter** it: each rank receives the sum of its own slice over the
  ranks, divides by :math:`N_d`, and the full gradient and weights are freed.

Per step that is :math:`3\Psi` in collectives (two all-gathers and a reduce-scatter, each
:math:`\Psi(N_d-1)/N_d` per rank in a ring), 1.5 times DDP's :math:`2\Psi`: the price of holding
:math:`1/N_d` of everything. Freeing keeps each full buffer's storage object and shrinks it to zero bytes
(``untyped_storage().resize_(0)``), so the tensors autograd saved during forward see the weights again once
backward re-gathers them.

Usage, on every rank (:func:`~llmbook.lm.data_parallel.launch` runs a function so)::

    model = FullyShardedDataParallel(model, units=model.blocks)   # rank 0's weights, sharded
    opt = AdamW(model.shards, lr=...)                            # the optimiser sees only this rank's shards
    loss_fn(model(x_local), y_local).backward()                  # gradients land in the shards
    opt.step()
    weights = model.full_state_dict()                            # gathered, for saving or checking
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmbook.lm.data_parallel import _world

__all__ = ["FullyShardedDataParallel", "zero3_demo"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Unit:
    """The parameters of one unit: their shards, their full buffers, and whether they are gathered now."""

    def __init__(self, params: list[Tensor], fsdp: FullyShardedDataParallel):
        self.params, self.fsdp, self.gathered, self.pending = params, fsdp, False, 0
        N, r = fsdp.world_size, fsdp.rank
        self.full, self.shards = [], []
        for p in params:
            k = -(-p.numel() // N)  # slice length: numel padded up to a multiple of N_d
            full = torch.zeros(k * N, dtype=p.dtype)
            full[:p.numel()] = p.detach().reshape(-1)
            self.shards.append(nn.Parameter(full[r * k:(r + 1) * k].clone()))
            p.data = full[:p.numel()].view(p.shape)  # the module computes with views of the full buffer
            self.full.append(full)
        self.free()

    def gather(self) -> None:
        if self.gathered:
            return
        for full, shard in zip(self.full, self.shards, strict=True):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            _all_gather(full, shard.data)
            self.fsdp.gathered_bytes += full.numel() * full.element_size()
        self.gathered, self.pending = True, len(self.params)
        self.fsdp._measure()

    def free(self) -> None:
        if not self.gathered and self.full and self.full[0].untyped_storage().nbytes() == 0:
            return
        for full in self.full:
            full.untyped_storage().resize_(0)
        self.gathered = False
        self.fsdp._measure()

    def reduce_scatter(self, i: int) -> None:
        p, full, shard = self.params[i], self.full[i], self.shards[i]
        grad = torch.zeros_like(full)
        grad[:p.numel()] = p.grad.reshape(-1)
        out = torch.empty_like(shard)
        _reduce_scatter(out, grad)
        self.fsdp.scattered_bytes += grad.numel() * grad.element_size()
        out.div_(self.fsdp.world_size)
        shard.grad = out if shard.grad is None else shard.grad + out
        p.grad = None
        self.pending -= 1
        if self.pending == 0:  # the unit's last gradient: its full weights are no longer needed
            self.free()


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3: each rank stores ``1/N_d`` of every parameter; a unit's weights are gathered only while it runs.

    ``units`` are submodules of ``module`` (for TinyGPT, ``model.blocks``); each is gathered just before its
    forward and again when backward reaches it, and freed after. Parameters in no unit form the *root* unit,
    gathered for the whole forward (and again in backward). ``shards`` are this rank's slices (1-D ``Parameter``
    objects): build the optimiser over them. After ``backward`` each shard's ``.grad`` holds its slice of the
    gradient averaged over the ranks (no synchronisation call is needed). ``full_state_dict()`` gathers the
    weights. ``gathered_bytes`` and ``scattered_bytes`` count the collectives' payloads since construction;
    ``resident_bytes`` is the size of the full-weight storages held now and ``peak_resident_bytes`` the most
    held at once. One forward and one backward per step; change the module's dtype or device before wrapping.
    """

    def __init__(self, module: nn.Module, units: Iterable[nn.Module] | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self.rank, self.world_size = _world()
        self.module = module
        self.gathered_bytes = self.scattered_bytes = self.resident_bytes = self.peak_resident_bytes = 0
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)  # every rank shards the same (rank 0's) weights
        units = [] if units is None else list(units)
        inside = {id(m) for m in module.modules()}
        for u in units:
            if not isinstance(u, nn.Module) or id(u) not in inside or u is module:
                raise ValueError("units must be submodules of module (not module itself: its other parameters "
                                 "form the root unit)")
        owner: dict[int, int] = {}
        for j, u in enumerate(units):
            for p in u.parameters():
                if id(p) in owner:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two units ({owner[id(p)]} and {j})")
                owner[id(p)] = j
        root = [p for p in module.parameters() if id(p) not in owner and p.requires_grad]
        self._units = [_Unit([p for p in u.parameters() if p.requires_grad], self) for u in units]
        self._units.append(_Unit(root, self))
        self.shards = nn.ParameterList([s for unit in self._units for s in unit.shards])
        for unit, m in zip(self._units, [*units, module], strict=True):
            m.register_forward_pre_hook(lambda _m, _a, unit=unit: unit.gather())
            m.register_forward_hook(lambda _m, _a, out, unit=unit: self._after_forward(unit, out))
            for i, p in enumerate(unit.params):
                p.register_post_accumulate_grad_hook(lambda _p, unit=unit, i=i: unit.reduce_scatter(i))

    def _measure(self) -> None:
        """Bytes of full weights held now (the storages' real sizes), and the peak."""
        self.resident_bytes = sum(f.untyped_storage().nbytes() for u in getattr(self, "_units", ()) for f in u.full)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def _after_forward(self, unit: _Unit, out):
        unit.free()
        if torch.is_grad_enabled():  # re-gather once, when backward first reaches one of the unit's outputs
            outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(t, Tensor) and t.requires_grad]
            for t in outs:
                t.register_hook(lambda g, unit=unit: (unit.gather(), g)[1])
        return out

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor]:
        """The module's state dict with every parameter gathered (a copy; the shards are unchanged)."""
        for unit in self._units:
            unit.gather()
        try:
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        finally:
            for unit in self._units:
                unit.free()


def _zero3_worker(steps: int, seed: int) -> dict:
    from llmbook.lm.memory import _demo_model, _demo_steps, optimizer_state_bytes
    from llmbook.lm.optim import AdamW

    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = _demo_model(seed + rank, torch.float64)  # rank 0's weights win
    full_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    model = FullyShardedDataParallel(module, units=module.blocks)
    opt = AdamW(model.shards, lr=1e-2, weight_decay=0.1)
    _demo_steps(model, opt, steps, seed, rank, world_size)
    out = {"gathered_bytes": model.gathered_bytes, "scattered_bytes": model.scattered_bytes,
           "peak_resident_bytes": model.peak_resident_bytes, "resident_bytes": model.resident_bytes,
           "shard_bytes": sum(s.numel() * s.element_size() for s in model.shards), "full_bytes": full_bytes,
           "state_bytes": optimizer_state_bytes(opt)[0], "n_params": module.num_parameters()}
    out["params"] = model.full_state_dict()
    return out


def zero3_demo(world_size: int = 2, steps: int = 3, seed: int = 0, timeout: float = 120.0) -> dict:
    """Train chapter 8's small float64 TinyGPT with :class:`FullyShardedDataParallel` (units: its blocks) and AdamW.

    The model, data and optimiser of :func:`llmbook.lm.memory.data_parallel_demo`; each rank starts from its
    own weights. Returns ``{"params"`` (rank 0's gathered state dict), ``"n_params"``, and per rank
    ``"gathered_bytes"``, ``"scattered_bytes"`` (collective payloads over all steps), ``"shard_bytes"``,
    ``"state_bytes"`` (Adam's m and v), ``"full_bytes"`` (the whole model's weights),
    ``"peak_resident_bytes"`` and ``"resident_bytes"`` (full weights held at the peak and after training)}``.
    """
    from llmbook.lm.data_parallel import launch

    results = launch(_zero3_worker, world_size, steps, seed, timeout=timeout)
    out = {"params": results[0]["params"], "n_params": results[0]["n_params"]}
    for key in ("gathered_bytes", "scattered_bytes", "shard_bytes", "state_bytes", "full_bytes",
                "peak_resident_bytes", "resident_bytes"):
        out[key] = [r[key] for r in results]
    return out
