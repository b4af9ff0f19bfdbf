"""FlashAttention-2 Triton kernels (03.13) against attention computed naively in float64.

Where there is no GPU the kernels run in Triton's CPU interpreter. Its mode is fixed when ``triton``
is first imported, so ``TRITON_INTERPRET=1`` is set below, before anything imports it (a
``tests/kernels/conftest.py`` may set it too). On a CUDA machine the same tests run the compiled
kernels on the GPU, plus bfloat16 and larger sizes through the autotuner.

The oracle is written here: ``softmax(Q K^T * scale + M) V`` in float64 (``M`` the causal mask,
last query aligned with last key), ``torch.logsumexp`` for the log-sum-exp and ``torch.autograd`` for
the gradients (and ``torch.nn.functional.scaled_dot_product_attention`` for the autograd Function
called with its defaults). Inputs are fresh on every run: each test draws its inputs from a
``torch.Generator`` seeded with a fresh seed, which it prints (pytest shows it on failure) and names
in every assertion message; ``LLMBOOK_TEST_SEED=<seed>`` replays it. Every kernel output is
allocated filled with NaN, so an element the kernel forgets to write fails the comparison.

Tolerances (``atol`` is scaled by ``max(1, max |reference|)``; ``rtol`` equal to it):
float32 ``2e-5`` (the interpreter's float32 dots are exact, and on CUDA the kernel uses IEEE float32
dots, not TF32); float16 ``5e-3`` for the output and log-sum-exp, ``1e-2`` for gradients; bfloat16
``3e-2`` and ``6e-2``.
"""

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton in this process

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import llmbook.kernels.flash_attention as fa  # noqa: E402
from llmbook.kernels import runtime  # noqa: E402
from llmbook.kernels.flash_attention import (  # noqa: E402
    FlashAttentionFunction,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_triton,
    length_bucket,
)


def _triton_mode() -> tuple[bool, bool]:
    """(usable, interpreted): triton imports, in the interpreter mode that TRITON_INTERPRET asks for."""
    if not runtime.triton_available():
        return False, False
    try:
        return True, runtime.interpreting()
    except runtime.TritonModeError:  # triton was imported by someone else before TRITON_INTERPRET was set
        return False, False


HAS_TRITON, INTERPRET = _triton_mode()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RUNS_KERNEL = HAS_TRITON and (INTERPRET or DEVICE == "cuda")
TOL = {  # dtype -> (output / lse, gradients), relative to max(1, max |reference|)
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 1e-2),
    torch.bfloat16: (3e-2, 6e-2),
}
needs_kernel = pytest.mark.skipif(not RUNS_KERNEL, reason="needs triton with CUDA, or TRITON_INTERPRET=1 set "
                                  "before triton is first imported")
requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA and compiled Triton (not the interpreter)")
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="checks the CUDA code paths on the CPU, through the "
                                      "interpreter")


