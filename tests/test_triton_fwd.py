"""Triton forward of the chunked gated delta rule (backend="triton"; on CPU under the Triton
interpreter with tests/triton_shim.py): o and final state against the float64 per-sequence
recurrence, exact zeros on padding rows, agreement with the torch backend, no host sync, and
error no worse than FLA's chunk_gated_delta_rule on the same inputs (when fla-core is installed)."""
import functools

import pytest
import torch

import gdn_packed
from gdn_packed.testing import (BUDGETS, gdr_case_id, gdr_inputs, layout, no_host_sync, poisoned_outputs,
                                real_rows, reference_gdr, rel_err)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (lengths, gaps after each sequence or None, tail rows, H, HV, K, V, initial_state, l2norm)
CASES = [
    ([300], None, 0, 2, 2, 32, 16, False, False),
    ([0, 1, 63, 64, 65, 127, 300, 5], None, 0, 2, 4, 32, 16, True, True),
    ([65, 0, 1, 0], [3, 0, 7, 1], 5, 2, 8, 16, 32, True, False),
    ([127, 64, 63], [1, 64, 0], 9, 1, 2, 32, 48, False, True),
    ([1], None, 0, 2, 2, 16, 16, True, True),
    ([64, 64, 1, 0, 127], [0, 0, 0, 2, 0], 3, 1, 1, 64, 32, True, True),
    # K > 128 (BK = 256, not a power of 2): fp32 holds the state as two K-halves, the second masked
    ([65, 1], [2, 0], 3, 1, 2, 192, 16, True, True),
    ([70], None, 0, 1, 1, 256, 16, False, False),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]




@functools.lru_cache(maxsize=None)
def inputs(ci, dtype):
    lens, gaps, tail, H, HV, K, V, with_h0, l2 = CASES[ci]
    cu, cu_pad, rows = layout(lens, gaps=gaps, tail=tail)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, V, dtype, N=len(lens), initial_state=with_h0,
                                      unit_k=not l2, device=DEV)
    return (q, k, v, g, beta, h0), cu.to(DEV), None if cu_pad is None else cu_pad.to(DEV), rows


def run(ci, dtype, backend):
    (q, k, v, g, beta, h0), cu, cu_pad, _ = inputs(ci, dtype)
    with poisoned_outputs():
        return gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                                                 use_qk_l2norm_in_kernel=CASES[ci][8], backend=backend)


@functools.lru_cache(maxsize=None)
def triton_out(ci, dtype):
    return run(ci, dtype, "triton")


@functools.lru_cache(maxsize=None)
def reference(ci, dtype):
    (q, k, v, g, beta, h0), cu, cu_pad, _ = inputs(ci, dtype)
    return reference_gdr(*(x.double() for x in (q, k, v, g, beta)), cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                         initial_state=None if h0 is None else h0.double(),
                         use_qk_l2norm_in_kernel=CASES[ci][8])


