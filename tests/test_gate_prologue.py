"""The gating from raw inputs (A_log, dt_bias given: g and beta are the raw a and b of Qwen3-Next /
Megatron), torch and triton backends: o, final state and the gradients of q, k, v, a, b, h0, A_log,
dt_bias against autograd of the float64 per-sequence recurrence fed float64 gates computed from the
same raw inputs; exact zeros of da, db on padding rows (outputs NaN-poisoned); bit-identical reruns;
opcheck of both ops with the gating; input checks."""
import functools

import pytest
import torch
import torch.nn.functional as F

import gdn_packed
from gdn_packed.ops.chunk_gdr import chunk_gdr_bwd, chunk_gdr_fwd
from gdn_packed.testing import (BUDGETS, PACKING_BY_NAME, GdrCase, backend_params, gdr_case_id, gdr_inputs, layout,
                                poisoned_outputs, real_rows, reference_gdr, rel_err)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("o", "state", "dq", "dk", "dv", "da", "db", "dh0", "dA_log", "ddt_bias")

# packings of gdn_packed.testing.PACKINGS, both with padding, with an initial state
CASES = [
    GdrCase(PACKING_BY_NAME["gaps-and-empties"], 2, 4, 16, 32, h0=True, l2=False),
    GdrCase(PACKING_BY_NAME["around-chunk-gaps"], 1, 2, 32, 16, h0=True, l2=True),
]
CASE_IDS = [gdr_case_id(c) for c in CASES]


@functools.lru_cache(maxsize=None)
def inputs(ci, dtype):
    """(q, k, v, a, b, h0, A_log, dt_bias), cu_seqlens, cu_seqlens_padded, rows, do, dht."""
    c = CASES[ci]
    cu, cu_pad, rows = c.packing.layout()
    HV, K, V, N = c.HV, c.K, c.V, len(c.packing.lengths)
    q, k, v, _, _, h0 = gdr_inputs(rows, c.H, HV, K, V, dtype, N=N, initial_state=c.h0, unit_k=not c.l2, seed=ci)
    gen = torch.Generator().manual_seed(200 + ci)
    a = (torch.randn(1, rows, HV, generator=gen) - 1.0).to(dtype)
    b = torch.randn(1, rows, HV, generator=gen).to(dtype)
    A_log = torch.rand(HV, generator=gen) * 0.5 - 1.0       # decay rates exp(A_log) in [0.37, 0.61]
    dt_bias = torch.randn(HV, generator=gen) * 0.5
    do = torch.randn(1, rows, HV, V, generator=gen).to(dtype)
    dht = torch.randn(N, HV, K, V, generator=gen)
    to = lambda t: t.to(DEV)  # noqa: E731
    return (tuple(map(to, (q, k, v, a, b, h0, A_log, dt_bias))), to(cu), to(cu_pad), rows, to(do),
            to(dht))


def skip_if_cuda_refuses(backend, q, v, N):
    """backend='cuda' takes K = V = 128 in bf16/fp16 only (its raw gates are checked at that shape by
    tests/test_cuda_chunk_gpu.py); the cases here are K 16 and 32: a skip naming its refusal."""
    if backend == "cuda":
        from gdn_packed.cuda.chunk import refusal
        why = refusal(q, v, q.device, N)
        if why is not None:
            pytest.skip(f"backend='cuda' does not take this case by design: {why}")


def run(ci, dtype, backend):
    """o, final state and gradients of <o, do> + <final_state, dht> (outputs NaN-poisoned)."""
    x, cu, cu_pad, _, do, dht = inputs(ci, dtype)
    skip_if_cuda_refuses(backend, x[0], x[2], cu.numel() - 1)
    q, k, v, a, b, h0, A_log, dt_bias = [t.detach().clone().requires_grad_() for t in x]
    with poisoned_outputs():
        o, fs = gdn_packed.chunk_gated_delta_rule(
            q, k, v, a, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
            cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=CASES[ci].l2, A_log=A_log,
            dt_bias=dt_bias, backend=backend)
        grads = torch.autograd.grad((o, fs), (q, k, v, a, b, h0, A_log, dt_bias), (do, dht))
    return dict(zip(NAMES, (o, fs) + grads))


