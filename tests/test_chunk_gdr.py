"""gdn_packed.chunk_gated_delta_rule (torch backend): forward, final state and gradients against the
float64 per-sequence recurrence, on the packings of docs/DESIGN.md section 7."""
import pytest
import torch

import gdn_packed
from gdn_packed.testing import (BUDGETS, gdr_case_id, gdr_inputs, layout, poisoned_outputs, real_rows,
                                reference_gdr, rel_err)

# (lengths, gaps after each sequence or None, tail rows, H, HV, K, V, initial_state, l2norm)
CASES = [
    ([300], None, 0, 2, 2, 32, 16, False, False),
    ([0, 1, 63, 64, 65, 127, 300, 5], None, 0, 2, 4, 32, 16, True, True),
    ([65, 0, 1, 0], [3, 0, 7, 1], 5, 2, 8, 16, 32, True, False),
    ([127, 64, 63], [1, 64, 0], 9, 2, 4, 32, 48, False, True),
    ([1], None, 0, 2, 2, 16, 16, True, True),
    ([64, 64, 1, 0, 127], [0, 0, 0, 2, 0], 3, 2, 2, 64, 32, True, True),
]




def run_case(case, dtype, index_dtype=torch.int32, noncontig=False, seed=0):
    lens, gaps, tail, H, HV, K, V, with_h0, l2 = case
    cu, cu_pad, rows = layout(lens, gaps=gaps, tail=tail, index_dtype=index_dtype)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, V, dtype, N=len(lens), seed=seed,
                                      initial_state=with_h0, unit_k=not l2)
    if noncontig:   # views into wider tensors
        q, k = (torch.cat([x, x], -1)[..., :K] for x in (q, k))
        v = torch.cat([v, v], -1)[..., V:]
        g = torch.stack([g, g], -1)[..., 0]
        assert not q.is_contiguous() and not g.is_contiguous()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
    h0_leaf = None if h0 is None else h0.clone().requires_grad_()
    with poisoned_outputs():
        o, fs = gdn_packed.chunk_gated_delta_rule(*leaves, initial_state=h0_leaf, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                                                  use_qk_l2norm_in_kernel=l2, backend="torch")
        gen = torch.Generator().manual_seed(seed + 1)
        do = torch.randn(o.shape, generator=gen).to(o.dtype)
        dht = torch.randn(fs.shape, generator=gen)
        ((o.float() * do.float()).sum() + (fs * dht).sum()).backward()

    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref_h0 = None if h0 is None else h0.double().requires_grad_()
    ro, rfs = reference_gdr(*ref_leaves, initial_state=ref_h0, cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                            use_qk_l2norm_in_kernel=l2)
    ((ro * do.double()).sum() + (rfs * dht.double()).sum()).backward()
    got = dict(o=o, state=fs, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad,
               dg=leaves[3].grad, dbeta=leaves[4].grad)
    ref = dict(o=ro, state=rfs, dq=ref_leaves[0].grad, dk=ref_leaves[1].grad, dv=ref_leaves[2].grad,
               dg=ref_leaves[3].grad, dbeta=ref_leaves[4].grad)
    if h0 is not None:
        got["dh0"], ref["dh0"] = h0_leaf.grad, ref_h0.grad
    return got, ref, real_rows(cu, cu_pad, rows)