@pytest.fixture
def seed():
    """A fresh seed per test run, printed (``LLMBOOK_TEST_SEED`` replays one)."""
    given_seed = os.environ.get("LLMBOOK_TEST_SEED")
    value = int(given_seed) if given_seed else random.SystemRandom().randrange(2**31)
    print(f"input seed {value} (replay with LLMBOOK_TEST_SEED={value})")
    return value


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Kernel outputs start as NaN, so unwritten elements cannot pass."""

    def alloc(shape, like, dtype=None):
        return torch.full(shape, float("nan"), device=like.device, dtype=like.dtype if dtype is None else dtype)

    monkeypatch.setattr(fa, "_alloc", alloc)


@dataclass(frozen=True)
class Case:
    B: int
    H: int  # query heads; 0 means (B, T, D) inputs with one head
    H_kv: int
    T_q: int
    T_k: int
    D: int
    causal: bool
    dtype: torch.dtype
    blocks: tuple[int, int]

    def __str__(self):
        heads = "BTD" if self.H == 0 else f"H{self.H}/{self.H_kv}"
        return (f"B{self.B}-{heads}-Tq{self.T_q}-Tk{self.T_k}-D{self.D}-{'causal' if self.causal else 'full'}-"
                f"{str(self.dtype)[6:]}-blocks{self.blocks[0]}x{self.blocks[1]}")


# small enough for the interpreter: odd lengths, T_q != T_k both ways (T_q > T_k leaves causal rows with no
# key), block_m != block_n both ways, grouped-query heads, (B, T, D) inputs, and D = 8, 16, 32, 64
CASES = [
    Case(2, 2, 2, 37, 37, 32, False, torch.float32, (16, 16)),
    Case(2, 2, 2, 37, 37, 32, True, torch.float32, (16, 32)),
    Case(2, 0, 0, 45, 19, 16, True, torch.float32, (32, 16)),
    Case(1, 2, 2, 19, 45, 64, True, torch.float16, (16, 16)),
    Case(1, 4, 2, 33, 50, 16, False, torch.float16, (16, 32)),
    Case(1, 0, 0, 21, 21, 8, True, torch.float32, (16, 16)),
]


def make_inputs(case: Case, seed: int, device: str = DEVICE, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    head = () if case.H == 0 else (case.H,)
    head_kv = () if case.H == 0 else (case.H_kv,)
    q = torch.randn(case.B, *head, case.T_q, case.D, generator=g, dtype=torch.float64) * scale
    k = torch.randn(case.B, *head_kv, case.T_k, case.D, generator=g, dtype=torch.float64) * scale
    v = torch.randn(case.B, *head_kv, case.T_k, case.D, generator=g, dtype=torch.float64)
    do = torch.randn(case.B, *head, case.T_q, case.D, generator=g, dtype=torch.float64)
    return [x.to(device=device, dtype=case.dtype) for x in (q, k, v, do)]


def oracle(q, k, v, causal, scale=None):
    """Float64 attention with the full score matrix: returns ``(o, lse)``; differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    if q.ndim == 4 and k.shape[1] != q.shape[1]:  # grouped-query heads: repeat each key/value head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    T_q, T_k = s.shape[-2:]
    i = torch.arange(T_q, device=s.device)[:, None]
    j = torch.arange(T_k, device=s.device)[None, :]
    keep = j <= i + (T_k - T_q) if causal else torch.ones(T_q, T_k, dtype=torch.bool, device=s.device)
    has_key = keep.any(-1, keepdim=True)
    s = torch.where(keep, s, float("-inf"))
    s = torch.where(has_key, s, 0.0)  # a query that sees no key: output 0, lse -inf
    o = torch.softmax(s, -1) * has_key @ v
    lse = torch.where(has_key.squeeze(-1), torch.logsumexp(s, -1), float("-inf"))
    return o, lse


def close(actual, expected, tol, what, seed, case):
    expected = expected.detach()
    actual = actual.detach().to(expected.device)  # a CUDA kernel's output against a float64 reference on the CPU
    atol = tol * max(1.0, expected[torch.isfinite(expected)].abs().max().item())
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=tol,
                               msg=lambda m: f"{what} of {case} (seed {seed}, atol {atol:.2g}): {m}")


@needs_kernel
@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V, torch.logsumexp, torch.autograd")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_output_and_lse_match_float64(case, seed):
    q, k, v, _ = make_inputs(case, seed)
    o, lse = flash_attention_forward(q, k, v, causal=case.causal, block_m=case.blocks[0], block_n=case.blocks[1])
    o_ref, lse_ref = oracle(q, k, v, case.causal)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    close(o, o_ref, TOL[case.dtype][0], "output", seed, case)
    close(lse, lse_ref, TOL[case.dtype][0], "log-sum-exp", seed, case)


def run_backward(case, seed):
    """Forward + backward through the kernel and through the float64 oracle: (o, leaves, o_ref, ref_leaves)."""
    q, k, v, do = make_inputs(case, seed)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = flash_attention_triton(*leaves, causal=case.causal, block_m=case.blocks[0], block_n=case.blocks[1])
    o.backward(do)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, _ = oracle(*ref_leaves, causal=case.causal)
    o_ref.backward(do.double())
    return o, leaves, o_ref, ref_leaves


@needs_kernel
@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V, torch.logsumexp, torch.autograd")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_backward_gradients_match_float64_autograd(case, seed):
    o, leaves, o_ref, ref_leaves = run_backward(case, seed)
    close(o, o_ref, TOL[case.dtype][0], "output", seed, case)
    for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        assert ours.grad.dtype == case.dtype and ours.grad.shape == ours.shape
        close(ours.grad, ref.grad, TOL[case.dtype][1], name, seed, case)


