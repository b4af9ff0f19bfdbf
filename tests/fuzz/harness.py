"""The generic machinery of the fuzz suite: cases, argument factories, mutators and the three checks.

A :class:`Case` says how to call one public callable with *valid* arguments (a factory that builds
them from a :class:`Maker`) and annotates those arguments: which scalars are integers or floats and
what range they must lie in. Everything else is generic:

* :func:`mutations` derives the perturbed calls from the valid ones: dtypes (fp16, bf16, fp64, int,
  bool), extreme and non-finite values, degenerate sizes (every size symbol the factory read, set to
  0 and to 1), shape edits, mismatched dtypes within argument pairs, and bad scalars;
* :func:`check_error` decides whether an exception honours the package contract (a ``ValueError``
  or ``TypeError`` raised by a ``raise`` statement in a file of the ``llmbook`` package);
* :func:`compare_low_precision` compares an fp16/bf16 result with the float64 reference (the same
  callable on the float64 upcast of the same inputs, then cast to the low-precision dtype).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import linecache
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import llmbook
from llmbook.registry import resolve

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.dirname(os.path.abspath(llmbook.__file__))
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23, torch.float64: 2.0**-52}
LOW = (torch.float16, torch.bfloat16)

DEFAULT_SIZES = dict(B=2, T=5, D=8, H=2, V=11, E=4, K=2, C=8, F=16, P=0)


# --------------------------------------------------------------------------- scalar kinds


@dataclass(frozen=True)
class Int:
    """An integer argument in ``[lo, hi]``: bools, floats, strings, NaN and inf must be rejected."""

    lo: int | None = None
    hi: int | None = None

    def bad(self) -> list:
        out = [True, 2.5, "0.5", math.nan, math.inf]
        if self.lo is not None:
            out.append(self.lo - 1)
        if self.hi is not None:
            out.append(self.hi + 1)
        return out

    def odd(self) -> list:
        """Values that may be valid or not, but must never crash unclearly."""
        return [v for v in (0, -1, 1) if v not in self.bad()]


@dataclass(frozen=True)
class Float:
    """A real argument in ``[lo, hi]`` (open ends as flagged); NaN, bools and strings must be rejected."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    inf_ok: bool = False  # whether +inf is a meaningful value (e.g. tau = inf: the uniform distribution)

    def bad(self) -> list:
        out = [True, "0.5", math.nan]
        if self.lo > -math.inf:
            out.append(self.lo if self.lo_open else self.lo - 1.0)
        if self.hi < math.inf:
            out.append(self.hi if self.hi_open else self.hi + 1.0)
        if not self.inf_ok:
            out.append(math.inf)
        return out

    def odd(self) -> list:
        bad = self.bad()
        return [v for v in (0.0, -1.0, 1e-30, 1e30, math.inf, -math.inf) if not any(_same(v, b) for b in bad)]


@dataclass(frozen=True)
class Choice:
    """A string option: an unknown name must be rejected."""

    def bad(self) -> list:
        return ["no-such-option", 3]

    def odd(self) -> list:
        return []


def _same(a, b) -> bool:
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


# --------------------------------------------------------------------------- valid-argument factories


class Sizes:
    """Size symbols (B, T, D, ...) read by a factory; records which ones it read."""

    def __init__(self, **sizes):
        object.__setattr__(self, "_v", {**DEFAULT_SIZES, **sizes})
        object.__setattr__(self, "used", set())

    def __getattr__(self, name):
        v = object.__getattribute__(self, "_v")
        if name not in v:
            raise AttributeError(name)
        object.__getattribute__(self, "used").add(name)
        return v[name]


class Maker:
    """What a factory gets: the float dtype to build in, the sizes, and seeded random builders."""

    def __init__(self, dtype=torch.float32, seed: int = 0, **sizes):
        self.dt = dtype
        self.s = Sizes(**sizes)
        self.g = torch.Generator().manual_seed(seed)
        self.seed = seed

    def f(self, *shape, scale: float = 1.0) -> torch.Tensor:
        """A float tensor of the case dtype, N(0, scale^2) (drawn in float64, then rounded)."""
        return (torch.randn(shape, generator=self.g, dtype=torch.float64) * scale).to(self.dt)

    def pos(self, *shape) -> torch.Tensor:
        """Positive floats in [0.5, 1.5) of the case dtype."""
        return (torch.rand(shape, generator=self.g, dtype=torch.float64) + 0.5).to(self.dt)

    def probs(self, *shape) -> torch.Tensor:
        """Rows of a probability distribution (softmax of N(0, 1) logits) in the case dtype."""
        p = torch.softmax(torch.randn(shape, generator=self.g, dtype=torch.float64), -1).to(self.dt)
        return p

    def ids(self, *shape, high: int) -> torch.Tensor:
        return torch.randint(0, max(high, 1), shape, generator=self.g)

    def gen(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)

    def module(self, cls, *args, **kwargs) -> nn.Module:
        """A sub-module (an attention, an expert) built from a fixed seed, in the case dtype."""
        torch.manual_seed(0)
        return cls(*args, **kwargs).to(self.dt)


