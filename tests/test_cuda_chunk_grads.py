"""The sm_90a backward's chunk-parallel gradients (csrc/chunk_gdr_grads_sm90.cu) through its host mirror: the
two warpgroups' tile programs (csrc/chunk_gdr_grads_sm90.cuh: grads_dq, grads_dk) over every (chunk slot, qk
head), with plain loops in place of wgmma / TMA, on CPU tensors, K = V = 128 (the kernel's only head size),
GVA 2, l2norm:
  - on every packing of gdn_packed.testing.PACKINGS, the Triton backward (chunk_gdr_bwd_triton, under the
    interpreter) with the mirror as its `grads` against the same backward with its own P, dq, A and dk
    kernels, on the same prep, recompute and dS pass: dq, dk, dg, dbeta (fp32 within 2e-6: both exact
    products in fp32, summed in other orders; fp16 within 2e-4: the Triton kernels round the gated dO, dX'
    and U to two operands, the mirror scales exact products), dv and dh0 bit for bit (not its outputs);
  - the same backward's gradients against autograd of the float64 per-sequence reference, within the
    budgets (fp32: the CPU budget; fp16);
  - bf16 (the interpreter's bf16 is wrong, so the mirror's bf16 instantiation takes the fp32 backward's
    inputs rounded to bf16): within the bf16 gradient budget of the fp32 result;
  - the entry point's refusals (shapes, dtypes, GVA) name the argument.
What the mirror cannot check (fragment layouts, swizzles, the named barriers between the two sides, TMA):
docs/DESIGN.md section 10; tests/test_cuda_chunk_gpu.py runs the device kernel."""
import functools

import pytest
import torch

from gdn_packed import _cext
from gdn_packed.testing import BUDGETS, DTYPE_ID, PACKINGS, case_id, gdr_inputs, real_rows, reference_gdr, rel_err

if not _cext.built() or not hasattr(_cext.get_C(), "chunk_gdr_grads_sm90_host"):
    why = _cext.cuda_unavailable_reason() if not _cext.built() else _cext.get_C().chunk_gdr_fwd_sm90_missing
    pytest.skip(f"gdn_packed._C has no sm_90a chunked kernel here: {why}", allow_module_level=True)

from gdn_packed.cuda.chunk import chunk_bwd_grads_cuda  # noqa: E402
from gdn_packed.ops.chunk_table import make_chunk_table  # noqa: E402

H, HV, K = 1, 2, 128
SCALE = K ** -0.5
IDS = [case_id(p, f"H{H}x{HV}", f"K{K}") for p in PACKINGS]


def _triton_or_skip():
    from gdn_packed.ops._common import triton_usable
    why = triton_usable(torch.device("cpu"))
    if why:
        pytest.skip(f"the Triton backward cannot run here: {why}")