@pytest.mark.parametrize("ci", range(len(CASES)), ids=[gdr_case_id(c) for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(ci, dtype):
    o, fs = triton_out(ci, dtype)
    ro, rfs = reference(ci, dtype)
    assert o.dtype == dtype and fs.dtype == torch.float32
    budget = BUDGETS[dtype]
    assert rel_err(o, ro) <= budget["o"], f"o: rel err {rel_err(o, ro):.2e}"
    assert rel_err(fs, rfs) <= budget["state"], f"state: rel err {rel_err(fs, rfs):.2e}"


@pytest.mark.parametrize("ci", range(len(CASES)), ids=[gdr_case_id(c) for c in CASES])
def test_padding_rows_exactly_zero(ci):
    o, _ = triton_out(ci, torch.bfloat16)
    _, cu, cu_pad, rows = inputs(ci, torch.bfloat16)
    pad = ~real_rows(cu.cpu(), None if cu_pad is None else cu_pad.cpu(), rows)
    assert torch.isfinite(o).all()
    assert (o[0, pad.to(o.device)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ci", [1, 2, 3], ids=[gdr_case_id(CASES[i]) for i in (1, 2, 3)])
def test_agrees_with_torch_backend(ci, dtype):
    o, fs = triton_out(ci, dtype)
    to, tfs = run(ci, dtype, "torch")
    # bf16: the Triton state pass rounds the state and X' to bf16 as dot operands (chunk_fwd.py), the
    # torch backend does not, so the two agree to half the bf16 budgets, not to fp32 rounding
    tol_o, tol_s = (1e-5, 1e-5) if dtype == torch.float32 else (BUDGETS[dtype]["o"] / 2,
                                                               BUDGETS[dtype]["state"] / 2)
    assert rel_err(o, to.double()) <= tol_o and rel_err(fs, tfs.double()) <= tol_s


def test_noncontiguous_inputs_int64_cu_seqlens_and_batch_rows():
    (q, k, v, g, beta, h0), cu, cu_pad, _ = inputs(2, torch.float32)
    K, V = q.shape[-1], v.shape[-1]
    qn, kn = (torch.cat([x, x], -1)[..., :K] for x in (q, k))
    vn = torch.cat([v, v], -1)[..., V:]
    gn = torch.stack([g, g], -1)[..., 0]
    assert not qn.is_contiguous() and not gn.is_contiguous()
    o, fs = gdn_packed.chunk_gated_delta_rule(qn, kn, vn, gn, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu.long(), cu_seqlens_padded=cu_pad.long(),
                                              backend="triton")
    ro, rfs = reference(2, torch.float32)
    assert rel_err(o, ro) <= 1e-5 and rel_err(fs, rfs) <= 1e-5
    # without cu_seqlens every batch row is one sequence
    B, L = 2, 70
    q, k, v, g, beta, h0 = gdr_inputs(L, 1, 2, 16, 16, batch=B, initial_state=True, device=DEV)
    o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              backend="triton")
    ro, rfs = reference_gdr(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double())
    assert rel_err(o, ro) <= 1e-5 and rel_err(fs, rfs) <= 1e-5


def test_zero_length_sequences_pass_state_through():
    cu = torch.tensor([0, 0, 5, 5], dtype=torch.int32, device=DEV)
    q, k, v, g, beta, h0 = gdr_inputs(5, 1, 1, 16, 16, N=3, initial_state=True, device=DEV)
    _, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu, backend="triton")
    assert torch.equal(fs[0], h0[0]) and torch.equal(fs[2], h0[2])
    _, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                              backend="triton")
    assert (fs[0] == 0).all() and (fs[2] == 0).all()


def test_forward_makes_no_host_sync():
    (q, k, v, g, beta, h0), cu, cu_pad, _ = inputs(2, torch.float32)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_padded=cu_pad,
              backend="triton")
    if DEV == "cuda":
        gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, **kw)      # compile outside the check
        torch.cuda.set_sync_debug_mode("error")
        try:
            gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with no_host_sync():
            gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, **kw)


def test_autograd_runs_with_triton_backend():
    """Autograd through backend="triton" gives the torch backend's gradients."""
    (q, k, v, g, beta, h0), cu, cu_pad, _ = inputs(2, torch.float32)
    grads = {}
    for backend in ("triton", "torch"):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, fs = gdn_packed.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad, backend=backend)
        (o.square().sum() + fs.sum()).backward()
        grads[backend] = [x.grad for x in leaves]
    for a, b in zip(grads["triton"], grads["torch"]):
        assert rel_err(a, b) <= 1e-5


FLA_CASES = [0, 2, 3, 5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("ci", FLA_CASES, ids=[gdr_case_id(CASES[i]) for i in FLA_CASES])
def test_no_worse_than_fla(ci, dtype, report_table):
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    (q, k, v, g, beta, h0), cu, cu_pad, rows = inputs(ci, dtype)
    l2 = CASES[ci][8]
    ro, rfs = reference(ci, dtype)
    if cu_pad is not None:      # FLA has no padded layout: give it the real rows only
        real = real_rows(cu.cpu(), cu_pad.cpu(), rows).to(q.device)
        q, k, v, g, beta = (x[:, real] for x in (q, k, v, g, beta))
        ro = ro[:, real]
    fo, ffs = fla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=l2)
    o, fs = triton_out(ci, dtype)
    if cu_pad is not None:
        o = o[:, real]
    ours, theirs = (rel_err(o, ro), rel_err(fs, rfs)), (rel_err(fo, ro), rel_err(ffs, rfs))
    report_table("triton fwd vs FLA 0.6.0, rel. error against float64",
                 f"{gdr_case_id(CASES[ci]):36s} {str(dtype)[6:]:8s} o {ours[0]:.2e} (FLA {theirs[0]:.2e})  "
                 f"state {ours[1]:.2e} (FLA {theirs[1]:.2e})")
    assert ours[0] <= 1.1 * theirs[0] and ours[1] <= 1.1 * theirs[1]