# --------------------------------------------------------------------------- the case table entry


@dataclass
class Case:
    """How to call one public callable with valid arguments, and what its contract allows.

    ``make(m)`` returns the keyword arguments of a valid call. For a class, the names in ``init``
    go to the constructor and the rest to ``forward`` (or to nothing, for a plain class).

    Explicit, reasoned exceptions (never a blanket skip):

    * ``lowp_tol``: tolerance of the fp16/bf16 comparison in units of the dtype's epsilon, relative
      to ``max(1, max |reference|)`` (default 8);
    * ``lowp_scale``: the largest input scale of the "sane range" of the low-precision check;
    * ``lowp_skip``: why the low-precision comparison does not apply (e.g. a random draw);
    * ``overflow``/``nan_reason``: ``"square"`` lets finite input of magnitude ``a`` overflow into NaN
      once ``a**2`` exceeds the dtype's range / 100 (the input meets itself in a product, as in
      self-attention scores; torch overflows there too); default: NaN is never allowed;
    * ``slow``: why only argument validation runs (e.g. the Triton interpreter).
    """

    name: str
    make: Callable[[Maker], dict]
    scalars: dict = field(default_factory=dict)
    init: tuple = ()
    scaled: str | None = None  # the tensor rescaled in the NaN-free check (default: the first float tensor)
    lowp_tol: float = 8.0
    lowp_scale: float = 4.0
    lowp_skip: str | None = None
    lowp_int_reason: str | None = None  # why integer outputs may differ between fp16/bf16 and fp64
    overflow: str | None = None  # "square": the input meets itself in a product (x W_q . x W_k)
    nan_reason: str | None = None
    slow: str | None = None
    real_ok: tuple = ()  # integer tensors that also take real values (positions: interpolated RoPE positions)
    reason: str = ""  # documentation for any of the above

    def __post_init__(self):
        if self.overflow is not None and not self.nan_reason:
            raise ValueError(f"{self.name}: overflow needs a nan_reason")
        if self.lowp_tol != 8.0 and not self.reason:
            raise ValueError(f"{self.name}: a non-default lowp_tol needs a reason")

    def nan_allowed(self, magnitude: float, dtype: torch.dtype) -> bool:
        """Whether the contract lets finite input of this magnitude give NaN."""
        if self.overflow == "square":
            # an integer input is computed in the default float dtype (its magnitude is that of the base call)
            dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()
            return magnitude**2 > torch.finfo(dtype).max / 100
        return False

    @property
    def obj(self):
        return resolve(self.name)


# --------------------------------------------------------------------------- calling


def _cast_module(mod, dtypes):
    for dt in dtypes:
        mod = mod.to(dt)
    return mod


def call(case: Case, kwargs: dict, module_dtypes=()):
    """Call ``case``'s object with ``kwargs``; a class is constructed from a fixed seed first."""
    obj = case.obj
    if inspect.isclass(obj):
        init = {k: kwargs[k] for k in case.init if k in kwargs}
        rest = {k: v for k, v in kwargs.items() if k not in case.init}
        torch.manual_seed(0)
        inst = obj(**init)
        if isinstance(inst, nn.Module):
            inst = _cast_module(inst, module_dtypes)
            return inst(**rest)
        return inst
    return obj(**kwargs)


