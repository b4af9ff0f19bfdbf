"""Chapter 2, embeddings and the LM head (ids 02.01-02.04), against torch and transformers' GPT-2.

Tolerances: lookups are copies, so they must be *exactly* equal (``atol = 0``); float32 products
against a torch or transformers oracle use ``rtol = atol = 1e-5`` (``F32``); float64 closed forms
use ``1e-12`` (``F64``).
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from llmbook.lm.embeddings import (
    LMHead,
    TokenEmbedding,
    TokenPositionEmbedding,
    embedding_lookup,
    linear,
    lm_head,
    one_hot_embedding,
    tied_lm_head,
    token_position_embedding,
)

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
EXACT = dict(rtol=0, atol=0)


def tiny_gpt2(V=50, T_max=16, d=8):
    """A randomly initialised two-layer GPT-2 (no download), dropout off, in eval mode."""
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=T_max, n_embd=d, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


# ================================================================= 02.01 token embedding lookup


@pytest.mark.equation("02.01", oracle="torch.nn.functional.embedding; nn.Embedding with copied weights; one-hot @ E")
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (0,)])
def test_lookup_matches_torch_embedding(shape):
    V, d = 11, 6
    E = torch.randn(V, d)
    ids = torch.randint(0, V, shape)
    torch.testing.assert_close(embedding_lookup(ids, E), F.embedding(ids, E), **EXACT)
    ref = nn.Embedding(V, d)
    with torch.no_grad():
        ref.weight.copy_(E)
    emb = TokenEmbedding(V, d)
    with torch.no_grad():
        emb.weight.copy_(E)
    torch.testing.assert_close(emb(ids), ref(ids), **EXACT)
    E64 = E.double()
    torch.testing.assert_close(embedding_lookup(ids, E64), F.one_hot(ids, V).double() @ E64, **F64)
    torch.testing.assert_close(one_hot_embedding(ids, E64), embedding_lookup(ids, E64), **F64)


@pytest.mark.equation("02.01", oracle="torch.autograd through nn.Embedding (repeated ids add their gradients)")
def test_lookup_gradient_matches_nn_embedding():
    V, d = 9, 4
    ids = torch.tensor([[1, 3, 1, 1], [8, 3, 0, 2]])  # repeats: the rows' gradients must add up
    g = torch.randn(2, 4, d)
    emb, ref = TokenEmbedding(V, d), nn.Embedding(V, d)
    with torch.no_grad():
        ref.weight.copy_(emb.weight)
    (emb(ids) * g).sum().backward()
    (ref(ids) * g).sum().backward()
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad, **F32)
    assert emb.weight.grad[5].abs().sum() == 0  # unused rows get no gradient


@pytest.mark.equation("02.01", oracle="direct row indexing E[i] for every id")
@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 19), min_size=1, max_size=30))
def test_lookup_returns_the_rows(ids):
    E = torch.arange(20 * 3, dtype=torch.float64).reshape(20, 3)
    X = embedding_lookup(torch.tensor(ids), E)
    assert X.shape == (len(ids), 3)
    for row, i in zip(X, ids, strict=True):
        assert row.tolist() == [3.0 * i, 3.0 * i + 1, 3.0 * i + 2]


def test_lookup_rejects_bad_input():
    E = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"token ids in \[0, V\) = \[0, 5\)"):
        embedding_lookup(torch.tensor([0, 5]), E)
    with pytest.raises(ValueError, match=r"token ids in \[0, V\)"):
        embedding_lookup(torch.tensor([-1]), E)
    with pytest.raises(TypeError, match="integer token ids"):
        embedding_lookup(torch.tensor([0.0, 1.0]), E)
    with pytest.raises(ValueError, match=r"E must be a matrix of shape \(V, d\)"):
        embedding_lookup(torch.tensor([0]), torch.randn(5))
    with pytest.raises(ValueError, match="V must be a positive int"):
        TokenEmbedding(0, 4)


# ================================================================= 02.02 token + position embedding


@pytest.mark.equation("02.02", oracle="transformers.GPT2Model: wte(ids) + wpe(positions), captured at its dropout")
@pytest.mark.parametrize("offset", [0, 3])
def test_token_position_matches_gpt2(offset):
    model = tiny_gpt2()
    captured = {}
    hook = model.transformer.drop.register_forward_pre_hook(lambda mod, args: captured.setdefault("h0", args[0]))
    ids = torch.randint(0, 50, (3, 7))
    positions = torch.arange(offset, offset + 7).unsqueeze(0)
    with torch.no_grad():
        model(ids, position_ids=positions)
    hook.remove()
    wte, wpe = model.transformer.wte.weight.detach(), model.transformer.wpe.weight.detach()
    torch.testing.assert_close(token_position_embedding(ids, wte, wpe, offset=offset), captured["h0"], **F32)
    emb = TokenPositionEmbedding(50, 8, 16)
    emb.load_state_dict({"wte.weight": wte, "wpe.weight": wpe})
    torch.testing.assert_close(emb(ids, offset=offset), captured["h0"], **F32)


@pytest.mark.equation("02.02", oracle="float64 closed form E[x_i] + P[i] by explicit loops")
def test_token_position_by_loops():
    E, P = torch.randn(10, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    ids = torch.randint(0, 10, (2, 5))
    h0 = token_position_embedding(ids, E, P)
    for b in range(2):
        for i in range(5):
            torch.testing.assert_close(h0[b, i], E[ids[b, i]] + P[i], **F64)


def test_token_position_rejects_bad_input():
    E, P = torch.randn(10, 4), torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"exceed the position table: T_max = 6"):
        token_position_embedding(torch.zeros(1, 4, dtype=torch.long), E, P, offset=3)
    with pytest.raises(ValueError, match="disagree on d"):
        token_position_embedding(torch.zeros(1, 4, dtype=torch.long), E, torch.randn(6, 5))
    with pytest.raises(ValueError, match=r"ids must have shape \(B, T\)"):
        token_position_embedding(torch.zeros(4, dtype=torch.long), E, P)
    with pytest.raises(ValueError, match="offset must be a non-negative int"):
        token_position_embedding(torch.zeros(1, 2, dtype=torch.long), E, P, offset=-1)


# ================================================================= 02.03 LM head


@pytest.mark.equation("02.03", oracle="torch.nn.Linear with copied weights; float64 einsum")
@pytest.mark.parametrize("bias", [False, True])
def test_lm_head_matches_linear(bias):
    d, V = 8, 13
    ref = nn.Linear(d, V, bias=bias)
    h = torch.randn(2, 5, d)
    W_U = ref.weight.detach().T  # (d, V), the equation's layout
    b_U = ref.bias.detach() if bias else None
    with torch.no_grad():
        torch.testing.assert_close(lm_head(h, W_U, b_U), ref(h), **F32)
    head = LMHead(d, V, bias=bias)
    head.load_state_dict(ref.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(head(h), ref(h), **F32)
    h64, W64 = h.double(), W_U.double()
    z64 = torch.einsum("btd,dv->btv", h64, W64) + (b_U.double() if bias else 0)
    torch.testing.assert_close(lm_head(h64, W64, None if b_U is None else b_U.double()), z64, **F64)


def test_lm_head_rejects_bad_input():
    with pytest.raises(ValueError, match=r"disagree on d"):
        lm_head(torch.randn(2, 4), torch.randn(5, 7))
    with pytest.raises(ValueError, match=r"b_U must have shape \(V,\) = \(7,\)"):
        lm_head(torch.randn(2, 4), torch.randn(4, 7), torch.randn(6))
    with pytest.raises(ValueError, match="h contains NaN"):
        lm_head(torch.tensor([float("nan"), 0.0]), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"tied_to has E \(V, d\) = \(10, 4\), expected \(10, 5\)"):
        LMHead(5, 10, tied_to=TokenEmbedding(10, 4))


# ================================================================= 02.04 tied embeddings


@pytest.mark.equation("02.04", oracle="transformers.GPT2LMHeadModel logits (lm_head tied to wte)")
def test_tied_head_matches_gpt2_logits():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        h = out.hidden_states[-1]  # after the final LayerNorm
        torch.testing.assert_close(tied_lm_head(h, model.transformer.wte.weight), out.logits, **F32)
    emb = TokenEmbedding(50, 8)
    emb.load_state_dict({"weight": model.transformer.wte.weight.detach()})
    head = LMHead(8, 50, tied_to=emb)
    with torch.no_grad():
        torch.testing.assert_close(head(h), out.logits, **F32)


@pytest.mark.equation("02.04", oracle="torch.autograd: tied gradient = sum of two untied copies' gradients")
def test_tied_gradient_is_the_sum_of_both_uses():
    V, d = 12, 5
    emb = TokenEmbedding(V, d)
    head = LMHead(d, V, tied_to=emb)
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert sum(p.numel() for p in model.parameters()) == V * d  # one shared matrix
    ids = torch.randint(0, V, (3, 4))
    target = torch.randint(0, V, (3, 4))
    F.cross_entropy(head(torch.tanh(emb(ids))).reshape(-1, V), target.reshape(-1)).backward()
    E_in = emb.weight.detach().clone().requires_grad_(True)
    E_out = emb.weight.detach().clone().requires_grad_(True)
    z = torch.tanh(F.embedding(ids, E_in)) @ E_out.T
    F.cross_entropy(z.reshape(-1, V), target.reshape(-1)).backward()
    torch.testing.assert_close(emb.weight.grad, E_in.grad + E_out.grad, **F32)
    untied = nn.ModuleDict({"emb": TokenEmbedding(V, d), "head": LMHead(d, V)})
    assert sum(p.numel() for p in untied.parameters()) == 2 * V * d


# ================================================================= linear (torch's weight layout), no catalogue id


def test_linear_matches_torch_functional_linear():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    W, b = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(linear(x, W, b), F.linear(x, W, b), **F64)
    torch.testing.assert_close(linear(x, W), F.linear(x, W), **F64)
    torch.testing.assert_close(linear(x[0, 0], W, b), F.linear(x[0, 0], W, b), **F64)  # a single vector
    layer = nn.Linear(5, 4).double()
    torch.testing.assert_close(linear(x, layer.weight, layer.bias), layer(x), **F64)


def test_linear_shape_errors_name_the_shapes():
    x, W = torch.randn(2, 5), torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"x \(..., d_in\) = \(2, 4\) and W \(d_out, d_in\) = \(4, 5\) disagree"):
        linear(torch.randn(2, 4), W)
    with pytest.raises(ValueError, match=r"disagree on d_in \(5 != 4\); W is in nn.Linear's layout"):
        linear(x, W.T)
    with pytest.raises(ValueError, match=r"b must have shape \(d_out,\) = \(4,\), got \(5,\)"):
        linear(x, W, torch.zeros(5))
    with pytest.raises(ValueError, match=r"W must be a matrix of shape \(d_out, d_in\)"):
        linear(x, torch.randn(5))


def test_lm_head_rejects_mixed_dtypes():
    # issue 11: float32 h with a float64 W_U used to fail inside torch.matmul
    h, W_U = torch.randn(2, 4), torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"h \(torch.float32\) and W_U \(torch.float64\) must share one dtype"):
        lm_head(h, W_U)
    with pytest.raises(TypeError, match=r"b_U \(torch.float64\) and W_U \(torch.float32\) must share one dtype"):
        lm_head(h, W_U.float(), torch.zeros(6, dtype=torch.float64))


@pytest.mark.parametrize("bad, err, text", [(True, TypeError, r"std must be a real number, got True \(bool\)"),
                                            ("0.5", TypeError, r"std must be a real number, got '0.5' \(str\)"),
                                            (float("nan"), ValueError, "std must be a real number, got nan"),
                                            (0.0, ValueError, r"std must lie in \(0.0, inf\), got 0.0"),
                                            (-1.0, ValueError, r"std must lie in \(0.0, inf\), got -1.0"),
                                            (float("inf"), ValueError, r"std must lie in \(0.0, inf\), got inf")])
def test_embedding_and_head_check_std(bad, err, text):
    """Issue 11: std reached nn.init.normal_ (RuntimeError / TypeError from torch) or was accepted (True, 0, inf)."""
    with pytest.raises(err, match=text):
        TokenEmbedding(11, 8, std=bad)
    with pytest.raises(err, match=text):
        LMHead(8, 11, std=bad)


@pytest.mark.parametrize("name, kw", [("d", dict(d=2.5, V=11)), ("V", dict(d=8, V=True)), ("V", dict(d=8, V="0.5"))])
def test_lm_head_checks_its_sizes(name, kw):
    """Issue 11: LMHead(d=2.5) and LMHead(V=True) failed inside torch.empty."""
    with pytest.raises(TypeError, match=rf"{name} must be a positive int, got {kw[name]!r}"):
        LMHead(**kw)
    for bad in (0, -1):  # V = 0 was accepted, -1 failed in torch.empty
        with pytest.raises(ValueError, match=rf"V must be a positive int, got {bad}"):
            LMHead(8, bad)