def _public_backward(case, seed, backend):
    """``flash_attention_backward`` on the forward's ``o, lse``, against float64 autograd of the oracle."""
    q, k, v, do = make_inputs(case, seed, device=DEVICE if backend == "triton" else "cpu")
    if backend == "triton":
        o, lse = flash_attention_forward(q, k, v, causal=case.causal, block_m=case.blocks[0], block_n=case.blocks[1])
    else:  # the forward's outputs, from the float64 oracle, in the case dtype
        o, lse = (x.to(dt) for x, dt in zip(oracle(q, k, v, case.causal), (q.dtype, torch.float32), strict=True))
    blocks = dict(block_m=case.blocks[0], block_n=case.blocks[1])
    grads = flash_attention_backward(q, k, v, o, lse, do, case.causal, backend=backend, **blocks)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    oracle(*ref_leaves, causal=case.causal)[0].backward(do.double())
    for name, ours, x, ref in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_leaves, strict=True):
        assert ours.shape == x.shape and ours.dtype == x.dtype
        close(ours, ref.grad, TOL[case.dtype][1], f"{backend} {name}", seed, case)


@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V and torch.autograd")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_public_backward_torch_path_matches_float64_autograd(case, seed):
    _public_backward(case, seed, "torch")


@needs_kernel
@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V and torch.autograd")
@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_public_backward_triton_path_matches_float64_autograd(case, seed):
    _public_backward(case, seed, "triton")


def test_public_backward_rejects_outputs_of_the_wrong_shape():
    q = torch.zeros(1, 2, 5, 8)
    o, lse = torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match="o and do must have shape"):
        flash_attention_backward(q, q, q, o, lse[..., :4], o, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        flash_attention_backward(q, q, q, o, lse, o, backend="cuda")


# causal tile bounds depend on the offset T_k - T_q modulo the block sizes: cover the residues where an
# off-by-one in a bound shows (0, +-1, +-2, 14, 15, 17) with both block orders
OFFSET_CASES = [Case(1, 1, 1, T_q, T_k, 16, True, torch.float32, blocks) for T_q, T_k, blocks in [
    (20, 21, (16, 16)), (20, 34, (16, 16)), (20, 35, (16, 16)), (22, 20, (16, 16)), (35, 20, (16, 16)),
    (20, 37, (16, 16)), (18, 32, (32, 16)), (17, 32, (16, 32)), (33, 31, (32, 16)), (40, 40, (16, 32)),
]]


@needs_kernel
@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V, torch.logsumexp, torch.autograd")
@pytest.mark.parametrize("case", OFFSET_CASES, ids=str)
def test_causal_bounds_at_every_offset(case, seed):
    q, k, v, do = make_inputs(case, seed)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = flash_attention_triton(*leaves, causal=True, block_m=case.blocks[0], block_n=case.blocks[1])
    o.backward(do)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, _ = oracle(*ref_leaves, causal=True)
    o_ref.backward(do.double())
    close(o, o_ref, TOL[case.dtype][0], "output", seed, case)
    for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        close(ours.grad, ref.grad, TOL[case.dtype][1], name, seed, case)


@needs_kernel
@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V, torch.logsumexp, torch.autograd")
@settings(max_examples=8, deadline=None, derandomize=True)
@given(T_q=st.integers(1, 40), T_k=st.integers(1, 40), D=st.sampled_from([16, 32]), causal=st.booleans(),
       scale=st.floats(0.05, 2.0), data_seed=st.integers(0, 2**31 - 1))
def test_forward_equals_naive_for_any_lengths_and_scale(T_q, T_k, D, causal, scale, data_seed):
    """The law: tiling changes nothing, whatever the lengths, the mask and the score scale."""
    case = Case(1, 2, 2, T_q, T_k, D, causal, torch.float32, (16, 16))
    q, k, v, _ = make_inputs(case, data_seed, scale=2.0)
    o, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale, block_m=16, block_n=16)
    o_ref, lse_ref = oracle(q, k, v, causal, scale)
    close(o, o_ref, 2e-5, "output", data_seed, case)
    close(lse, lse_ref, 2e-5, "log-sum-exp", data_seed, case)


@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V, torch.logsumexp, torch.autograd")
def test_dispatcher_matches_float64_with_the_torch_backend(seed):
    case = Case(2, 4, 2, 23, 31, 8, True, torch.float32, (16, 16))
    q, k, v, do = make_inputs(case, seed, device="cpu")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = flash_attention(*leaves, causal=True, backend="torch")
    o.backward(do)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, _ = oracle(*ref_leaves, causal=True)
    o_ref.backward(do.double())
    close(o, o_ref, 2e-5, "output", seed, case)
    for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        close(ours.grad, ref.grad, 2e-5, name, seed, case)
    q3, k3, v3 = q[:, 0], k[:, 0], v[:, 0]  # (B, T, D) inputs keep their shape
    assert flash_attention(q3, k3, v3, backend="torch").shape == q3.shape


