"""State space models (chapter 18) against SciPy's LTI tools, float64 closed forms and transformers' Mamba."""

import numpy as np
import pytest
import scipy.linalg
import scipy.signal
import torch
import torch.nn.functional as F
from scipy.integrate import solve_ivp

from llmbook.lm.ssm import (
    continuous_ssm,
    discretize,
    hippo_legs,
    selective_scan,
    ssm_convolution,
    ssm_kernel,
    ssm_scan,
)


def stable_system(N=4, P=2, Q=3, seed=0):
    """A random (A, B, C, D) in float64 with every eigenvalue of A in the left half-plane."""
    rng = np.random.default_rng(seed)
    M = rng.normal(size=(N, N))
    A = M - (np.abs(np.linalg.eigvals(M).real).max() + 0.5) * np.eye(N)
    return A, rng.normal(size=(N, P)), rng.normal(size=(Q, N)), rng.normal(size=(Q, P))


def t64(*xs):
    return [torch.as_tensor(x, dtype=torch.float64) for x in xs]


# ================================================================= 18.01 the continuous SSM


@pytest.mark.equation("18.01", oracle="scipy.integrate.solve_ivp against the analytic step response (expm)")
def test_continuous_ssm_step_response_matches_the_closed_form():
    A, B, C, D = stable_system()
    u = np.array([1.0, -0.5])  # a step, switched on at t = 0, from x(0) = 0
    At, Bt, Ct, Dt = t64(A, B, C, D)

    def f(t, x):
        x_dot, _ = continuous_ssm(At, Bt, Ct, Dt, torch.as_tensor(x), torch.as_tensor(u))
        return x_dot.numpy()

    ts = np.linspace(0, 3, 7)
    sol = solve_ivp(f, (0, 3), np.zeros(4), t_eval=ts, rtol=1e-11, atol=1e-12, method="DOP853")
    # x(t) = A^{-1} (e^{At} - I) B u, y = C x + D u
    exact = np.stack([np.linalg.solve(A, (scipy.linalg.expm(A * t) - np.eye(4)) @ B @ u) for t in ts])
    np.testing.assert_allclose(sol.y.T, exact, atol=1e-9)
    _, y = continuous_ssm(At, Bt, Ct, Dt, torch.as_tensor(exact), torch.as_tensor(u).expand(len(ts), 2))
    np.testing.assert_allclose(y.numpy(), exact @ C.T + D @ u, atol=1e-12)


@pytest.mark.equation("18.01", oracle="scipy.integrate.solve_ivp against the analytic sine response of a scalar SSM")
def test_continuous_ssm_sine_response_and_diagonal_A():
    # x' = -a x + sin(w t), x(0) = 0:  x(t) = (a sin wt - w cos wt + w e^{-a t}) / (a^2 + w^2)
    a, w = 1.5, 2.0
    A_diag = torch.tensor([-a, -2 * a], dtype=torch.float64)  # diagonal A as a vector; the second state is unused
    B = torch.tensor([[1.0], [0.0]], dtype=torch.float64)

    def f(t, x):
        return continuous_ssm(A_diag, B, torch.eye(2, dtype=torch.float64), None, torch.as_tensor(x),
                              torch.tensor([np.sin(w * t)]))[0].numpy()

    ts = np.linspace(0, 4, 9)
    sol = solve_ivp(f, (0, 4), np.zeros(2), t_eval=ts, rtol=1e-11, atol=1e-12, method="DOP853")
    exact = (a * np.sin(w * ts) - w * np.cos(w * ts) + w * np.exp(-a * ts)) / (a**2 + w**2)
    np.testing.assert_allclose(sol.y[0], exact, atol=1e-9)
    np.testing.assert_allclose(sol.y[1], 0, atol=1e-12)


