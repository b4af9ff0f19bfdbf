r"""Data parallelism of the book's own on ``torch.distributed`` (chapter 8): a DDP wrapper and a ZeRO-1 optimiser.

With :math:`N_d` ranks, each holding a full copy of the model and its share of every batch, the gradient of
the full batch's mean loss is the average of the ranks' gradients,

.. math:: g = \frac{1}{N_d}\sum_{r=1}^{N_d} g_r ,

so one all-reduce per step keeps every copy identical. :class:`DataParallel` wraps any ``nn.Module``: it
broadcasts rank 0's parameters at construction, and launches an *asynchronous* all-reduce for each
gradient as soon as backward has accumulated it (``register_post_accumulate_grad_hook``), one per
parameter or one per bucket of about ``bucket_size_mb``, so communication overlaps the rest of the
backward pass. :meth:`DataParallel.finish_gradient_synchronization` waits for them and divides by
:math:`N_d`; call it between ``loss.backward()`` and ``optimizer.step()``.

:class:`ShardedOptimizer` is ZeRO stage 1: it wraps any ``torch.optim.Optimizer`` class and its
arguments; each rank builds that optimiser over its own shard of the parameters only (so it holds
:math:`1/N_d` of the optimiser state), steps it, then broadcasts each updated shard from its owner.

Both count the bytes they hand to collectives (``communicated_bytes``): per step, DDP all-reduces the
:math:`\Psi` gradient entries (ring traffic :math:`2\Psi(N_d-1)/N_d` per rank), and ZeRO-1 adds a broadcast of
the :math:`\Psi` parameters. ZeRO-1 as its paper runs it needs no more traffic than DDP: each rank needs only its
shard's averaged gradient, so ``DataParallel(model, owner=optimizer.owner_of)`` *reduces* each gradient to the rank
that owns it instead of all-reducing it (:math:`\Psi(N_d-1)/N_d` per rank, the reduce-scatter's share), and the
broadcast of the updated shards adds the other :math:`\Psi(N_d-1)/N_d`. :func:`launch`
runs a function on ``world_size`` CPU processes (gloo) and returns what each rank returned;
:func:`llmbook.lm.memory.data_parallel_demo` trains chapter 8's small TinyGPT with both, for the chapter.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from llmbook._checks import check_choice, check_nonnegative_int, check_positive_int, check_range

__all__ = ["DataParallel", "ShardedOptimizer", "launch"]


def _world() -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first "
                           "(or run the function through llmbook.lm.data_parallel.launch)")
    return dist.get_rank(), dist.get_world_size()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training: parameters broadcast, gradients all-reduced as they are ready.

    ``bucket_size_mb=None`` all-reduces each parameter's gradient on its own; a number groups the
    parameters, in the reverse of their registration order (roughly the order backward produces
    gradients), into buckets of at most that many megabytes (a parameter larger than a bucket gets one to
    itself), and all-reduces a bucket once all of its gradients are in. ``forward`` is the module's.
    ``communicated_bytes`` sums the bytes handed to all-reduce since construction.

    ``owner`` (a function from a parameter to a rank, such as :meth:`ShardedOptimizer.owner_of`) turns the
    all-reduce into a *reduce* to the parameter's owner: after :meth:`finish_gradient_synchronization` only
    the owner holds the averaged gradient, and on every other rank ``.grad`` is ``None``. Buckets then hold
    the parameters of one owner each. One ``backward`` per
    synchronisation: the hooks fire on every backward, so accumulating gradients over several micro-batches
    needs a synchronisation after each (or a wrapper that skips the hooks, which this one does not offer).

    Usage, on every rank::

        model = DataParallel(model, bucket_size_mb=25)
        loss_fn(model(x_local), y_local).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None,
                 owner: Callable[[Tensor], int] | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if bucket_size_mb is not None:
            check_range(bucket_size_mb, "bucket_size_mb", 0.0, low_open=True)
        self.rank, self.world_size = _world()
        if owner is not None and not callable(owner):
            raise TypeError(f"owner must be a function from a parameter to a rank, got {type(owner).__name__}")
        self.module, self.bucket_size_mb = module, bucket_size_mb
        self.communicated_bytes = 0
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)  # every copy starts from rank 0's weights
        params = [p for p in module.parameters() if p.requires_grad]
        self._owner = {id(p): self._check_owner(owner, p) for p in params} if owner is not None else None
        self._pending: list[tuple[object, Tensor, list[Tensor], int | None]] = []
        if bucket_size_mb is None:
            for p in params:
                p.register_post_accumulate_grad_hook(self._reduce_one)
        else:
            limit, self._buckets, current, size = bucket_size_mb * 2**20, [], [], 0
            for p in reversed(params):
                if current and (size + _nbytes(p) > limit or self._dst(p) != self._dst(current[0])):
                    self._buckets.append(current)
                    current, size = [], 0
                current.append(p)
                size += _nbytes(p)
            if current:
                self._buckets.append(current)
            self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b}
            self._ready = [0] * len(self._buckets)
            for p in params:
                p.register_post_accumulate_grad_hook(self._reduce_bucket)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _check_owner(self, owner, p: Tensor) -> int:
        r = owner(p)
        if not isinstance(r, int) or not 0 <= r < self.world_size:
            raise ValueError(f"owner(p) must be a rank in 0..{self.world_size - 1}, got {r!r} for a parameter of "
                             f"shape {tuple(p.shape)}")
        return r

    def _dst(self, p: Tensor) -> int | None:
        return None if self._owner is None else self._owner[id(p)]

    def _launch(self, buf: Tensor, params: list[Tensor]) -> None:
        self.communicated_bytes += _nbytes(buf)
        dst = self._dst(params[0])
        work = (dist.all_reduce(buf, async_op=True) if dst is None else dist.reduce(buf, dst=dst, async_op=True))
        self._pending.append((work, buf, params, dst))

    def _reduce_one(self, p: Tensor) -> None:
        self._launch(p.grad, [p])

    def _reduce_bucket(self, p: Tensor) -> None:
        i = self._bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self._buckets[i]):  # the bucket's last gradient is in: send the whole bucket
            self._ready[i] = 0
            self._launch(torch.cat([q.grad.reshape(-1) for q in self._buckets[i]]), self._buckets[i])

    def finish_gradient_synchronization(self) -> None:
        """Wait for every all-reduce (or reduce) launched during backward, write the averages into ``.grad``."""
        for work, buf, params, dst in self._pending:
            work.wait()
            if dst is not None and dst != self.rank:  # reduced to another rank: this copy is not the average
                for p in params:
                    p.grad = None
                continue
            buf.div_(self.world_size)
            if buf is not params[0].grad:  # a bucket: copy the averaged slices back into each gradient
                offset = 0
                for p in params:
                    p.grad.copy_(buf[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        self._pending.clear()
        if self.bucket_size_mb is not None and any(self._ready):
            raise RuntimeError("some parameters of a bucket received no gradient this step; "
                               "use bucket_size_mb=None when parts of the model are unused")


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: each rank keeps and steps the state of its shard of the parameters, then shares the shard.

    ``ShardedOptimizer(params, optimizer_class, **kwargs)`` builds ``optimizer_class(own_params, **kwargs)``
    on each rank, over the parameters it owns: they are dealt out, largest first, to the rank with the
    fewest elements so far (ZeroRedundancyOptimizer's rule). ``step()`` steps that local optimiser and
    broadcasts each parameter from its owner. Gradients must already be averaged over the ranks
    (:class:`DataParallel`), at least on their owner: ``DataParallel(model, owner=opt.owner_of)`` reduces each
    to its owner only, the paper's traffic. ``owned`` lists this rank's parameters; ``communicated_bytes`` the
    broadcast bytes this rank sent.
    """

    def __init__(self, params: Iterable[Tensor], optimizer_class: type[torch.optim.Optimizer], **kwargs):
        params = [p for p in params]
        if not params or not all(isinstance(p, Tensor) for p in params):
            raise TypeError("params must be a non-empty iterable of tensors (parameter groups are not supported)")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        self.rank, self.world_size = _world()
        load = [0] * self.world_size
        self.owner: dict[int, int] = {}
        for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
            r = min(range(self.world_size), key=lambda r: (load[r], r))
            self.owner[i] = r
            load[r] += params[i].numel()
        self._params = params
        self.owned = [p for i, p in enumerate(params) if self.owner[i] == self.rank]
        self.optim = optimizer_class(self.owned, **kwargs) if self.owned else None
        self.communicated_bytes = 0
        self._owner_of = {id(p): self.owner[i] for i, p in enumerate(params)}
        super().__init__(params, kwargs)  # the full list, for zero_grad and for introspection

    def owner_of(self, p: Tensor) -> int:
        """The rank that steps ``p`` (and to which :class:`DataParallel` may reduce its gradient)."""
        if id(p) not in self._owner_of:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is not one this optimiser shards")
        return self._owner_of[id(p)]

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if self.optim is not None:
            loss = self.optim.step(closure) if closure is not None else self.optim.step()
        for i, p in enumerate(self._params):
            if self.owner[i] == self.rank:
                self.communicated_bytes += _nbytes(p)
            dist.broadcast(p.data, src=self.owner[i])
        return loss


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)  # first: a forked child must not enter the parent's OpenMP pool
    # a child forked from a Jupyter kernel inherits its threaded output streams, whose threads it does not have
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    store.set(f"ready/{rank}", "1")  # the parent's watchdog: this rank joined the group
    try:
        torch.save(fn(*args), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _kill(ctx) -> None:
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
            proc.join()


def launch(fn: Callable, world_size: int = 2, *args, timeout: float = 120.0, start_method: str | None = None,
           join_timeout: float = 15.0, retries: int = 2) -> list:
    """Run ``fn(*args)`` on ``world_size`` CPU processes joined in a gloo process group; return each rank's result.

    ``fn`` must be importable (a module-level function) and return something ``torch.save`` can store (it is
    read back with ``weights_only=True``: tensors, numbers, lists and dicts of them). Inside, ``dist.get_rank()``
    tells the rank. The processes meet at a ``TCPStore`` this process opens first on a port the OS picks.
    ``start_method`` ``None`` means ``"fork"`` on Linux (children start at once) and ``"spawn"`` elsewhere.
    On ``timeout`` (seconds) the processes are killed and ``TimeoutError`` is raised.

    A child forked from a process with threads (a Jupyter kernel) can, rarely, hang before it joins the group:
    it inherited a lock that another thread held. So a watchdog waits ``join_timeout`` seconds for every rank
    to report that it joined; if one has not, all are killed and the launch starts again with fresh processes
    and a fresh store, up to ``retries`` times, before ``TimeoutError``. A run that joined is never repeated.
    """
    world_size = check_positive_int(world_size, "world_size")
    check_range(timeout, "timeout", 0.0, low_open=True)
    check_range(join_timeout, "join_timeout", 0.0, low_open=True)
    retries = check_nonnegative_int(retries, "retries")
    start_method = ("fork" if sys.platform == "linux" else "spawn") if start_method is None else start_method
    check_choice(start_method, "start_method", ("fork", "spawn", "forkserver"))
    name = getattr(fn, "__name__", fn)
    for _ in range(retries + 1):
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
        with tempfile.TemporaryDirectory() as out_dir:
            ctx = mp.start_processes(_worker, args=(world_size, store.port, fn, args, out_dir), nprocs=world_size,
                                     join=False, start_method=start_method)
            start = time.monotonic()
            joined = False
            while not ctx.join(timeout=0.5):
                joined = joined or store.check([f"ready/{r}" for r in range(world_size)])
                if not joined and time.monotonic() - start > join_timeout:
                    break  # a rank never joined: start again
                if time.monotonic() - start > timeout:
                    _kill(ctx)
                    raise TimeoutError(f"launch({name}, {world_size}) did not finish in {timeout} s")
            else:
                return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
                        for r in range(world_size)]
            _kill(ctx)
    raise TimeoutError(f"launch({name}, {world_size}): a rank did not join the group within {join_timeout} s, "
                       f"in {retries + 1} attempts")