def test_auto_backend_runs_torch_off_cuda(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("auto picked triton for CPU tensors")

    monkeypatch.setattr(fa, "flash_attention_triton", refuse)
    q = torch.randn(1, 2, 5, 16)
    o = flash_attention(q, q, q, causal=True)
    torch.testing.assert_close(o.double(), oracle(q, q, q, True)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, kwargs, error, match",
    [
        ((1, 2, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), dict(backend="cuda"), ValueError, "backend must be one of"),
        ((1, 2, 4, 16), (1, 4, 16), (1, 4, 16), {}, ValueError, r"all be \(B, T, D\) or all"),
        ((1, 3, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, ValueError, r"H \(3\) must be a multiple of .* H_kv \(2\)"),
        ((1, 2, 4, 16), (1, 2, 4, 8), (1, 2, 4, 8), {}, ValueError, "to match q"),
        ((1, 2, 4, 16), (1, 2, 4, 16), (1, 2, 5, 16), {}, ValueError, "must have the same shape"),
        ((1, 2, 0, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, ValueError, "empty input"),
        ((1, 2, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), dict(scale=-1.0), ValueError, r"scale .*-1\.0"),
    ],
)
def test_bad_shapes_and_arguments_are_rejected(q_shape, k_shape, v_shape, kwargs, error, match):
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **kwargs)


def test_bad_dtypes_are_rejected():
    x = torch.randn(1, 2, 4, 16)
    with pytest.raises(TypeError, match="floating-point"):
        flash_attention(x.long(), x.long(), x.long())
    with pytest.raises(TypeError, match="share dtype"):
        flash_attention(x, x.double(), x)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    "dtype, D, blocks, error, match",
    [
        (torch.float64, 16, (16, 16), TypeError, r"supports float16, bfloat16, float32, got torch.float64"),
        (torch.float32, 160, (16, 16), ValueError, r"D <= 128, got D = 160"),
        (torch.float32, 16, (16, None), ValueError, "both block_m and block_n"),
        (torch.float32, 16, (24, 16), ValueError, "power of two >= 16"),
        (torch.float32, 16, (16, 8), ValueError, "power of two >= 16"),
    ],
)
def test_what_the_kernel_cannot_run_gets_a_clear_error(dtype, D, blocks, error, match):
    x = torch.randn(1, 2, 4, D, dtype=dtype, device=DEVICE)
    with pytest.raises(error, match=match):
        flash_attention_triton(x, x, x, block_m=blocks[0], block_n=blocks[1])
    with pytest.raises(error, match=match):
        flash_attention_forward(x, x, x, block_m=blocks[0], block_n=blocks[1])
    with pytest.raises(error, match=match):
        flash_attention(x, x, x, backend="triton", block_m=blocks[0], block_n=blocks[1])


@pytest.mark.skipif(not INTERPRET, reason="only the interpreter computes bfloat16 dots wrongly")
def test_interpreter_refuses_bfloat16_and_auto_falls_back(seed):
    """Issue 11 item 9: bfloat16 in the interpreter is a clear TypeError; ``auto`` runs PyTorch instead."""
    case = Case(1, 2, 2, 20, 20, 16, True, torch.bfloat16, (16, 16))
    q, k, v, _ = make_inputs(case, seed)
    for fn in (flash_attention_triton, flash_attention_forward):
        with pytest.raises(TypeError, match=r"refuses torch.bfloat16 in Triton's CPU interpreter: .*tl.dot"):
            fn(q, k, v, causal=True)
    with pytest.raises(TypeError, match="bfloat16"):
        flash_attention(q, k, v, causal=True, backend="triton")
    o = flash_attention(q, k, v, causal=True)  # auto: PyTorch
    close(o, oracle(q, k, v, True)[0], TOL[torch.bfloat16][0], "output", seed, case)


class _FakeCuda:
    """Stands in for a CUDA tensor in the backend choice (only what the choice reads)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.is_cuda, self.device = shape, dtype, True, torch.device("cuda")


@pytest.mark.skipif(not INTERPRET, reason="the choice reads the mode triton runs in")
@pytest.mark.parametrize("dtype, D, blocks, expected", [
    (torch.float32, 64, (None, None), "triton"),
    (torch.float16, 128, (32, 16), "triton"),
    (torch.float32, 160, (None, None), "torch"),  # D > 128
    (torch.float64, 64, (None, None), "torch"),  # no float64 kernel
    (torch.bfloat16, 64, (None, None), "torch"),  # the interpreter's bfloat16 dots are wrong
    (torch.float32, 64, (8, 8), "torch"),  # tiles the kernel cannot use
])
def test_auto_backend_falls_back_to_torch_where_the_kernel_cannot_run(dtype, D, blocks, expected):
    assert fa._auto_backend(_FakeCuda((1, 2, 5, D), dtype), *blocks) == expected
    assert fa._auto_backend(torch.zeros(1, 2, 5, D, dtype=dtype), *blocks) == "torch"  # CPU tensors: always


@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V, torch.autograd")
@pytest.mark.parametrize("D", [160, 8])
def test_auto_backend_runs_what_the_kernel_cannot(D, seed):
    """D > 128 or tiny tiles: ``auto`` runs PyTorch on any device instead of raising."""
    case = Case(1, 2, 2, 9, 13, D, True, torch.float32, (8, 8))
    q, k, v, do = make_inputs(case, seed)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = flash_attention(*leaves, causal=True, block_m=8, block_n=8)
    o.backward(do)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, _ = oracle(*ref_leaves, causal=True)
    o_ref.backward(do.double())
    close(o, o_ref, 1e-5, "output", seed, case)
    for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        close(ours.grad, ref.grad, 1e-5, name, seed, case)


@needs_kernel
@pytest.mark.parametrize("backend, blocks", [("triton", (16, 32)), ("torch", (8, 4)), ("auto", (16, 16))])
def test_block_sizes_reach_every_backend(monkeypatch, backend, blocks, seed):
    """``block_m``/``block_n`` get to the Triton launch and to the tiled PyTorch version alike."""
    import llmbook.lm.flash as flash

    seen = []
    forward, tiled = fa._forward, flash.tiled_attention
    monkeypatch.setattr(fa, "_forward", lambda *a, **kw: seen.append(("triton", a[5])) or forward(*a, **kw))
    monkeypatch.setattr(flash, "tiled_attention",
                        lambda *a, **kw: seen.append(("torch", (kw["block_q"], kw["block_k"]))) or tiled(*a, **kw))
    case = Case(1, 2, 2, 21, 37, 16, True, torch.float32, blocks)
    q, k, v, _ = make_inputs(case, seed)
    o = flash_attention(q, k, v, causal=True, backend=backend, block_m=blocks[0], block_n=blocks[1])
    ran = "triton" if backend == "triton" or (backend == "auto" and DEVICE == "cuda") else "torch"
    assert seen == [(ran, blocks)], f"seed {seed}: {seen}"
    close(o, oracle(q, k, v, True)[0], 2e-5, "output", seed, case)


@needs_kernel
@pytest.mark.equation("03.13", oracle="torch.nn.functional.scaled_dot_product_attention in float64, torch.autograd")
@pytest.mark.parametrize("shape", [(2, 37, 16), (1, 2, 37, 32)], ids=["BTD", "BHTD"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_autograd_function_with_defaults_matches_torch_sdpa(shape, causal, seed):
    """``FlashAttentionFunction.apply(q, k, v)`` is used like ``TiledAttention``: defaults, 3-D or 4-D."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    leaves = [x.to(DEVICE, torch.float32).requires_grad_() for x in (q, k, v)]
    o = FlashAttentionFunction.apply(*leaves) if not causal else FlashAttentionFunction.apply(*leaves, True)
    lse = o.grad_fn.saved_tensors[-1]  # read before backward frees it
    o.backward(do.to(DEVICE, torch.float32))
    assert lse.shape == shape[:-1] and lse.dtype == torch.float32, f"saved log-sum-exp {tuple(lse.shape)}"
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=causal)  # scale 1/sqrt(D) by default
    o_ref.backward(do)
    case = f"FlashAttentionFunction{shape} causal={causal}"
    close(o, o_ref, 2e-5, "output", seed, case)
    close(lse, oracle(q, k, v, causal)[1], 2e-5, "log-sum-exp", seed, case)
    for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        assert ours.grad.shape == ours.shape
        close(ours.grad, ref.grad, 2e-5, name, seed, case)


