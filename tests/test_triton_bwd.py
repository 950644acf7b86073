"""Triton backward of the chunked gated delta rule (backend="triton"; on CPU under the Triton interpreter
with tests/triton_shim.py): dq, dk, dv, dg, dbeta, dh0 against autograd of the float64 per-sequence
recurrence, exact zeros on padding rows (outputs NaN-poisoned), dht passed through zero-length
sequences, agreement with the torch backend, bit-identical reruns, opcheck, and error no worse than
1.1x FLA's chunk_gated_delta_rule against the same float64 reference (when fla-core is installed)."""
import functools

import pytest
import torch

import gdn_packed
from gdn_packed.ops.chunk_gdr import chunk_gdr_fwd
from gdn_packed.testing import (BUDGETS, budgets, gdr_case_id, gdr_inputs, layout, no_host_sync, poisoned_outputs,
                                real_rows, reference_gdr, rel_err)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

# (lengths, gaps after each sequence or None, tail rows, H, HV, K, V, initial_state, l2norm)
CASES = [
    ([300], None, 0, 2, 2, 32, 16, False, False),
    ([0, 1, 63, 64, 65, 127, 5], None, 0, 1, 4, 16, 32, True, True),
    ([65, 0, 1, 0], [3, 0, 7, 1], 5, 2, 4, 16, 32, True, False),
    ([127, 64, 63], [1, 64, 0], 9, 1, 2, 32, 48, False, True),
    ([1], None, 0, 2, 2, 16, 16, True, True),
    ([64, 64, 1, 0, 127], [0, 0, 0, 2, 0], 3, 1, 1, 64, 32, True, True),
    # K > 128 (BK = 256, not a power of 2): fp32 holds the state as two K-halves, the second masked
    ([65, 1], [2, 0], 3, 1, 2, 192, 16, True, True),
    ([70], None, 0, 1, 1, 256, 16, False, False),
]




@functools.lru_cache(maxsize=None)
def inputs(ci, dtype):
    """Leaves (q, k, v, g, beta, h0), cu_seqlens, cu_seqlens_padded, rows, and the cotangents do, dht."""
    lens, gaps, tail, H, HV, K, V, with_h0, l2 = CASES[ci]
    cu, cu_pad, rows = layout(lens, gaps=gaps, tail=tail)
    x = gdr_inputs(rows, H, HV, K, V, dtype, N=len(lens), initial_state=with_h0, unit_k=not l2, seed=ci)
    gen = torch.Generator().manual_seed(100 + ci)
    do = torch.randn(1, rows, HV, V, generator=gen).to(dtype)
    dht = torch.randn(len(lens), HV, K, V, generator=gen)
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return tuple(map(to, x)), to(cu), to(cu_pad), rows, to(do), to(dht)


def grads(ci, dtype, backend):
    """Gradients of <o, do> + <final_state, dht> from backend (the op, outputs NaN-poisoned)."""
    x, cu, cu_pad, _, do, dht = inputs(ci, dtype)
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in x]
    with poisoned_outputs():
        o, fs = gdn_packed.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                                  output_final_state=True, cu_seqlens=cu,
                                                  cu_seqlens_padded=cu_pad,
                                                  use_qk_l2norm_in_kernel=CASES[ci][8], backend=backend)
        dq, dk, dv, dg, db, *dh0 = torch.autograd.grad(
            (o, fs), [t for t in leaves if t is not None], (do, dht))
    return dict(zip(GRADS, (dq, dk, dv, dg, db, dh0[0] if dh0 else None)))


@functools.lru_cache(maxsize=None)
def triton_grads(ci, dtype):
    return grads(ci, dtype, "triton")


@functools.lru_cache(maxsize=None)
def reference(ci, dtype):
    x, cu, cu_pad, _, do, dht = inputs(ci, dtype)
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in x]
    o, fs = reference_gdr(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu.cpu(),
                          cu_seqlens_padded=None if cu_pad is None else cu_pad.cpu(),
                          use_qk_l2norm_in_kernel=CASES[ci][8])
    ((o * do.double()).sum() + (fs * dht.double()).sum()).backward()
    return dict(zip(GRADS, [None if t is None else t.grad for t in leaves]))


def errors(got, ref):
    return {n: rel_err(got[n], ref[n]) for n in GRADS if ref[n] is not None}


def over_fp32_budget(err):
    """The gradients of fp32 inputs over the budget on this device: 1e-5 on CPU (interpreter), the GPU
    fp32 budgets on CUDA (tf32 dots; gdn_packed.testing.budgets), dg and dbeta the gate budget."""
    b = budgets(torch.float32, DEV)
    return {n: f"{e:.2e}" for n, e in err.items() if e > b["gate_grad" if n in ("dg", "dbeta") else "grad"]}


@pytest.mark.parametrize("ci", range(len(CASES)), ids=[gdr_case_id(c) for c in CASES])
def test_fp32_matches_float64_reference(ci):
    err = errors(triton_grads(ci, torch.float32), reference(ci, torch.float32))
    assert not over_fp32_budget(err), over_fp32_budget(err)