@pytest.mark.parametrize("case", CASES, ids=gdr_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_float64_reference(case, dtype):
    got, ref, real = run_case(case, dtype)
    budget = BUDGETS[dtype]
    for name in got:
        tol = budget["o"] if name == "o" else budget["state"] if name == "state" else budget["grad"]
        err = rel_err(got[name], ref[name])
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("case", CASES[1:4], ids=gdr_case_id)
def test_padding_rows_exactly_zero(case):
    got, _, real = run_case(case, torch.float32)
    pad = ~real
    assert pad.any() or case[1] is None
    for name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        assert torch.isfinite(got[name]).all(), name
        assert (got[name][0, pad] == 0).all(), f"{name} is not exactly 0 on padding rows"


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_noncontiguous_inputs_and_index_dtypes(index_dtype):
    got, ref, _ = run_case(CASES[2], torch.float32, index_dtype=index_dtype, noncontig=True)
    for name in got:
        assert rel_err(got[name], ref[name]) <= 1e-5, name


def test_batched_without_cu_seqlens():
    B, L, H, HV, K, V = 3, 70, 2, 4, 16, 16
    q, k, v, g, beta, h0 = gdr_inputs(L, H, HV, K, V, batch=B, initial_state=True)
    o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ro, rfs = reference_gdr(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double())
    assert rel_err(o, ro) <= 1e-5 and rel_err(fs, rfs) <= 1e-5


def test_zero_length_sequences_pass_state_through():
    cu = torch.tensor([0, 0, 5, 5], dtype=torch.int32)
    q, k, v, g, beta, h0 = gdr_inputs(5, 2, 2, 16, 16, N=3, initial_state=True)
    h0 = h0.requires_grad_()
    o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu)
    assert torch.equal(fs[0], h0[0]) and torch.equal(fs[2], h0[2])
    dht = torch.randn_like(fs)
    (fs * dht).sum().backward()
    assert torch.equal(h0.grad[0], dht[0]) and torch.equal(h0.grad[2], dht[2])


def test_no_final_state_unless_asked():
    q, k, v, g, beta, _ = gdr_inputs(10, 2, 2, 16, 16)
    o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta)
    assert fs is None and o.shape == v.shape and o.dtype == v.dtype


@pytest.mark.parametrize("seed", [1, 2])
def test_fast_decay_fp32(seed):
    """Megatron's gate init (A in [1, 16]) drives g to about -20 per token: gamma reaches -1e3 within a
    chunk, where exponents formed as differences of two cumulative sums lose ~1e-5 in fp32."""
    cu, _, rows = layout([300, 65, 1, 127])
    q, k, v, _, beta, h0 = gdr_inputs(rows, 2, 4, 32, 32, N=4, initial_state=True, seed=seed, unit_k=False)
    gen = torch.Generator().manual_seed(seed)
    A = torch.empty(4).uniform_(1, 16, generator=gen)
    g = -A * torch.nn.functional.softplus(torch.randn(1, rows, 4, generator=gen) + 1)
    xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, fs = gdn_packed.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                              cu_seqlens=cu, use_qk_l2norm_in_kernel=True, backend="torch")
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(fs.shape, generator=gen)
    ((o * do).sum() + (fs * dht).sum()).backward()
    rs = [x.detach().double().requires_grad_() for x in xs]
    ro, rf = reference_gdr(*rs[:5], initial_state=rs[5], cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    ((ro * do.double()).sum() + (rf * dht.double()).sum()).backward()
    assert rel_err(o, ro) <= 1e-5 and rel_err(fs, rf) <= 1e-5
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), xs, rs):
        assert rel_err(a.grad, b.grad) <= 1e-5, name


@pytest.mark.parametrize("rows, cu", [(0, [0]), (0, [0, 0]), (5, [0]), (5, [0, 0, 0])],
                         ids=["T0-N0", "T0-N1", "T5-N0", "T5-N2-empty"])
def test_degenerate_packings(rows, cu):
    """No sequence, or only empty ones: o is all padding (0), final = initial state, dh0 = dht."""
    q, k, v, g, beta, _ = gdr_inputs(rows, 2, 4, 16, 16)
    c = torch.tensor(cu, dtype=torch.int32)
    h0 = torch.randn(len(cu) - 1, 4, 16, 16, requires_grad=True)
    xs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    with poisoned_outputs():
        o, fs = gdn_packed.chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, cu_seqlens=c)
        dht = torch.randn_like(fs)
        (o.sum() + (fs * dht).sum()).backward()
    assert (o == 0).all() and torch.equal(fs, h0) and torch.equal(h0.grad, dht)
    assert all((x.grad == 0).all() for x in xs)