@interpreter_only
def test_interpreter_uses_fixed_block_sizes_by_default(monkeypatch, seed):
    """Without block sizes the interpreter (which cannot autotune) launches ``INTERPRETER_BLOCKS``."""
    seen = []
    forward = fa._forward
    monkeypatch.setattr(fa, "_forward", lambda *a, **kw: seen.append(a[5]) or forward(*a, **kw))
    case = Case(1, 0, 0, 10, 10, 16, False, torch.float32, fa.INTERPRETER_BLOCKS)
    q, k, v, _ = make_inputs(case, seed)
    close(flash_attention_triton(q, k, v), oracle(q, k, v, False)[0], 2e-5, "output", seed, case)
    assert seen == [fa.INTERPRETER_BLOCKS]


def test_length_buckets_are_powers_of_two():
    assert {length_bucket(T) for T in range(100, 129)} == {128}
    assert [length_bucket(T) for T in (1, 15, 16, 17, 32, 33, 4096, 4097)] == [16, 16, 16, 32, 32, 64, 4096, 8192]


@interpreter_only
def test_autotuning_is_keyed_on_length_buckets(monkeypatch, seed):
    """A KV cache growing from 100 to 128 keys is tuned once; 129 keys (the next bucket) tunes again."""
    kernels = fa._kernels()
    tuned = kernels.TUNED["fwd"]
    assert tuned.keys == kernels.TUNING_KEY and kernels.TUNING_KEY[:2] == ["TQ_BUCKET", "TK_BUCKET"]
    benched = []

    def fake_bench(fn, quantiles):  # the interpreter cannot time kernels: rank the candidates in order
        benched.append(1)
        return [float(len(benched))] * 3

    monkeypatch.setattr(kernels, "_tuning_bench", fake_bench)
    monkeypatch.setattr(tuned, "cache", {})  # forget what earlier tests tuned
    monkeypatch.setattr(fa, "INTERPRETER_BLOCKS", None)  # autotune, as on CUDA
    runs = {}
    for T_k in (100, 101, 127, 128, 129):
        case = Case(1, 1, 1, 1, T_k, 16, True, torch.float16, (0, 0))  # one new query against the cache
        q, k, v, _ = make_inputs(case, seed)
        o, _ = flash_attention_forward(q, k, v, causal=True)
        close(o, oracle(q, k, v, True)[0], TOL[case.dtype][0], "output", seed, case)
        runs[T_k] = len(benched)
    n = len(kernels.TUNING["fwd"][64])
    assert runs == {100: n, 101: n, 127: n, 128: n, 129: 2 * n}, f"benchmark calls after each length: {runs}"
    assert sorted(key[:2] for key in tuned.cache) == [(16, 128), (16, 256)]


