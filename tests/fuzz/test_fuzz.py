"""Fuzz the public API: clear errors, fp16/bf16 agreement with float64, no NaN from finite input.

The case table (``cases.py``) says how to call each public callable; ``harness.py`` derives the
perturbed calls. Every object registered in ``llmbook.registry`` must have a case: a new chapter
joins this suite by adding one entry per registered function (see the docstring of ``cases.py``).

Three checks, each one test per callable so a failure names the callable and lists every violation:

* ``test_errors_are_clear``: each mutation (dtype, extreme/non-finite value, degenerate size, shape
  edit, mismatched pair, bad scalar) either succeeds or raises a ``ValueError``/``TypeError`` from a
  ``raise`` in llmbook; a bad scalar (a bool, 2.5 or '0.5' for an int, NaN, out of range) must be
  rejected; a success from finite input returns no NaN;
* ``test_low_precision_matches_float64``: hypothesis draws fp16/bf16 inputs in a sane range; the
  result agrees with the same callable on the float64 upcast, cast back, within ``lowp_tol`` eps;
* ``test_finite_input_gives_no_nan``: hypothesis draws inputs in fp16, bf16, float32 and float64
  whose largest magnitude is 1 .. 1e30 (what the dtype holds); the result holds no NaN.

Hypothesis runs derandomized and without a database, so CI is deterministic.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from llmbook import registry

from .cases import CASES
from .harness import (
    LOW,
    Maker,
    Mutation,
    call,
    check_error,
    compare_low_precision,
    fresh,
    has_nan,
    mutations,
    size_variants,
    upcast,
)

NAMES = sorted(CASES)
FAST = [n for n in NAMES if CASES[n].slow is None]
LOWP = [n for n in FAST if CASES[n].lowp_skip is None]

FUZZ = settings(max_examples=4, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


def test_every_registered_callable_has_a_case():
    """A registered function without a fuzz case fails here: add its entry to tests/fuzz/cases.py."""
    registered = {name for names in registry.implementations().values() for name in names}
    missing = sorted(registered - set(CASES))
    assert not missing, f"add a fuzz case to tests/fuzz/cases.py for: {missing}"
    # and every case names a real public callable
    for name in NAMES:
        assert callable(registry.resolve(name)), name


def _run(case, kwargs, module_dtypes=()):
    """(output, None) or (None, exception); tensors are copied and generators restarted."""
    try:
        return call(case, fresh(kwargs), module_dtypes), None
    except Exception as err:  # noqa: BLE001 - classifying every exception is the point
        return None, err


@pytest.mark.parametrize("name", NAMES)
def test_errors_are_clear(name):
    case = CASES[name]
    base = case.make(Maker())
    out, err = _run(case, base)
    assert err is None, f"the valid base call raised {type(err).__name__}: {err}"
    problems = []
    muts = mutations(case, base)
    for label, sizes in size_variants(case):
        try:
            kw = case.make(Maker(**sizes))
        except Exception as e:  # noqa: BLE001
            bad = check_error(e)
            if bad:
                problems.append(f"[{label}] (building the case) {bad}")
            continue
        muts.append(Mutation(label, kw))
    for mut in muts:
        if case.slow and not mut.must_reject:
            continue
        out, err = _run(case, mut.kwargs)
        if err is not None:
            bad = check_error(err)
            if bad:
                problems.append(f"[{mut.label}] {bad}")
            continue
        if mut.must_reject:
            problems.append(f"[{mut.label}] accepted silently (must raise ValueError/TypeError)")
            continue
        if mut.finite and not case.nan_allowed(mut.magnitude, mut.dtype):
            where = has_nan(out)
            if where:
                problems.append(f"[{mut.label}] NaN in {where} from finite input")
    assert not problems, f"{name}: {len(problems)} violations\n  " + "\n  ".join(problems)


def _sizes(T, P):
    return dict(T=T, P=P)


@pytest.mark.parametrize("name", LOWP)
@FUZZ
@given(dtype=st.sampled_from(LOW), seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 0.0]),
       T=st.sampled_from([1, 5, 9]), P=st.sampled_from([0, 1000]))
def test_low_precision_matches_float64(name, dtype, seed, scale, T, P):
    case = CASES[name]
    scale = scale or case.lowp_scale  # 0.0 draws the case's largest sane scale
    m = Maker(dtype, seed, **_sizes(T, P))
    kwargs = case.make(m)
    first = case.scaled or next((k for k, v in kwargs.items()
                                 if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    if first is not None and scale != 1.0:
        kwargs[first] = (kwargs[first].double() * scale).to(dtype)
    try:
        ref = call(case, upcast(kwargs), module_dtypes=(dtype, torch.float64))
    except (ValueError, TypeError):
        return  # the inputs are invalid whatever the precision (e.g. T = 1 where T >= 2 is required)
    try:
        out = call(case, fresh(kwargs), module_dtypes=(dtype,))
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"{name}: valid {dtype} input (scale {scale}, T={T}, P={P}) raised "
                    f"{type(err).__name__}: {err} ({check_error(err) or 'a clear error'}); float64 did not")
    problems = compare_low_precision(case, out, ref, dtype)
    assert not problems, f"{name} in {dtype} (scale {scale}, T={T}, P={P}): " + "; ".join(problems)


def _magnitudes(dtype):
    big = [1e30] if dtype != torch.float16 else [6e4]
    return [1.0, 1e2, 1e4] + big


@pytest.mark.parametrize("name", FAST)
@FUZZ
@given(data=st.data())
def test_finite_input_gives_no_nan(name, data):
    case = CASES[name]
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]), "dtype")
    mag = data.draw(st.sampled_from(_magnitudes(dtype)), "magnitude")
    seed = data.draw(st.integers(0, 2**16), "seed")
    T = data.draw(st.sampled_from([1, 5]), "T")
    m = Maker(dtype, seed, **_sizes(T, 0))
    kwargs = case.make(m)
    first = case.scaled or next((k for k, v in kwargs.items()
                                 if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    if first is not None:
        x = kwargs[first].double()
        peak = x.abs().max().item() if x.numel() else 1.0
        kwargs[first] = (x / (peak or 1.0) * mag).to(dtype)
        assert torch.isfinite(kwargs[first]).all()
    out, err = _run(case, kwargs, (dtype,))
    if err is not None:
        bad = check_error(err)
        assert bad is None, f"{name} ({dtype}, |{first}| <= {mag:g}): {bad}"
        return
    if case.nan_allowed(mag, dtype):
        return  # the case documents why (nan_reason)
    where = has_nan(out)
    assert where is None, f"{name} ({dtype}, |{first}| <= {mag:g}, T={T}): NaN in {where} from finite input"


def test_case_table_documents_its_exceptions():
    """Every relaxed check carries its reason."""
    for name, case in CASES.items():
        if case.overflow is not None:
            assert case.nan_reason, name
        if case.lowp_tol != 8.0:
            assert case.reason, name
