"""MoE dispatch: the loop reference, the grouped PyTorch version and the Triton kernel agree.

The oracle is an independent float64 computation, ``einsum("nk,nc,nkcd->nd", w, x, W[ids])``, that
gathers every token's expert matrices directly (no sorting, no grouping).

Without a GPU the Triton kernel runs under the Triton interpreter. Its mode is fixed when ``triton``
is first imported (``triton.jit`` decorates triton's own library then), so ``TRITON_INTERPRET=1`` is
set below before anything imports triton, and only where there is no CUDA: without CUDA no compiled
Triton kernel could run anyway, so nothing else in the session changes behaviour. The interpreter
cannot autotune and mishandles bfloat16, so those tests use explicit block sizes, tiny shapes, float32
and float16; on a CUDA machine the same tests run the compiled kernel on the GPU, and the bfloat16
tests at the bottom run too. The CPU error paths run in a subprocess with a clean environment.
Every random input comes from a ``torch.Generator`` with a seed that is part of the test id (or, in
the hypothesis tests, is computed from the drawn example hypothesis prints) and of the failure message.

Tolerances: float64 ``1e-12``; float32 ``rtol = atol = 1e-5``; float16 ``rtol = atol = 1e-2``;
bfloat16 on the GPU ``rtol = atol = 3e-2`` (relative to outputs of size ~1).
"""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton in this process

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from llmbook.kernels import runtime  # noqa: E402
from llmbook.kernels.moe import (  # noqa: E402
    align_block_size,
    moe_dispatch,
    moe_dispatch_loop,
    moe_dispatch_torch,
    moe_dispatch_triton,
    permute_by_expert,
    triton_available,
)

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5),
       torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
HAS_TRITON = triton_available()
try:
    INTERPRET, MODE = HAS_TRITON and runtime.interpreting(), ""
except runtime.TritonModeError:  # something (transformers does) imported triton before this module could set the mode
    INTERPRET, MODE = False, ": triton was imported before TRITON_INTERPRET=1 was set; run tests/kernels first"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
runs_kernel = pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or DEVICE == "cuda")),
                                 reason="needs triton, with CUDA or TRITON_INTERPRET=1" + MODE)
requires_cuda = pytest.mark.skipif(not (HAS_TRITON and DEVICE == "cuda"), reason="needs CUDA and compiled Triton")
BLOCKS = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)