@interpreter_only
@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_every_autotuning_candidate_computes_the_same_attention(kind, seed):
    """Each (BLOCK_M, BLOCK_N) the autotuner may pick on CUDA, run with explicit blocks in the interpreter."""
    case = Case(1, 2, 1, 70, 45, 16, True, torch.float32, (0, 0))
    q, k, v, do = make_inputs(case, seed)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = oracle(*ref_leaves, causal=True)
    o_ref.backward(do.double())
    for bm, bn in sorted({tile[:2] for tiles in fa._kernels().TUNING[kind].values() for tile in tiles}):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = flash_attention_triton(*leaves, causal=True, block_m=bm, block_n=bn)
        o.backward(do)
        case = Case(1, 2, 1, 70, 45, 16, True, torch.float32, (bm, bn))
        close(o, o_ref, 2e-5, "output", seed, case)
        for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
            close(ours.grad, ref.grad, 2e-5, name, seed, case)


@interpreter_only
def test_autotuner_plumbing_in_the_interpreter(monkeypatch, seed):
    """The autotuned launch (grid from the chosen config, tuning key, warm-up compile) without a GPU.

    The interpreter cannot time kernels, so the tuning benchmark is replaced: it runs each candidate
    once and ranks the last one fastest, so the result comes from a different candidate than the first.
    """
    ran = []

    def fake_bench(fn, quantiles):
        fn()
        ran.append(1)
        return [1.0 / len(ran)] * 3

    kernels = fa._kernels()
    monkeypatch.setattr(kernels, "_tuning_bench", fake_bench)
    for kind in ("fwd", "dkdv", "dq"):
        monkeypatch.setattr(kernels.TUNED[kind], "cache", {})  # a fresh tuning key
    monkeypatch.setattr(fa, "INTERPRETER_BLOCKS", None)  # autotune, as on CUDA
    case = Case(1, 2, 2, 29 + seed % 7, 33, 32, bool(seed % 2), torch.float16, (0, 0))
    q, k, v, do = make_inputs(case, seed)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = FlashAttentionFunction.apply(*leaves, case.causal)
    o.backward(do)
    tuning = kernels.TUNING
    assert len(ran) >= len(tuning["fwd"][64]), "the autotuner did not try the forward candidates"
    best = kernels.TUNED["fwd"].best_config
    assert (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages) == tuning["fwd"][64][-1]
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, _ = oracle(*ref_leaves, causal=case.causal)
    o_ref.backward(do.double())
    close(o, o_ref, TOL[case.dtype][0], "output", seed, case)
    for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        close(ours.grad, ref.grad, TOL[case.dtype][1], name, seed, case)
    fa._precompile(("fwd", "pre", "dkdv", "dq"), torch.float16, 64, True, H=16, device="cpu")  # compiles nothing here