@functools.lru_cache(maxsize=None)
def case(pi, dtype):
    """Inputs of packing pi (l2norm, h0, dht), and the Triton backward's outputs (dq, dk, dv, dg, dbeta, dh0):
    with its own kernels, with the mirror as its `grads`; and what the mirror was given (its arguments)."""
    from gdn_packed.triton.chunk import chunk_gdr_bwd_triton
    p = PACKINGS[pi]
    cu, cu_pad, rows = p.layout()
    N = len(p.lengths)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, K, dtype, N=N, initial_state=True, unit_k=False, seed=pi)
    gen = torch.Generator().manual_seed(100 + pi)
    do, dht = torch.randn(v.shape, generator=gen).to(dtype), torch.randn(h0.shape, generator=gen)
    table, cc = make_chunk_table(cu, cu_pad, rows, 64)
    given = []

    def grads(*args):
        given.append(args)
        chunk_bwd_grads_cuda(*args, host=True)

    out = {}
    for name, hook in (("triton", None), ("mirror", grads)):
        res = [torch.full(x.shape, float("nan"), dtype=x.dtype) for x in (q[0], k[0], v[0], g[0], beta[0])]
        dh0 = torch.full(h0.shape, float("nan"))
        chunk_gdr_bwd_triton(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, SCALE, 64, True, do[0], dht, *res, dh0,
                             grads=hook)
        out[name] = res + [dh0]
    return (q, k, v, g, beta, h0, do, dht), (cu, cu_pad), out, given[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("pi", range(len(PACKINGS)), ids=IDS)
def test_mirror_matches_the_triton_kernels(pi, dtype):
    _triton_or_skip()
    _, _, out, _ = case(pi, dtype)
    tol = 2e-6 if dtype == torch.float32 else 2e-4
    for i, name in enumerate(("dq", "dk", "dv", "dg", "dbeta", "dh0")):
        a, b = out["mirror"][i], out["triton"][i]
        assert not a.isnan().any(), name          # every row written (padding rows: the dS pass's zeros)
        if name in ("dv", "dh0"):
            assert torch.equal(a, b), name        # not the kernel's
        else:
            assert rel_err(a, b.double()) <= tol, (name, rel_err(a, b.double()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("pi", [0, 2, 4, len(PACKINGS) - 1], ids=[IDS[i] for i in (0, 2, 4, len(PACKINGS) - 1)])
def test_backward_with_the_mirror_matches_float64(pi, dtype):
    _triton_or_skip()
    (q, k, v, g, beta, h0, do, dht), (cu, cu_pad), out, _ = case(pi, dtype)
    pad = ~real_rows(cu, cu_pad, q.shape[1])
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    clean = [torch.where(pad[None, :, None, None], 0.0, x) for x in ref[:3]]
    ro, rf = reference_gdr(*clean, torch.where(pad[None, :, None], 0.0, ref[3]),
                           torch.where(pad[None, :, None], 0.0, ref[4]), scale=SCALE, initial_state=ref[5],
                           cu_seqlens=cu, cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=True)
    want = torch.autograd.grad([ro, rf], ref, [do.double(), dht.double()])
    got = out["mirror"]
    order = (0, 1, 2, 3, 4, 5)        # dq, dk, dv, dg, dbeta, dh0 against the grads of q, k, v, g, beta, h0
    for i in order:
        w = want[i][0] if i < 5 else want[i]
        real = (lambda x: x[~pad]) if i < 5 else (lambda x: x)    # noqa: E731
        assert rel_err(real(got[i]), real(w)) <= BUDGETS[dtype]["grad"], (i, rel_err(real(got[i]), real(w)))
        if i < 5:
            assert torch.equal(got[i][pad], torch.zeros_like(got[i][pad]))


@pytest.mark.parametrize("pi", [0, 2, 4], ids=[IDS[i] for i in (0, 2, 4)])
def test_bf16_mirror_on_rounded_inputs(pi):
    """The bf16 instantiation: the fp32 backward's inputs to the mirror (q, k, v, do, S^T, U^T, dSn^T, dX'^T)
    rounded to bf16, against the fp32 mirror's results on the unrounded ones: within the bf16 gradient
    budget (the rounding of its inputs is all it adds)."""
    _triton_or_skip()
    _, _, _, given = case(pi, torch.float32)
    q, k, v, g, do, table, prep, st, ut, dsn, dxp, scale, dq, dk, dgp, dbp = given
    bf = torch.bfloat16
    outs = []
    for dt in (torch.float32, bf):
        oq, ok = torch.full_like(dq, float("nan")), torch.full_like(dk, float("nan"))
        ogp, obp = torch.zeros_like(dgp), torch.zeros_like(dbp)
        rnd = [x.to(dt) for x in (q, k, v, do)]
        chunk_bwd_grads_cuda(*rnd[:3], g, rnd[3], table, prep, st.to(dt), ut.to(dt), dsn.to(dt), dxp.to(dt), scale,
                             oq, ok, ogp, obp, host=True)
        outs.append((oq, ok, ogp, obp[1]))
    live = ~outs[0][0].isnan().any(-1).any(-1)        # the rows of the table's chunks (the rest untouched)
    for a, b in zip(outs[1], outs[0]):
        a, b = (a[live], b[live]) if a.shape[0] == live.numel() else (a[..., live], b[..., live])   # dq, dk; shares
        assert rel_err(a, b.double()) <= BUDGETS[bf]["grad"]


def test_entry_point_names_its_arguments():
    _triton_or_skip()
    q, k, v, g, do, table, prep, st, ut, dsn, dxp, scale, dq, dk, dgp, dbp = case(2, torch.float32)[3]
    args = [q, k, v, g, do, table, prep, st, ut, dsn, dxp, scale, dq, dk, dgp, dbp]

    def refused(i, x, exc, word):
        a = list(args)
        a[i] = x
        with pytest.raises(exc, match=word):
            chunk_bwd_grads_cuda(*a, host=True)

    refused(0, q[..., :64].contiguous(), ValueError, "q")                   # K != 128
    refused(2, v.double(), TypeError, "v")
    refused(3, g.half(), TypeError, "g")
    refused(7, st[:, :, :, :64].contiguous(), ValueError, "st")
    refused(12, dq.half(), TypeError, "dq")
    refused(14, dgp[:1].contiguous(), ValueError, "dg_part")
    with pytest.raises(ValueError, match="multiple"):                        # GVA: HV a multiple of H
        two = torch.cat([q, q, q], 1)
        chunk_bwd_grads_cuda(two, torch.cat([k, k, k], 1), v, g, do, table, prep, st, ut, dsn, dxp, scale,
                             torch.cat([dq, dq, dq], 1), torch.cat([dk, dk, dk], 1), dgp, dbp, host=True)