def fresh(x):
    """A copy of an argument structure whose generators restart from their current state."""
    if isinstance(x, torch.Generator):
        g = torch.Generator()
        g.set_state(x.get_state())
        return g
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: fresh(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(fresh(v) for v in x)
    return x


def upcast(x):
    """Every floating tensor (and module) of an argument structure, in float64."""
    if isinstance(x, torch.Generator):
        return fresh(x)
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x.clone()
    if isinstance(x, nn.Module):
        return copy.deepcopy(x).double()
    if isinstance(x, dict):
        return {k: upcast(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(upcast(v) for v in x)
    return x


def leaves(x, path="out"):
    """(path, value) for every tensor and number in an output structure."""
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, bool) or x is None or isinstance(x, str):
        return
    elif isinstance(x, (int, float)):
        # a Python int beyond int64 (an exact count such as a capacity of ceil(1e30 N K / E)) is compared as float64
        long_ok = isinstance(x, int) and -(2**63) <= x < 2**63
        yield path, torch.tensor(x, dtype=torch.long if long_ok else torch.float64)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{path}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from leaves(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from leaves(getattr(x, f.name), f"{path}.{f.name}")


def has_nan(out) -> str | None:
    for path, t in leaves(out):
        if t.is_floating_point() and torch.isnan(t).any():
            return path
        if t.is_complex() and torch.isnan(torch.view_as_real(t)).any():
            return path
    return None


# --------------------------------------------------------------------------- the error contract


def check_error(err: BaseException) -> str | None:
    """None if ``err`` honours the contract, else a one-line description of the violation."""
    tb = err.__traceback__
    last = None
    entered = False  # inside llmbook yet?
    while tb is not None:
        fname = os.path.abspath(tb.tb_frame.f_code.co_filename)
        entered = entered or fname.startswith(PACKAGE_DIR + os.sep)
        if entered and fname.startswith(HERE + os.sep):
            return None  # llmbook called the case's own model, expert or step function, and that raised
        last = tb
        tb = tb.tb_next
    where = "?"
    in_pkg = False
    is_raise = False
    if last is not None:
        fname = last.tb_frame.f_code.co_filename
        in_pkg = os.path.abspath(fname).startswith(PACKAGE_DIR + os.sep)
        line = linecache.getline(fname, last.tb_lineno).strip()
        is_raise = line.startswith("raise")
        where = f"{os.path.relpath(fname, os.path.dirname(PACKAGE_DIR)) if in_pkg else fname}:{last.tb_lineno}"
    msg = str(err).splitlines()[0][:140] if str(err) else ""
    if not isinstance(err, (ValueError, TypeError)):
        return f"{type(err).__name__} at {where}: {msg}"
    if not in_pkg:
        return f"{type(err).__name__} from outside llmbook at {where}: {msg}"
    if not is_raise:
        return f"{type(err).__name__} from a torch call (not a raise of llmbook) at {where}: {msg}"
    return None


# --------------------------------------------------------------------------- mutations


@dataclass
class Mutation:
    label: str
    kwargs: dict
    must_reject: bool = False
    finite: bool = True  # every float input finite (so NaN output would be a defect)
    magnitude: float = 1.0  # largest input magnitude introduced
    dtype: torch.dtype = torch.float32  # the dtype of the perturbed tensor


def _float_tensors(kwargs):
    return [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _int_tensors(kwargs):
    return [k for k, v in kwargs.items()
            if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool]


def _with(kwargs, **changes):
    out = dict(kwargs)
    out.update(changes)
    return out


def _set_first(t: torch.Tensor, value, whole=False) -> torch.Tensor:
    t = t.clone()
    if t.numel():
        if whole:
            t.fill_(value)
        else:
            t.view(-1)[0] = value
    return t


def size_variants(case: Case) -> list[tuple[str, dict]]:
    """Degenerate sizes: each size symbol the factory reads, set to 0 and to 1."""
    m = Maker()
    case.make(m)
    out = []
    for name in sorted(m.s.used):
        for v in (0, 1):
            if DEFAULT_SIZES[name] != v:
                out.append((f"size {name}={v}", {name: v}))
    return out


def mutations(case: Case, base: dict) -> list[Mutation]:
    out: list[Mutation] = []
    floats = _float_tensors(base)
    # A module's forward input must match the dtype of its parameters (torch.nn's own contract):
    # only integer and bool inputs are tried there, not other float dtypes.
    module = inspect.isclass(case.obj) and issubclass(case.obj, nn.Module)
    for name in floats:
        t = base[name]
        for dt in (torch.float16, torch.bfloat16, torch.float64, torch.int64):
            if module and dt.is_floating_point:
                continue
            out.append(Mutation(f"{name} dtype {dt}", _with(base, **{name: t.to(dt)}), dtype=dt))
        out.append(Mutation(f"{name} dtype bool", _with(base, **{name: t > 0}), must_reject=True))
        for v in (1e4, -1e4, 1e30, -1e30):
            out.append(Mutation(f"{name}[0]={v:g}", _with(base, **{name: _set_first(t, v)}), magnitude=abs(v)))
        for v in (math.inf, -math.inf, math.nan):
            out.append(Mutation(f"{name}[0]={v}", _with(base, **{name: _set_first(t, v)}), finite=False))
        out.append(Mutation(f"{name} all -inf", _with(base, **{name: _set_first(t, -math.inf, True)}), finite=False))
        out.append(Mutation(f"{name} all 1e30", _with(base, **{name: _set_first(t, 1e30, True)}), magnitude=1e30))
        h = t.half()
        for v in (6e4, -6e4) if not module else ():
            out.append(Mutation(f"{name} fp16 [0]={v:g}", _with(base, **{name: _set_first(h, v)}), magnitude=6e4,
                                dtype=torch.float16))
        if t.ndim >= 1:
            out.append(Mutation(f"{name} shape drop last dim", _with(base, **{name: t[..., 0]})))
            if t.shape[-1] > 1:
                out.append(Mutation(f"{name} shape last dim -1", _with(base, **{name: t[..., :-1]})))
        out.append(Mutation(f"{name} shape extra leading dim", _with(base, **{name: t[None]})))
        out.append(Mutation(f"{name} as list", _with(base, **{name: t.tolist()})))
    for name in _int_tensors(base):
        t = base[name]
        out.append(Mutation(f"{name} (ids) dtype float", _with(base, **{name: t.double() + 0.5}),
                            must_reject=name not in case.real_ok))
        out.append(Mutation(f"{name} (ids) dtype bool", _with(base, **{name: t > 0}), must_reject=True))
        out.append(Mutation(f"{name} (ids) [0]=-1", _with(base, **{name: _set_first(t, -1)})))
        out.append(Mutation(f"{name} (ids) [0]=10**9", _with(base, **{name: _set_first(t, 10**9)})))
        if t.ndim >= 1:
            out.append(Mutation(f"{name} (ids) shape drop last dim", _with(base, **{name: t[..., 0]})))
        out.append(Mutation(f"{name} (ids) shape extra leading dim", _with(base, **{name: t[None]})))
    for a_i, a in enumerate(floats if not module else []):
        for b in floats[a_i + 1:]:
            out.append(Mutation(f"pair {a} float64 / {b} float32",
                                _with(base, **{a: base[a].double(), b: base[b].float()})))
            out.append(Mutation(f"pair {a} float32 / {b} float16",
                                _with(base, **{a: base[a].float(), b: base[b].half()})))
    for name, kind in case.scalars.items():
        for v in kind.bad():
            out.append(Mutation(f"{name}={v!r}", _with(base, **{name: v}), must_reject=True,
                                finite=not (isinstance(v, float) and not math.isfinite(v))))
        for v in kind.odd():
            out.append(Mutation(f"{name}={v!r}", _with(base, **{name: v}),
                                finite=not (isinstance(v, float) and not math.isfinite(v))))
    return out


# --------------------------------------------------------------------------- the low-precision check


def compare_low_precision(case: Case, out, ref, dtype) -> list[str]:
    """Compare ``out`` (computed in ``dtype``) with ``ref`` (float64) cast to ``dtype``."""
    problems = []
    tol = case.lowp_tol * EPS[dtype]
    outs, refs = list(leaves(out)), list(leaves(ref))
    if len(outs) != len(refs):
        return [f"output structure differs: {len(outs)} vs {len(refs)} leaves"]
    for (path, o), (_, r) in zip(outs, refs, strict=True):
        if o.shape != r.shape:
            problems.append(f"{path}: shape {tuple(o.shape)} vs reference {tuple(r.shape)}")
            continue
        if not (o.is_floating_point() or r.is_floating_point()):
            if not torch.equal(o, r) and case.lowp_int_reason is None:
                problems.append(f"{path}: integer output differs from the float64 reference "
                                f"({o.flatten()[:6].tolist()} vs {r.flatten()[:6].tolist()})")
            continue
        r_c = r.to(dtype).double() if r.dtype == torch.float64 else r.double()
        o_d = o.double()
        fin_o, fin_r = torch.isfinite(o_d), torch.isfinite(r_c)
        if not torch.equal(fin_o, fin_r) or not torch.equal(o_d[~fin_o].nan_to_num(0.5), r_c[~fin_r].nan_to_num(0.5)):
            problems.append(f"{path}: non-finite pattern differs ({(~fin_o).sum().item()} non-finite in "
                            f"{dtype}, {(~fin_r).sum().item()} in the float64 reference)")
            continue
        if o_d.numel() == 0 or not fin_o.any():
            continue
        scale = max(1.0, r_c[fin_r].abs().max().item())
        err = (o_d[fin_o] - r_c[fin_r]).abs().max().item()
        if err > tol * scale:
            problems.append(f"{path}: max abs error {err:.3g} > {case.lowp_tol:g} eps * {scale:.3g}")
    return problems