def test_import_needs_no_triton():
    """``import llmbook``, the registry's import of every module and the torch backend work without triton."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, llmbook, llmbook.kernels.flash_attention as fa\n"
            "from llmbook.registry import load_all\n"
            "load_all()\n"
            "assert not fa.triton_available()\n"
            "q = torch.randn(1, 3, 8)\n"
            "assert fa.flash_attention(q, q, q, causal=True).shape == (1, 3, 8)\n"
            "try:\n    fa.flash_attention_triton(q, q, q)\nexcept ImportError as e:\n    print('ok', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]
    assert "needs the optional dependency triton" in out.stdout, out.stdout


# ---------------------------------------------------------------------------------------------- CUDA only

CUDA_CASES = [
    Case(2, 4, 4, 1000, 1000, 128, True, torch.bfloat16, (0, 0)),
    Case(2, 4, 4, 1024, 1024, 64, False, torch.bfloat16, (0, 0)),
    Case(1, 8, 2, 513, 1200, 128, True, torch.float16, (0, 0)),
    Case(1, 4, 4, 1200, 700, 64, True, torch.bfloat16, (0, 0)),
    Case(1, 4, 4, 300, 300, 32, False, torch.float32, (0, 0)),
]


@requires_cuda
@pytest.mark.equation("03.13", oracle="float64 softmax(QK^T*scale + mask)V, torch.logsumexp, torch.autograd")
@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_cuda_autotuned_forward_and_backward_match_float64(case, seed):
    q, k, v, do = make_inputs(case, seed)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = flash_attention(*leaves, causal=case.causal)  # auto: Triton on CUDA, autotuned block sizes
    o.backward(do)
    _, lse = flash_attention_forward(q, k, v, causal=case.causal)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = oracle(*ref_leaves, causal=case.causal)
    o_ref.backward(do.double())
    close(o, o_ref, TOL[case.dtype][0], "output", seed, case)
    close(lse, lse_ref, TOL[case.dtype][0], "log-sum-exp", seed, case)
    for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        close(ours.grad, ref.grad, TOL[case.dtype][1], name, seed, case)


@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_small_cases_in_bfloat16(case, seed):
    case = Case(case.B, case.H, case.H_kv, case.T_q, case.T_k, case.D, case.causal, torch.bfloat16, case.blocks)
    o, leaves, o_ref, ref_leaves = run_backward(case, seed)
    close(o, o_ref, TOL[case.dtype][0], "output", seed, case)
    for name, ours, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        close(ours.grad, ref.grad, TOL[case.dtype][1], name, seed, case)


@requires_cuda
def test_cuda_memory_grows_linearly_in_T():
    """No T x T buffer: doubling T doubles the forward's extra memory (naive attention would quadruple it)."""
    extra = []
    for T in (4096, 8192):
        q = torch.randn(1, 8, T, 64, device="cuda", dtype=torch.bfloat16)
        flash_attention(q, q, q)  # compile / autotune outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        flash_attention(q, q, q)
        torch.cuda.synchronize()
        extra.append(torch.cuda.max_memory_allocated() - before)
    assert extra[1] <= 2.2 * extra[0], f"extra bytes at T = 4096, 8192: {extra}"
