"""The sm_90a chunked forward (csrc/chunk_gdr_fwd_sm90.cu) through its host mirror: the kernel's tile
program (csrc/chunk_gdr_sm90.cuh: the chunk walk, gate sums, E, the Gram products, the inverse by block
doubling, the state step, the padding rows) with plain loops in place of wgmma / TMA / ldmatrix, on CPU
tensors, K = V = 128 (the kernel's only head size), GVA 2:
  - o and the final state against the float64 per-sequence reference on every packing of
    gdn_packed.testing.PACKINGS: fp32 (no rounding in the mirror) within 1e-5, bf16 / fp16 within the
    budgets, padding rows exactly 0 with NaN-poisoned outputs, NaN in the inputs' padding rows isolated;
  - bf16 no worse than 1.1x FLA's chunk_gated_delta_rule on the same inputs (fla-core, the oracle);
  - the gates from raw a, b (A_log, dt_bias) as the torch backend forms them.
What the mirror cannot check (fragment layouts, swizzles, barriers, async proxies): docs/DESIGN.md
section 10; tools/gpu_check.py runs the device kernel."""
import functools

import pytest
import torch

from gdn_packed import _cext
from gdn_packed.testing import (BUDGETS, DTYPE_ID, PACKINGS, case_id, gdr_inputs, real_rows, reference_gdr,
                                rel_err)

if not _cext.built() or not hasattr(_cext.get_C(), "chunk_gdr_fwd_sm90_host"):
    why = _cext.cuda_unavailable_reason() if not _cext.built() else _cext.get_C().chunk_gdr_fwd_sm90_missing
    pytest.skip(f"gdn_packed._C has no sm_90a chunked kernel here: {why}", allow_module_level=True)

from gdn_packed.cuda.chunk import chunk_gdr_fwd_cuda  # noqa: E402
from gdn_packed.ops.chunk_table import make_chunk_table  # noqa: E402

H, HV, K = 1, 2, 128
IDS = [case_id(p, f"H{H}x{HV}", f"K{K}") for p in PACKINGS]


@functools.lru_cache(maxsize=None)
def case(pi, dtype, poison_padding=False):
    """Inputs of packing pi (l2norm, h0), the mirror's (o, final state) and the float64 reference."""
    p = PACKINGS[pi]
    cu, cu_pad, rows = p.layout()
    N = len(p.lengths)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, K, dtype, N=N, initial_state=True, unit_k=False, seed=pi)
    pad = ~real_rows(cu, cu_pad, rows)
    if poison_padding:
        for x in (q, k, v):
            x[0, pad] = float("nan")
    table, cc = make_chunk_table(cu, cu_pad, rows, 64)
    o = torch.full_like(v[0], float("nan"))
    fs = torch.full((N, HV, K, K), float("nan"))
    chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, K ** -0.5, 64, True, o, fs, host=True)
    clean = [torch.where(pad[None, :, None, None], 0.0, x.double()) for x in (q, k, v)]
    ro, rf = reference_gdr(*clean, g.double(), beta.double(), initial_state=h0.double(), cu_seqlens=cu,
                           cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=True)
    return (q, k, v, g, beta, h0), cu, pad, o[None], fs, ro, rf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("pi", range(len(PACKINGS)), ids=IDS)
def test_mirror_matches_float64_reference(pi, dtype):
    _, _, pad, o, fs, ro, rf = case(pi, dtype)
    b = BUDGETS[dtype]
    assert rel_err(o, ro) <= b["o"] and rel_err(fs, rf) <= b["state"], (rel_err(o, ro), rel_err(fs, rf))
    assert (o[0, pad] == 0).all() and torch.isfinite(o).all()


@pytest.mark.parametrize("pi", [1, 2, 3], ids=[IDS[i] for i in (1, 2, 3)])
def test_mirror_isolates_nan_in_padding_rows(pi):
    """NaN in q, k, v of every padding row: o and the state as without it (TMA loads those rows; prep
    zeroes them), padding rows 0."""
    _, _, pad, o, fs, _, _ = case(pi, torch.bfloat16, poison_padding=True)
    _, _, _, o0, fs0, _, _ = case(pi, torch.bfloat16)
    assert torch.equal(o, o0) and torch.equal(fs, fs0) and (o[0, pad] == 0).all()


@pytest.mark.parametrize("pi", [0, 2], ids=[IDS[0], IDS[2]])
def test_mirror_no_worse_than_fla(pi, report_table):
    fla = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core (the FLA comparison's oracle) "
                              "is not installed")
    (q, k, v, g, beta, h0), cu, pad, o, fs, ro, rf = case(pi, torch.bfloat16)
    real = ~pad
    fo, ffs = fla.chunk_gated_delta_rule(*(x[:, real] for x in (q, k, v, g, beta)), initial_state=h0,
                                         output_final_state=True, cu_seqlens=cu.long(),
                                         use_qk_l2norm_in_kernel=True)
    ours = dict(o=rel_err(o[:, real], ro[:, real]), state=rel_err(fs, rf))
    theirs = dict(o=rel_err(fo, ro[:, real]), state=rel_err(ffs, rf))
    report_table("cuda chunked forward (host mirror) vs FLA 0.6.0, bf16, rel. error (ours / FLA)",
                 f"{IDS[pi]:40s} " + "  ".join(f"{n} {ours[n]:.2e}/{theirs[n]:.2e}" for n in ours))
    worse = {n: (ours[n], theirs[n]) for n in ours if ours[n] > 1.1 * theirs[n]}
    assert not worse, worse


def test_mirror_raw_gates():
    """With A_log, dt_bias the kernel forms g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    from gdn_packed.torch_ref.chunk import gate_fwd_torch
    cu, cu_pad, rows = PACKINGS[2].layout()
    N = len(PACKINGS[2].lengths)
    q, k, v, a, b, h0 = gdr_inputs(rows, H, HV, K, K, torch.float32, N=N, initial_state=True, unit_k=False)
    A_log, dt_bias = torch.tensor([0.3, -1.0]), torch.tensor([0.5, 1.5])
    g, beta = gate_fwd_torch(a[0], b[0], A_log, dt_bias)
    table, cc = make_chunk_table(cu, cu_pad, rows, 64)
    outs = []
    for gg, bb, raw in ((g, beta, False), (a[0], b[0], True)):
        o, fs = torch.full_like(v[0], float("nan")), torch.full((N, HV, K, K), float("nan"))
        chunk_gdr_fwd_cuda(q[0], k[0], v[0], gg, bb, table, cc, h0, K ** -0.5, 64, True, o, fs, host=True,
                           A_log=A_log if raw else None, dt_bias=dt_bias if raw else None)
        outs.append((o, fs))
    assert rel_err(outs[1][0], outs[0][0].double()) <= 1e-6 and rel_err(outs[1][1], outs[0][1].double()) <= 1e-6