def test_continuous_ssm_rejects_mismatched_shapes():
    A, B, C, D = t64(*stable_system())
    with pytest.raises(ValueError, match="N = 4"):
        continuous_ssm(A, B[:3], C, D, torch.zeros(4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="leading axes"):
        continuous_ssm(A, B, C, D, torch.zeros(2, 4), torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"\(Q, P\)"):
        continuous_ssm(A, B, C, D[:, :1], torch.zeros(4), torch.zeros(2))
    with pytest.raises(ValueError, match="square"):
        continuous_ssm(A[:, :3], B, C, D, torch.zeros(4), torch.zeros(2))


# ================================================================= 18.02 discretisation and the recurrence


@pytest.mark.equation("18.02", oracle="scipy.signal.cont2discrete (methods 'zoh' and 'bilinear')")
@pytest.mark.parametrize("method", ["zoh", "bilinear"])
@pytest.mark.parametrize("dt", [0.01, 0.3, 2.0])
def test_discretize_matches_cont2discrete(method, dt):
    A, B, C, D = stable_system()
    Ad, Bd, *_ = scipy.signal.cont2discrete((A, B, C, D), dt, method=method)
    A_bar, B_bar = discretize(*t64(A, B), dt, method=method)
    np.testing.assert_allclose(A_bar.numpy(), Ad, atol=1e-12)
    np.testing.assert_allclose(B_bar.numpy(), Bd, atol=1e-12)
    # a diagonal A given as a vector: the same as the full matrix diag(A)
    a = -np.array([0.5, 1.0, 3.0, 1e-9])
    Ad, Bd, *_ = scipy.signal.cont2discrete((np.diag(a), B, C, D), dt, method=method)
    A_bar, B_bar = discretize(*t64(a, B), dt, method=method)
    np.testing.assert_allclose(A_bar.numpy(), np.diag(Ad), atol=1e-12)
    np.testing.assert_allclose(B_bar.numpy(), Bd, atol=1e-12)


@pytest.mark.equation("18.02", oracle="scipy.linalg.expm (Ā = e^{ΔA}; for A = 0, B̄ = ΔB exactly)")
def test_zoh_uses_the_matrix_exponential_and_handles_a_singular_A():
    A, B, *_ = stable_system(N=3, P=1)
    A_bar, B_bar = discretize(*t64(A, B), 0.7)
    np.testing.assert_allclose(A_bar.numpy(), scipy.linalg.expm(0.7 * A), atol=1e-13)
    B_ref = np.linalg.solve(A, scipy.linalg.expm(0.7 * A) - np.eye(3)) @ B
    np.testing.assert_allclose(B_bar.numpy(), B_ref, atol=1e-12)
    A_bar, B_bar = discretize(torch.zeros(3, 3, dtype=torch.float64), torch.as_tensor(B), 0.7)  # integrator
    assert torch.equal(A_bar, torch.eye(3, dtype=torch.float64))
    np.testing.assert_allclose(B_bar.numpy(), 0.7 * B, atol=1e-15)
    A_bar, B_bar = discretize(torch.zeros(3, dtype=torch.float64), torch.as_tensor(B), 0.7)
    np.testing.assert_allclose(B_bar.numpy(), 0.7 * B, atol=1e-15)


@pytest.mark.equation("18.02", oracle="scipy.signal.dlsim (state-space simulation, its x_{k+1} convention converted)")
def test_ssm_scan_matches_dlsim():
    A, B, C, D = stable_system()
    A_bar, B_bar = discretize(*t64(A, B), 0.2)
    Ab, Bb = A_bar.numpy(), B_bar.numpy()
    u = np.random.default_rng(1).normal(size=(2, 30, 2))
    y = ssm_scan(A_bar, B_bar, *t64(C, D), torch.as_tensor(u))
    # ours: y_k = C x_k + D u_k with x_k = Ā x_{k-1} + B̄ u_k; dlsim's state is our x_{k-1}
    for b in range(2):
        _, y_ref, _ = scipy.signal.dlsim((Ab, Bb, C @ Ab, C @ Bb + D, 1.0), u[b])
        np.testing.assert_allclose(y[b].numpy(), y_ref, atol=1e-12)
    # a non-zero initial state, and the last state returned
    x0 = np.random.default_rng(2).normal(size=(2, 4))
    y, x_last = ssm_scan(A_bar, B_bar, *t64(C, D), torch.as_tensor(u), x0=torch.as_tensor(x0), return_state=True)
    _, y_ref, x_ref = scipy.signal.dlsim((Ab, Bb, C @ Ab, C @ Bb + D, 1.0), u[0], x0=x0[0])
    np.testing.assert_allclose(y[0].numpy(), y_ref, atol=1e-12)
    np.testing.assert_allclose(x_last[0].numpy(), Ab @ x_ref[-1] + Bb @ u[0, -1], atol=1e-12)


@pytest.mark.equation("18.02", oracle="scipy.integrate.solve_ivp (ZOH is exact for an input held over each step)")
def test_zoh_scan_is_exact_for_a_held_input():
    A, B, C, D = stable_system(P=1, Q=1)
    dt = 0.25
    u = np.random.default_rng(3).normal(size=12)

    y_ref, x = [], np.zeros(4)
    for k in range(len(u)):  # integrate step by step so the solver never straddles a jump
        x = solve_ivp(lambda t, x, k=k: A @ x + B[:, 0] * u[k], (0, dt), x, rtol=1e-11, atol=1e-13).y[:, -1]
        y_ref.append(C @ x + D @ u[k:k + 1])
    y = ssm_scan(*discretize(*t64(A, B), dt), *t64(C, D), torch.as_tensor(u)[None, :, None])
    np.testing.assert_allclose(y[0].numpy(), np.array(y_ref), atol=1e-8)


def test_discretize_and_scan_reject_bad_arguments():
    A, B, C, D = t64(*stable_system())
    with pytest.raises(ValueError, match="method"):
        discretize(A, B, 0.1, method="euler")
    with pytest.raises(ValueError, match="dt"):
        discretize(A, B, 0.0)
    with pytest.raises(TypeError, match="dt"):
        discretize(A, B, "0.1")
    with pytest.raises(ValueError, match="P = 2"):
        ssm_scan(A, B, C, D, torch.zeros(1, 5, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="x0"):
        ssm_scan(A, B, C, D, torch.zeros(1, 5, 2, dtype=torch.float64), x0=torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN"):
        ssm_scan(A * np.nan, B, C, D, torch.zeros(1, 5, 2))


def test_hippo_legs_matches_the_paper():
    A, B = hippo_legs(3)
    s3, s5, s15 = np.sqrt(3), np.sqrt(5), np.sqrt(15)
    np.testing.assert_allclose(A.numpy(), -np.array([[1, 0, 0], [s3, 2, 0], [s5, s15, 3]]), atol=1e-15)
    np.testing.assert_allclose(B.numpy().ravel(), [1, s3, s5], atol=1e-15)
    A, _ = hippo_legs(16)
    np.testing.assert_allclose(np.sort(np.linalg.eigvals(A.numpy()).real), -np.arange(16, 0, -1), atol=1e-6)


# ================================================================= 18.03 the convolution kernel


@pytest.mark.equation("18.03", oracle="scipy.signal.dimpulse (impulse response) and numpy.linalg.matrix_power")
def test_ssm_kernel_is_the_impulse_response():
    A, B, C, D = stable_system(P=1, Q=1)
    A_bar, B_bar = discretize(*t64(A, B), 0.1, method="bilinear")
    K = ssm_kernel(A_bar, B_bar, torch.as_tensor(C), 50)
    Ab, Bb = A_bar.numpy(), B_bar.numpy()
    brute = np.stack([C @ np.linalg.matrix_power(Ab, i) @ Bb for i in range(50)])
    np.testing.assert_allclose(K.numpy(), brute, atol=1e-13)
    _, (h,) = scipy.signal.dimpulse((Ab, Bb, C @ Ab, C @ Bb, 1.0), n=50)  # the impulse response of our convention
    np.testing.assert_allclose(K[:, 0, 0].numpy(), h[:, 0], atol=1e-12)
    # a diagonal A_bar (N,) gives the kernel of diag(A_bar)
    a = torch.tensor([0.9, -0.5, 0.2], dtype=torch.float64)
    B3, C3 = torch.ones(3, 1, dtype=torch.float64), torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    np.testing.assert_allclose(ssm_kernel(a, B3, C3, 6).numpy(), ssm_kernel(torch.diag(a), B3, C3, 6).numpy(), atol=0)


@pytest.mark.equation("18.03", oracle="scipy.signal.lfilter (the SISO transfer function) and scipy.signal.dlsim (MIMO)")
def test_ssm_convolution_equals_the_recurrence():
    A, B, C, D = stable_system(P=1, Q=1)
    A_bar, B_bar = discretize(*t64(A, B), 0.1)
    Ab, Bb = A_bar.numpy(), B_bar.numpy()
    u = np.random.default_rng(4).normal(size=(3, 64, 1))
    y = ssm_convolution(A_bar, B_bar, *t64(C, D), torch.as_tensor(u))
    b, a = scipy.signal.ss2tf(Ab, Bb, C @ Ab, C @ Bb + D)
    np.testing.assert_allclose(y[..., 0].numpy(), scipy.signal.lfilter(b[0], a, u[..., 0], axis=-1), atol=1e-10)
    np.testing.assert_allclose(y.numpy(), ssm_scan(A_bar, B_bar, *t64(C, D), torch.as_tensor(u)).numpy(), atol=1e-12)
    A, B, C, D = stable_system()  # MIMO: 2 inputs, 3 outputs
    A_bar, B_bar = discretize(*t64(A, B), 0.3, method="bilinear")
    Ab, Bb = A_bar.numpy(), B_bar.numpy()
    u = np.random.default_rng(5).normal(size=(2, 40, 2))
    y = ssm_convolution(A_bar, B_bar, *t64(C, D), torch.as_tensor(u))
    for i in range(2):
        np.testing.assert_allclose(y[i].numpy(), scipy.signal.dlsim((Ab, Bb, C @ Ab, C @ Bb + D, 1.0), u[i])[1],
                                   atol=1e-12)
    y32 = ssm_convolution(A_bar.float(), B_bar.float(), *(t.float() for t in t64(C, D)), torch.as_tensor(u).float())
    np.testing.assert_allclose(y32.numpy(), y.numpy(), atol=1e-5)  # float32 FFT rounding


# ================================================================= 18.04 the selective scan (Mamba)


def brute_selective_scan(x, delta, A, B, C, D, z):
    """Float64 loops over batch, time, channel and state: the equations of 18.04 as written."""
    x, delta, A, B, C, D, z = (t.double().numpy() for t in (x, delta, A, B, C, D, z))
    Bsz, T, Dch = x.shape
    y = np.zeros((Bsz, T, Dch))
    for b in range(Bsz):
        for d in range(Dch):
            h = np.zeros(A.shape[1])
            for t in range(T):
                h = np.exp(delta[b, t, d] * A[d]) * h + delta[b, t, d] * B[b, t] * x[b, t, d]
                y[b, t, d] = C[b, t] @ h + D[d] * x[b, t, d]
    return y * z / (1 + np.exp(-z))


def selective_inputs(Bsz=2, T=9, Dch=3, N=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return dict(x=r(Bsz, T, Dch), delta=F.softplus(r(Bsz, T, Dch)), A=-torch.exp(r(Dch, N)), B=r(Bsz, T, N),
                C=r(Bsz, T, N), D=r(Dch), z=r(Bsz, T, Dch))


@pytest.mark.equation("18.04", oracle="float64 brute-force loops over batch, time, channel and state")
def test_selective_scan_matches_a_brute_force_loop():
    kw = selective_inputs()
    np.testing.assert_allclose(selective_scan(**kw).numpy(), brute_selective_scan(**kw), atol=1e-12)
    kw32 = {k: v.float() for k, v in kw.items()}
    np.testing.assert_allclose(selective_scan(**kw32).numpy(), brute_selective_scan(**kw), atol=1e-5)


@pytest.mark.equation("18.04", oracle="transformers MambaMixer (random weights; Δ, B, C, x, gate captured by hooks)")
def test_selective_scan_matches_transformers_mamba_mixer():
    from transformers import MambaConfig
    from transformers.models.mamba import modeling_mamba as mm

    torch.manual_seed(0)
    cfg = MambaConfig(hidden_size=8, state_size=4, expand=2, conv_kernel=3, time_step_rank=2, num_hidden_layers=1,
                      vocab_size=10)
    mixer = mm.MambaMixer(cfg, layer_idx=0).eval()
    with torch.no_grad():  # move A and D off their initial values, so a mix-up of channels would show
        mixer.A_log.add_(0.3 * torch.randn_like(mixer.A_log))
        mixer.D.copy_(torch.randn_like(mixer.D))
    cap = {}
    mixer.in_proj.register_forward_hook(lambda m, i, o: cap.update(xz=o))
    mixer.x_proj.register_forward_hook(lambda m, i, o: cap.update(x=i[0], dbc=o))
    mixer.out_proj.register_forward_pre_hook(lambda m, i: cap.update(y=i[0]))
    with torch.no_grad():
        mixer(torch.randn(2, 7, 8))
        time_step, B, C = torch.split(cap["dbc"], [2, 4, 4], dim=-1)
        delta = F.softplus(time_step @ mixer.dt_proj.weight.T + mixer.dt_proj.bias)
        y = selective_scan(cap["x"], delta, -torch.exp(mixer.A_log), B, C, mixer.D, z=cap["xz"][..., 16:])
        assert y.shape == cap["y"].shape == (2, 7, 16)
        torch.testing.assert_close(y, cap["y"], atol=1e-5, rtol=0)
        # transformers' scan function itself, channel-first, with its last state
        kw = selective_inputs(dtype=torch.float32)
        ref, h_ref = mm.mamba_selective_scan(kw["x"].transpose(1, 2), kw["delta"].transpose(1, 2), kw["A"],
                                             kw["B"].transpose(1, 2), kw["C"].transpose(1, 2), D=kw["D"],
                                             z=kw["z"].transpose(1, 2), return_last_state=True)
        ours, h = selective_scan(**kw, return_state=True)
        torch.testing.assert_close(ours, ref.transpose(1, 2), atol=1e-5, rtol=0)
        torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=0)


def test_selective_scan_selectivity_and_errors():
    kw = selective_inputs(Bsz=1, T=6, Dch=2, N=3)
    del kw["D"], kw["z"]
    kw["delta"][0, 2:4] = 0.0  # a zero step: the tokens 2 and 3 leave the state untouched
    _, h_before = selective_scan(**{k: v[:, :2] if v.ndim == 3 else v for k, v in kw.items()}, return_state=True)
    y = selective_scan(**kw)
    np.testing.assert_allclose(y[0, 2:4].numpy(), np.einsum("dn,tn->td", h_before[0].numpy(), kw["C"][0, 2:4].numpy()),
                               atol=1e-12)
    with pytest.raises(ValueError, match="delta must be >= 0"):
        selective_scan(**{**kw, "delta": -kw["delta"]})
    with pytest.raises(ValueError, match="A must be <= 0"):
        selective_scan(**{**kw, "A": -kw["A"]})
    with pytest.raises(ValueError, match="B must have shape"):
        selective_scan(**{**kw, "B": kw["B"][:, :, :2]})