@functools.lru_cache(maxsize=None)
def reference(ci, dtype):
    """The same in float64, with the gating computed in float64 from the (rounded) raw inputs."""
    x, cu, cu_pad, _, do, dht = inputs(ci, dtype)
    q, k, v, a, b, h0, A_log, dt_bias = [t.detach().cpu().double().requires_grad_() for t in x]
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    beta = torch.sigmoid(b)
    o, fs = reference_gdr(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu.cpu(),
                          cu_seqlens_padded=cu_pad.cpu(), use_qk_l2norm_in_kernel=CASES[ci].l2)
    grads = torch.autograd.grad((o, fs), (q, k, v, a, b, h0, A_log, dt_bias),
                                (do.cpu().double(), dht.cpu().double()))
    return dict(zip(NAMES, (o, fs) + grads))


@functools.lru_cache(maxsize=None)
def cached_run(ci, dtype, backend):
    return run(ci, dtype, backend)


def errors(ci, dtype, backend):
    got, ref = cached_run(ci, dtype, backend), reference(ci, dtype)
    return {n: rel_err(got[n].cpu(), ref[n]) for n in NAMES}


BACKENDS = backend_params("chunk_gated_delta_rule", DEV)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ci", range(len(CASES)), ids=CASE_IDS)
def test_fp32_matches_float64_reference(ci, backend):
    err = errors(ci, torch.float32, backend)
    assert all(e <= 1e-5 for e in err.values()), {n: f"{e:.2e}" for n, e in err.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_within_budget(backend):
    b = BUDGETS[torch.bfloat16]
    err = errors(0, torch.bfloat16, backend)
    limit = {n: b["o"] if n in ("o", "state") else b["grad"] for n in NAMES}
    assert all(err[n] <= limit[n] for n in NAMES), {n: f"{e:.2e}" for n, e in err.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ci", range(len(CASES)), ids=CASE_IDS)
def test_padding_rows_of_a_and_b_get_zero_gradient(ci, backend):
    got = cached_run(ci, torch.float32, backend)
    _, cu, cu_pad, rows, _, _ = inputs(ci, torch.float32)
    pad = ~real_rows(cu.cpu(), cu_pad.cpu(), rows).to(DEV)
    assert pad.any()
    for n in ("da", "db"):
        assert torch.isfinite(got[n]).all(), n
        assert (got[n][0, pad] == 0).all(), f"{n} is not exactly 0 on padding rows"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bit_identical_reruns(backend):
    first, second = cached_run(1, torch.float32, backend), run(1, torch.float32, backend)
    for n in NAMES:
        assert torch.equal(first[n], second[n]), n


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] != "torch"])
def test_agrees_with_torch_backend(backend):
    got, ref = cached_run(0, torch.float32, backend), cached_run(0, torch.float32, "torch")
    err = {n: rel_err(got[n], ref[n]) for n in NAMES}
    assert all(e <= 1e-5 for e in err.values()), {n: f"{e:.2e}" for n, e in err.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_with_gates(backend):
    cu, cu_pad, rows = layout([5, 3], gaps=[2, 1])
    q, k, v, _, _, h0 = gdr_inputs(rows, 1, 2, 16, 16, N=2, initial_state=True, device=DEV)
    a, b = torch.randn(1, rows, 2, device=DEV), torch.randn(1, rows, 2, device=DEV)
    A_log, dt_bias = torch.randn(2, device=DEV) * 0.3, torch.randn(2, device=DEV) * 0.3
    leaves = [t.requires_grad_() for t in (q, k, v, a, b, A_log, dt_bias)]
    q, k, v, a, b, A_log, dt_bias = leaves
    cu, cu_pad = cu.to(DEV), cu_pad.to(DEV)
    skip_if_cuda_refuses(backend, q, v, 2)
    torch.library.opcheck(chunk_gdr_fwd, (q, k, v, a, b, h0, cu, cu_pad, 0.25, False, backend, A_log,
                                          dt_bias))
    do, dht = torch.randn_like(v), torch.randn(2, 2, 16, 16, device=DEV)
    torch.library.opcheck(chunk_gdr_bwd, (q.detach(), k.detach(), v.detach(), a.detach(), b.detach(),
                                          h0, cu, cu_pad, do, dht, 0.25, False, backend,
                                          A_log.detach(), dt_bias.detach()))


def test_gate_inputs_are_checked():
    q, k, v, g, beta, _ = gdr_inputs(8, 1, 2, 16, 16)
    with pytest.raises(ValueError, match="A_log and dt_bias"):
        gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, A_log=torch.zeros(2), backend="torch")
    with pytest.raises(ValueError, match=r"dt_bias must have shape \(2,\)"):
        gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, A_log=torch.zeros(2),
                                          dt_bias=torch.zeros(3), backend="torch")
    with pytest.raises(TypeError, match="A_log must have dtype"):
        gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, A_log=torch.zeros(2, dtype=torch.int32),
                                          dt_bias=torch.zeros(2), backend="torch")