@pytest.mark.parametrize("ci", range(len(CASES)), ids=[gdr_case_id(c) for c in CASES])
def test_padding_rows_exactly_zero(ci):
    got = triton_grads(ci, torch.float32)
    _, cu, cu_pad, rows, _, _ = inputs(ci, torch.float32)
    pad = ~real_rows(cu.cpu(), None if cu_pad is None else cu_pad.cpu(), rows).to(DEV)
    for n in GRADS[:5]:
        assert torch.isfinite(got[n]).all(), n
        assert (got[n][0, pad] == 0).all(), f"{n} is not exactly 0 on padding rows"


@pytest.mark.parametrize("ci", [1, 2, 3], ids=[gdr_case_id(CASES[i]) for i in (1, 2, 3)])
def test_agrees_with_torch_backend(ci):
    got, ref = triton_grads(ci, torch.float32), grads(ci, torch.float32, "torch")
    err = errors(got, {n: None if t is None else t.double() for n, t in ref.items()})
    assert not over_fp32_budget(err), over_fp32_budget(err)


def test_bit_identical_reruns():
    a, b = triton_grads(2, torch.float32), grads(2, torch.float32, "triton")
    for n in GRADS:
        assert torch.equal(a[n], b[n]), n


def test_zero_length_sequences_pass_dht_through():
    cu = torch.tensor([0, 0, 5, 5], dtype=torch.int32, device=DEV)
    q, k, v, g, beta, h0 = gdr_inputs(5, 1, 2, 16, 16, N=3, initial_state=True, device=DEV)
    h0 = h0.requires_grad_()
    _, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu, backend="triton")
    dht = torch.randn_like(fs)
    (dh0,) = torch.autograd.grad(fs, h0, dht)
    assert torch.equal(dh0[0], dht[0]) and torch.equal(dh0[2], dht[2])


def test_backward_makes_no_host_sync():
    x, cu, cu_pad, _, do, dht = inputs(2, torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in x]
    o, fs = gdn_packed.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                              cu_seqlens=cu, cu_seqlens_padded=cu_pad, backend="triton")
    if DEV == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.autograd.grad((o, fs), leaves, (do, dht))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with no_host_sync():
            torch.autograd.grad((o, fs), leaves, (do, dht))


def test_opcheck_with_requires_grad():
    x, cu, cu_pad, _, _, _ = inputs(4, torch.float32)
    q, k, v, g, beta, h0 = (t.detach().clone().requires_grad_() for t in x)
    torch.library.opcheck(chunk_gdr_fwd, (q, k, v, g, beta, h0, cu, None, 0.25, True, "triton"))


FLA_CASES = [1, 3, 5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("ci", FLA_CASES, ids=[gdr_case_id(CASES[i]) for i in FLA_CASES])
def test_low_precision_within_budget_and_fla(ci, dtype, report_table):
    got, ref = triton_grads(ci, dtype), reference(ci, dtype)
    ours = errors(got, ref)
    fla = fla_errors(ci, dtype)
    report_table("triton bwd vs FLA 0.6.0, gradient rel. error against float64 (ours / FLA)",
                 f"{gdr_case_id(CASES[ci]):34s} {str(dtype)[6:]:8s} " + "  ".join(
                     f"{n} {ours[n]:.2e}/{fla[n]:.2e}" if n in fla else f"{n} {ours[n]:.2e}/-"
                     for n in ours))
    budget = BUDGETS[dtype]["grad"]
    assert all(e <= budget for e in ours.values()), {n: f"{e:.2e}" for n, e in ours.items()}
    worse = {n: (ours[n], fla[n]) for n in fla if ours[n] > 1.1 * fla[n]}
    assert not worse, {n: f"ours {a:.2e} > 1.1 x FLA {b:.2e}" for n, (a, b) in worse.items()}


def fla_errors(ci, dtype):
    """FLA's gradient errors on the same inputs against the same float64 reference ({} without fla).
    FLA has no padded layout: it gets the real rows only, and errors are taken on those rows."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return {}
    x, cu, cu_pad, rows, do, dht = inputs(ci, dtype)
    real = real_rows(cu.cpu(), None if cu_pad is None else cu_pad.cpu(), rows).to(DEV)
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in x]
    q, k, v, g, beta = (t[:, real] for t in leaves[:5])
    o, fs = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=leaves[5], output_final_state=True,
                                   cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=CASES[ci][8])
    got = torch.autograd.grad((o, fs), [t for t in leaves if t is not None], (do[:, real], dht))
    got = dict(zip(GRADS, list(got) + [None] * (6 - len(got))))
    ref = reference(ci, dtype)
    return {n: rel_err(got[n][:, real], ref[n][:, real]) if n != "dh0" else rel_err(got[n], ref[n])
            for n in GRADS if ref[n] is not None}