def routing(kind, N, E, K, g):
    """(topk_ids, topk_weights): balanced, skewed (most tokens on expert 0), or with empty experts."""
    if kind == "balanced":
        ids = (torch.arange(N).unsqueeze(1) + torch.arange(K) * (E // K or 1)) % E
    else:
        logits = torch.randn(N, E, generator=g)
        if kind == "skewed":
            logits[:, 0] += 4.0
        elif kind == "empty":
            logits[:, E // 2:] = float("-inf")  # the upper half of the experts receive nothing
        ids = torch.topk(logits + 1e-3 * torch.arange(E), K, dim=-1).indices
    w = torch.rand(N, K, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def case(kind, N, C, D, E, K, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    W = torch.randn(E, C, D, generator=g) / C**0.5
    ids, w = routing(kind, N, E, K, g)
    return x.to(device, dtype), W.to(device, dtype), ids.to(device), w.to(device, dtype)


def oracle(x, W, ids, w):
    x, W, w = x.double(), W.double(), w.double()
    return torch.einsum("nk,nc,nkcd->nd", w, x, W[ids])


def close(actual, expected, dtype, what, seed):
    torch.testing.assert_close(actual, expected, **TOL[dtype], msg=lambda m: f"{what} (input seed {seed}): {m}")


CASES = [("balanced", 32, 16, 16, 4, 2), ("skewed", 37, 24, 20, 5, 2), ("empty", 19, 16, 32, 6, 3),
         ("skewed", 5, 16, 16, 8, 1)]


@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("kind, N, C, D, E, K", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_loop_and_grouped_torch_match_the_oracle(kind, N, C, D, E, K, dtype, seed):
    x, W, ids, w = case(kind, N, C, D, E, K, dtype, seed=seed)
    ref = oracle(x, W, ids, w)
    for use_grouped_mm in ([None, False, True] if dtype == torch.float32 and C % 4 == 0 and D % 4 == 0 else [None]):
        y = moe_dispatch_torch(x, W, ids, w, use_grouped_mm=use_grouped_mm)
        assert y.dtype == dtype and y.shape == (N, D)
        close(y.double(), ref, dtype, f"grouped torch (use_grouped_mm={use_grouped_mm})", seed)
    close(moe_dispatch_loop(x, W, ids, w).double(), ref, dtype, "loop", seed)


@runs_kernel
@pytest.mark.parametrize("seed", [1])
@pytest.mark.parametrize("kind, N, C, D, E, K", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_the_oracle_and_the_other_backends(kind, N, C, D, E, K, dtype, seed):
    x, W, ids, w = case(kind, N, C, D, E, K, dtype, seed=seed, device=DEVICE)
    y = moe_dispatch_triton(x, W, ids, w, **BLOCKS)
    assert y.dtype == dtype and y.shape == (N, D)
    close(y.double(), oracle(x, W, ids, w), dtype, "triton vs einsum", seed)
    close(y, moe_dispatch_torch(x, W, ids, w), dtype, "triton vs grouped torch", seed)
    close(y, moe_dispatch_loop(x, W, ids, w), dtype, "triton vs loop", seed)


@runs_kernel
@pytest.mark.parametrize("seed", [2])
def test_triton_kernel_with_several_k_blocks_and_non_contiguous_weights(seed):
    # C = 40 spans three BLOCK_K = 16 steps (the last one masked); W is a transposed view
    x, W, ids, w = case("skewed", 21, 40, 24, 3, 2, torch.float32, seed=seed, device=DEVICE)
    W_t = W.transpose(1, 2).contiguous().transpose(1, 2)
    assert not W_t.is_contiguous()
    close(moe_dispatch_triton(x, W_t, ids, w, BLOCK_M=16, BLOCK_N=32, BLOCK_K=16).double(), oracle(x, W, ids, w),
          torch.float32, "triton with non-contiguous W vs einsum", seed)


@pytest.mark.parametrize("seed", [0])
def test_auto_backend_is_torch_on_the_cpu(seed):
    x, W, ids, w = case("balanced", 8, 16, 16, 4, 2, torch.float32, seed=seed)
    torch.testing.assert_close(moe_dispatch(x, W, ids, w), moe_dispatch_torch(x, W, ids, w), rtol=0, atol=0)
    close(moe_dispatch(x, W, ids, w, backend="loop").double(), oracle(x, W, ids, w), torch.float32, "loop", seed)


def test_auto_backend_prefers_grouped_mm_then_triton_on_cuda(monkeypatch):
    """The choice on CUDA, without a GPU: a stand-in that says it is on CUDA, and the two conditions patched."""
    from llmbook.kernels import moe as moe_mod

    class OnCuda(torch.Tensor):
        is_cuda = True

    x, W = torch.zeros(4, 16).as_subclass(OnCuda), torch.zeros(2, 16, 16)
    assert moe_mod._auto_backend(torch.zeros(4, 16), W) == "torch"  # a CPU tensor
    for suits, supported, expected in ((True, True, "torch"), (False, True, "triton"), (False, False, "torch")):
        monkeypatch.setattr(moe_mod, "_grouped_mm_suits", lambda xs, w, s=suits: s)
        monkeypatch.setattr(moe_mod.runtime, "unsupported", lambda op, t, dtypes, ok=supported: None if ok else "no")
        assert moe_mod._auto_backend(x, W) == expected, (suits, supported)


@pytest.mark.skipif(not INTERPRET, reason="only the interpreter computes bfloat16 dots wrongly")
@pytest.mark.parametrize("seed", [3])
def test_interpreter_refuses_bfloat16(seed):
    """Issue 11 item 9: a clear TypeError naming the dtype and the reason, not values of 1e9."""
    x, W, ids, w = case("balanced", 8, 16, 16, 4, 2, torch.bfloat16, seed=seed)
    with pytest.raises(TypeError, match=r"refuses torch.bfloat16 in Triton's CPU interpreter: .*tl.dot"):
        moe_dispatch_triton(x, W, ids, w, **BLOCKS)
    with pytest.raises(TypeError, match="bfloat16"):
        moe_dispatch(x, W, ids, w, backend="triton", **BLOCKS)
    close(moe_dispatch(x, W, ids, w).double(), oracle(x, W, ids, w), torch.bfloat16, "auto (torch)", seed)


def test_permute_by_expert_rejects_ids_outside_the_experts():
    """Issue 11: an id equal to E (or negative) used to be miscounted silently by bincount."""
    for bad in ([[0, 4]], [[-1, 2]]):
        with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, E\) = \[0, 4\)"):
            permute_by_expert(torch.tensor(bad), 4)
        with pytest.raises(ValueError, match=r"must lie in \[0, E\)"):
            align_block_size(torch.tensor(bad), 4, 16)
    with pytest.raises(TypeError, match="integer expert ids"):
        permute_by_expert(torch.tensor([[0.0, 1.0]]), 4)
    with pytest.raises((TypeError, ValueError), match="E"):
        permute_by_expert(torch.tensor([[0, 1]]), 0)
    order, counts = permute_by_expert(torch.tensor([[3, 0]]), 4)  # E - 1 is fine
    assert order.tolist() == [1, 0] and counts.tolist() == [1, 0, 0, 1]


def test_bad_input_is_rejected():
    x, W, ids, w = case("balanced", 8, 16, 16, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        moe_dispatch(x, W, ids, w, backend="cuda")
    with pytest.raises(ValueError, match="disagree on C"):
        moe_dispatch(x[:, :8], W, ids, w)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, E\) = \[0, 4\)"):
        moe_dispatch(x, W, ids + 3, w)
    with pytest.raises(ValueError, match=r"topk_ids and topk_weights must both be \(N, K\)"):
        moe_dispatch(x, W, ids, w[:, :1])
    with pytest.raises(TypeError, match="share a floating dtype"):
        moe_dispatch(x, W.double(), ids, w)
    with pytest.raises(TypeError, match="integer expert ids"):
        moe_dispatch(x, W, ids.float(), w)
    with pytest.raises(ValueError, match="empty operands"):
        moe_dispatch(x[:0], W, ids[:0], w[:0])
    with pytest.raises(ValueError, match="BLOCK_M must be a power of two >= 16"):
        moe_dispatch_triton(x, W, ids, w, BLOCK_M=24)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(N=st.integers(1, 40), E=st.integers(1, 7), block=st.sampled_from([1, 4, 16]), data=st.data())
def test_alignment_lists_every_assignment_once_in_single_expert_blocks(N, E, block, data):
    K = data.draw(st.integers(1, E))
    g = torch.Generator().manual_seed(N * 100 + E * 10 + K)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    sorted_ids, block_expert = align_block_size(ids, E, block)
    NK = N * K
    assert sorted_ids.numel() == block_expert.numel() * block
    real = sorted_ids[sorted_ids < NK].long()
    assert torch.equal(torch.sort(real).values, torch.arange(NK))  # every assignment exactly once
    assert int((sorted_ids == NK).sum()) == sorted_ids.numel() - NK  # the rest is padding
    flat = ids.reshape(-1)
    per_row_expert = block_expert.repeat_interleave(block)
    mask = sorted_ids < NK
    assert torch.equal(flat[sorted_ids[mask].long()], per_row_expert[mask].long())  # rows sit in their expert's block
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(torch.bincount(block_expert.long(), minlength=E), (counts + block - 1) // block)
    order, c2 = permute_by_expert(ids, E)
    assert torch.equal(c2, counts) and bool((flat[order][1:] >= flat[order][:-1]).all())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(N=st.integers(1, 24), E=st.integers(1, 6), D=st.sampled_from([4, 8, 12]), data=st.data())
def test_grouped_torch_equals_the_oracle_for_any_routing(N, E, D, data):
    K = data.draw(st.integers(1, E))
    g = torch.Generator().manual_seed(N + 7 * E + 13 * K)
    x = torch.randn(N, 8, generator=g, dtype=torch.float64)
    W = torch.randn(E, 8, D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, E, (N, K), generator=g)  # duplicates allowed: they simply add up
    w = torch.rand(N, K, generator=g, dtype=torch.float64)
    close(moe_dispatch_torch(x, W, ids, w), oracle(x, W, ids, w), torch.float64, "grouped torch", N + 7 * E + 13 * K)


CLEAN_PROCESS = """
import sys
sys.modules["triton"] = None  # as if triton were not installed
import torch
import llmbook
import llmbook.kernels.flash_attention as fa
import llmbook.kernels.moe as m
from llmbook.kernels import runtime
from llmbook.registry import load_all
load_all()  # imports every kernel module
x, W, ids, w = torch.ones(2, 16), torch.ones(1, 16, 16), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
q = torch.ones(1, 4, 16)
assert not m.triton_available() and m.moe_dispatch(x, W, ids, w).sum().item() == 512.0
assert fa.flash_attention(q, q, q).shape == q.shape
assert not any(name.startswith("triton") for name in sys.modules if sys.modules[name] is not None)
calls = {"moe_dispatch": lambda: m.moe_dispatch(x, W, ids, w, backend="triton"),
         "flash_attention": lambda: fa.flash_attention(q, q, q, backend="triton")}


def error(call):
    try:
        call()
    except Exception as err:
        return err
    raise AssertionError("no error")


for op, call in calls.items():  # the same failure, the same exception and message, in both kernels
    err = error(call)
    assert type(err) is runtime.TritonUnavailableError and isinstance(err, ImportError), repr(err)
    assert str(err).startswith(f"the Triton backend of {op} needs the optional dependency triton"), err
del sys.modules["triton"]  # now triton imports, compiled (no TRITON_INTERPRET), and CPU tensors are refused
if m.triton_available() and not torch.cuda.is_available():
    for op, call in calls.items():
        err = error(call)
        assert type(err) is ValueError, repr(err)
        assert str(err).startswith(f"the Triton backend of {op} needs CUDA tensors, got device cpu"), err
print("ok")
"""


def test_import_needs_neither_triton_nor_a_gpu_and_errors_are_clear():
    code = CLEAN_PROCESS
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="compares with triton's own parse of the variable")
@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", "y", "0", "false", "no", "off", "", "2", " 1"])
def test_interpret_variable_is_parsed_as_triton_parses_it(monkeypatch, value):
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert runtime.interpret_requested() == triton.knobs.runtime.interpret, f"TRITON_INTERPRET={value!r}"


@pytest.mark.skipif(not INTERPRET, reason="needs triton imported in the interpreter mode")
def test_changing_the_interpreter_variable_after_import_is_the_same_error_in_both_kernels(monkeypatch):
    import llmbook.kernels.flash_attention as fa

    x, W, ids, w = case("balanced", 8, 16, 16, 4, 2, torch.float32)
    q = torch.zeros(1, 4, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    messages = []
    for call in (lambda: moe_dispatch_triton(x, W, ids, w, **BLOCKS), lambda: fa.flash_attention_triton(q, q, q)):
        with pytest.raises(runtime.TritonModeError, match="TRITON_INTERPRET changed after triton was imported") as err:
            call()
        messages.append(str(err.value))
    assert messages[0] == messages[1]


# ================================================================= on a GPU: the compiled kernel, bfloat16


@requires_cuda
@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("kind, N, C, D, E, K", [("balanced", 256, 128, 256, 8, 2), ("skewed", 1000, 256, 128, 16, 2),
                                                  ("empty", 333, 64, 64, 8, 4)])
def test_gpu_bf16_triton_and_grouped_torch_match_the_loop(kind, N, C, D, E, K, seed):
    x, W, ids, w = case(kind, N, C, D, E, K, torch.bfloat16, seed=seed, device="cuda")
    ref = oracle(x, W, ids, w)
    y_loop = moe_dispatch_loop(x, W, ids, w)
    y_torch = moe_dispatch_torch(x, W, ids, w)
    y_triton = moe_dispatch(x, W, ids, w, backend="triton")
    assert moe_dispatch(x, W, ids, w).equal(y_torch)  # auto: grouped_mm suits bfloat16 on sm80+, and is faster
    for name, y in (("loop", y_loop), ("torch", y_torch), ("triton", y_triton)):
        assert y.dtype == torch.bfloat16
        close(y.double(), ref, torch.bfloat16, f"{name} vs einsum", seed)
    close(y_triton, y_loop, torch.bfloat16, "triton vs loop", seed)
    close(y_torch, y_loop, torch.bfloat16, "torch vs loop", seed)
