"""Specification of gdn_packed.chunk_gated_delta_rule, run on every backend the op has
(gdn_packed.ops.BACKENDS) that can run here: torch, and triton (on CPU under the Triton interpreter
with tests/triton_shim.py, on CUDA where there is a GPU); a backend that cannot run here is a visible
skip. One case list, gdn_packed.testing.GDR_CASES (the packings of gdn_packed.testing.PACKINGS crossed
with heads, head sizes and flags), for every check:
  - o, final state and the gradients dq dk dv dg dbeta dh0 against autograd of the float64
    per-sequence recurrence, within gdn_packed.testing.budgets for fp32, bf16 and fp16 inputs;
  - padding rows exactly 0 in o and every gradient, outputs NaN-poisoned (cases with padding rows);
  - agreement between backends; bit-identical reruns; no host sync (opcheck and torch.compile on every
    backend: tests/test_chunk_gdr_op.py);
  - non-contiguous inputs and int64 cu_seqlens; batch rows without cu_seqlens; zero-length
    sequences pass the state and dht through; degenerate packings; fast decay;
  - bf16/fp16 error no worse than 1.1x FLA's chunk_gated_delta_rule against the same float64
    reference (a visible skip when fla-core is not installed).
Each (case, dtype, backend) runs once; the checks share its results (functools.lru_cache)."""
import functools

import pytest
import torch

import gdn_packed
from gdn_packed.testing import (DTYPE_ID, GDR_CASES, PACKING_BY_NAME, GdrCase, backend_params, budgets, gdr_case_id,
                                gdr_inputs, layout, no_host_sync, poisoned_outputs, real_rows, reference_gdr, rel_err)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OP = "chunk_gated_delta_rule"
# cuda: K = V = 128 in bf16 / fp16 only, no case of GDR_CASES (asked by name it refuses them);
# tests/test_cuda_chunk.py checks it
BACKENDS = [p for p in backend_params(OP, DEV) if p.values[0] != "cuda"]
OTHER_BACKENDS = [p for p in BACKENDS if p.values[0] != "torch"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# V >= 128 in bf16 / fp16: the Triton state passes at 128-row state blocks and 8 warps (gdn_packed/triton/
# configs.py state_config), which no case of GDR_CASES reaches (V <= 48); test_wide_state_blocks_triton
WIDE, MASKED = len(GDR_CASES), len(GDR_CASES) + 1
CASES = GDR_CASES + [GdrCase(PACKING_BY_NAME["around-chunk-gaps"], 1, 2, 16, 128, h0=True, l2=True),
                     GdrCase(PACKING_BY_NAME["around-chunk-gaps"], 1, 2, 128, 64, h0=True, l2=True)]
CASE_IDS = [gdr_case_id(c) for c in CASES]
PADDED = [i for i, c in enumerate(GDR_CASES) if c.packing.has_padding]
assert PADDED, "GDR_CASES has no case with padding rows: the padding checks would test nothing"


def cases(indices):
    return pytest.mark.parametrize("ci", indices, ids=[CASE_IDS[i] for i in indices])


ALL_CASES = cases(range(len(GDR_CASES)))
AGREE = [1, 2, 3]        # mixed, gaps-and-empties, around-chunk-gaps
FLA_CASES = [0, 2, 3, 5]   # not mixed (625 tokens): FLA's own kernels take longest in the interpreter
RERUN = 2                # gaps-and-empties


def on_dev(t):
    return None if t is None else t.to(DEV)


@functools.lru_cache(maxsize=None)
def inputs(ci, dtype):
    """(q, k, v, g, beta, h0), cu_seqlens, cu_seqlens_padded, rows, and the cotangents do, dht."""
    c = CASES[ci]
    cu, cu_pad, rows = c.packing.layout()
    N = len(c.packing.lengths)
    x = gdr_inputs(rows, c.H, c.HV, c.K, c.V, dtype, N=N, initial_state=c.h0, unit_k=not c.l2, seed=ci)
    gen = torch.Generator().manual_seed(100 + ci)
    do = torch.randn(1, rows, c.HV, c.V, generator=gen).to(dtype)
    dht = torch.randn(N, c.HV, c.K, c.V, generator=gen)
    return tuple(map(on_dev, x)), on_dev(cu), on_dev(cu_pad), rows, on_dev(do), on_dev(dht)


def leaves_of(x):
    return [None if t is None else t.detach().clone().requires_grad_() for t in x]


def call(leaves, cu, cu_pad, l2, backend):
    return gdn_packed.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                             cu_seqlens=cu, cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=l2,
                                             backend=backend)


def with_grads(leaves, o, fs, do, dht):
    """{o, state, dq, ..., dh0} from the outputs and the gradients of <o, do> + <final_state, dht>."""
    wrt = [t for t in leaves if t is not None]
    outs = [(y, dy) for y, dy in ((o, do), (fs, dht)) if y.requires_grad]    # o of padding only: none
    got = torch.autograd.grad([y for y, _ in outs], wrt, [dy for _, dy in outs], allow_unused=True)
    got = [torch.zeros_like(x) if dx is None else dx for x, dx in zip(wrt, got)]
    out = dict(o=o.detach(), state=fs.detach())
    out.update(zip(GRADS, got + [None] * (len(GRADS) - len(got))))
    return out


def run(ci, dtype, backend):
    """Forward and backward of `backend` on case ci, outputs NaN-poisoned (not cached)."""
    x, cu, cu_pad, _, do, dht = inputs(ci, dtype)
    leaves = leaves_of(x)
    with poisoned_outputs():
        o, fs = call(leaves, cu, cu_pad, CASES[ci].l2, backend)
        return with_grads(leaves, o, fs, do, dht)


def forward(ci, dtype, backend):
    """(o, final state): those of the cached forward + backward run (the forward is the same kernel)."""
    got = result(ci, dtype, backend)
    return got["o"], got["state"]


@functools.lru_cache(maxsize=None)
def result(ci, dtype, backend):
    return run(ci, dtype, backend)


@functools.lru_cache(maxsize=None)
def reference(ci, dtype):
    """The float64 per-sequence recurrence on the same (rounded) inputs, on the CPU, with its gradients."""
    x, cu, cu_pad, _, do, dht = inputs(ci, dtype)
    leaves = [None if t is None else t.detach().cpu().double().requires_grad_() for t in x]
    o, fs = reference_gdr(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu.cpu(),
                          cu_seqlens_padded=None if cu_pad is None else cu_pad.cpu(),
                          use_qk_l2norm_in_kernel=CASES[ci].l2)
    return with_grads(leaves, o, fs, do.cpu().double(), dht.cpu().double())


def errors(got, ref, names):
    return {n: rel_err(got[n].cpu(), ref[n]) for n in names if ref[n] is not None}


def over_budget(err, dtype):
    """The errors over their budget (docs/DESIGN.md section 7): o, state, dg/dbeta the gate budget,
    the other gradients the gradient budget."""
    b = budgets(dtype, DEV)
    key = dict(o="o", state="state", dg="gate_grad", dbeta="gate_grad")
    return {n: f"{e:.2e} > {b[key.get(n, 'grad')]:.0e}" for n, e in err.items() if e > b[key.get(n, "grad")]}


def padding(ci):
    _, cu, cu_pad, rows, _, _ = inputs(ci, torch.float32)
    return ~real_rows(cu.cpu(), None if cu_pad is None else cu_pad.cpu(), rows).to(DEV)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@ALL_CASES
def test_forward_matches_float64_reference(ci, dtype, backend):
    o, fs = forward(ci, dtype, backend)
    assert o.dtype == dtype and fs.dtype == torch.float32
    err = over_budget(errors(dict(o=o, state=fs), reference(ci, dtype), ("o", "state")), dtype)
    assert not err, err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@ALL_CASES
def test_gradients_match_float64_reference(ci, dtype, backend):
    err = over_budget(errors(result(ci, dtype, backend), reference(ci, dtype), GRADS), dtype)
    assert not err, err


@pytest.mark.parametrize("backend", BACKENDS)
@cases(PADDED)
def test_padding_rows_exactly_zero(ci, backend):
    """Outputs NaN-poisoned: o and every token gradient are finite everywhere and exactly 0 on padding."""
    pad = padding(ci)
    assert pad.any(), f"{CASE_IDS[ci]} has no padding row"
    got = result(ci, torch.float32, backend)
    for name in ("o",) + GRADS[:5]:
        assert torch.isfinite(got[name]).all(), name
        assert (got[name][0, pad] == 0).all(), f"{name} is not exactly 0 on padding rows"
    o, _ = forward(ci, torch.bfloat16, backend)
    assert torch.isfinite(o).all() and (o[0, pad] == 0).all(), "bf16 o is not exactly 0 on padding rows"


@pytest.mark.parametrize("backend", OTHER_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
@cases(AGREE)
def test_agrees_with_torch_backend(ci, dtype, backend):
    """Forward in fp32 and bf16, gradients in fp32. bf16: the Triton state pass rounds the state and X'
    to bf16 as dot operands (gdn_packed/triton/chunk_fwd.py), the torch backend does not, so the two
    agree to half the bf16 budgets; fp32 on a GPU: tf32 dots, so the GPU fp32 budgets."""
    o, fs = forward(ci, dtype, backend)
    to, tfs = forward(ci, dtype, "torch")
    b = budgets(dtype, DEV)
    tol_o, tol_s = (1e-5, 1e-5) if b["o"] <= 1e-5 else (b["o"] / 2, b["state"] / 2)
    assert rel_err(o, to.double()) <= tol_o and rel_err(fs, tfs.double()) <= tol_s
    if dtype == torch.float32:
        ref = {n: None if t is None else t.double().cpu() for n, t in result(ci, dtype, "torch").items()}
        err = over_budget(errors(result(ci, dtype, backend), ref, GRADS), dtype)
        assert not err, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_bit_identical_reruns(backend):
    a, b = result(RERUN, torch.float32, backend), run(RERUN, torch.float32, backend)
    for name in a:
        assert (a[name] is None and b[name] is None) or torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_make_no_host_sync(backend):
    x, cu, cu_pad, _, do, dht = inputs(RERUN, torch.float32)
    leaves = leaves_of(x)
    if DEV == "cuda":
        torch.autograd.grad(call(leaves, cu, cu_pad, False, backend), leaves, (do, dht))   # compile outside
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.autograd.grad(call(leaves, cu, cu_pad, False, backend), leaves, (do, dht))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with no_host_sync():
            torch.autograd.grad(call(leaves, cu, cu_pad, False, backend), leaves, (do, dht))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=DTYPE_ID.get)
def test_noncontiguous_inputs_and_index_dtypes(index_dtype, backend):
    """Views into wider tensors (q, k, v, g) and int32/int64 cu_seqlens give the reference's answer."""
    ci = RERUN
    x, cu, cu_pad, _, do, dht = inputs(ci, torch.float32)
    q, k, v, g, beta, h0 = x
    K, V = q.shape[-1], v.shape[-1]
    q, k = (torch.cat([t, t], -1)[..., :K] for t in (q, k))
    v = torch.cat([v, v], -1)[..., V:]
    g = torch.stack([g, g], -1)[..., 0]
    assert not q.is_contiguous() and not v.is_contiguous() and not g.is_contiguous()
    leaves = leaves_of((q, k, v, g, beta, h0))
    with poisoned_outputs():
        o, fs = call(leaves, cu.to(index_dtype), cu_pad.to(index_dtype), GDR_CASES[ci].l2, backend)
        got = with_grads(leaves, o, fs, do, dht)
    err = over_budget(errors(got, reference(ci, torch.float32), ("o", "state") + GRADS), torch.float32)
    assert not err, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
def test_triton_reads_views_of_a_fused_projection(dtype):
    """q, k, v split from one fused projection [T, 2 H K + HV V + pad] (rows further apart than the heads
    fill) reach the Triton kernels as they are, no contiguous copy (gdn_packed/triton/chunk.py,
    packed_rows), and give the contiguous inputs' o, state and gradients bit for bit."""
    if "triton" not in [p.values[0] for p in BACKENDS]:
        pytest.skip("the triton backend cannot run here")
    from gdn_packed.triton.chunk import packed_rows
    x, cu, cu_pad, rows, do, dht = inputs(RERUN, dtype)
    q, k, v, g, beta, h0 = x
    c = GDR_CASES[RERUN]
    fused = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2), torch.zeros_like(q.flatten(-2))], -1)
    parts = fused.split([c.H * c.K, c.H * c.K, c.HV * c.V, c.H * c.K], -1)[:3]
    views = [t.unflatten(-1, (n, d)) for t, n, d in zip(parts, (c.H, c.H, c.HV), (c.K, c.K, c.V))]
    assert not any(t.is_contiguous() for t in views)
    qv, kv, _ = packed_rows(views[0][0], views[1][0])
    assert qv.data_ptr() == views[0].data_ptr() and kv.data_ptr() == views[1].data_ptr(), "copied"
    got = []
    for xs in ((q, k, v), views):
        leaves = [t.detach().requires_grad_() for t in xs] + leaves_of((g, beta, h0))
        with poisoned_outputs():
            o, fs = call(leaves, cu, cu_pad, c.l2, "triton")
            got.append(with_grads(leaves, o, fs, do, dht))
    for name in got[0]:
        assert torch.equal(got[0][name], got[1][name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_without_cu_seqlens(backend):
    """Without cu_seqlens every batch row is one sequence."""
    q, k, v, g, beta, h0 = gdr_inputs(70, 1, 2, 16, 16, batch=2, initial_state=True, device=DEV)
    o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              backend=backend)
    ro, rfs = reference_gdr(*(t.cpu().double() for t in (q, k, v, g, beta, h0)[:5]),
                            initial_state=h0.cpu().double())
    err = over_budget(errors(dict(o=o, state=fs), dict(o=ro, state=rfs), ("o", "state")), torch.float32)
    assert not err, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_length_sequences_pass_state_and_dht_through(backend):
    cu = torch.tensor([0, 0, 5, 5], dtype=torch.int32, device=DEV)
    q, k, v, g, beta, h0 = gdr_inputs(5, 1, 2, 16, 16, N=3, initial_state=True, device=DEV)
    h0 = h0.requires_grad_()
    _, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu, backend=backend)
    assert torch.equal(fs[0], h0[0]) and torch.equal(fs[2], h0[2])
    dht = torch.randn_like(fs)
    (dh0,) = torch.autograd.grad(fs, h0, dht)
    assert torch.equal(dh0[0], dht[0]) and torch.equal(dh0[2], dht[2])
    _, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                              backend=backend)
    assert (fs[0] == 0).all() and (fs[2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_final_state_unless_asked(backend):
    q, k, v, g, beta, _ = gdr_inputs(10, 2, 2, 16, 16, device=DEV)
    o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, backend=backend)
    assert fs is None and o.shape == v.shape and o.dtype == v.dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows, cu", [(0, [0]), (0, [0, 0]), (5, [0]), (5, [0, 0, 0])],
                         ids=["T0-N0", "T0-N1", "T5-N0", "T5-N2-empty"])
def test_degenerate_packings(rows, cu, backend):
    """No sequence, or only empty ones: o is all padding (0), final = initial state, dh0 = dht."""
    q, k, v, g, beta, _ = gdr_inputs(rows, 2, 4, 16, 16, device=DEV)
    c = torch.tensor(cu, dtype=torch.int32, device=DEV)
    h0 = torch.randn(len(cu) - 1, 4, 16, 16, device=DEV, requires_grad=True)
    xs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    with poisoned_outputs():
        o, fs = gdn_packed.chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, cu_seqlens=c,
                                                  backend=backend)
        dht = torch.randn_like(fs)
        (o.sum() + (fs * dht).sum()).backward()
    assert (o == 0).all() and torch.equal(fs, h0) and torch.equal(h0.grad, dht)
    assert all((t.grad == 0).all() for t in xs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [1, 2])
def test_fast_decay_fp32(seed, backend):
    """Megatron's gate init (A in [1, 16]) drives g to about -20 per token: gamma reaches -1e3 within a
    chunk, where exponents formed as differences of two cumulative sums lose ~1e-5 in fp32."""
    cu, _, rows = layout([300, 65, 1, 127])
    q, k, v, _, beta, h0 = gdr_inputs(rows, 2, 4, 32, 32, N=4, initial_state=True, seed=seed, unit_k=False)
    gen = torch.Generator().manual_seed(seed)
    A = torch.empty(4).uniform_(1, 16, generator=gen)
    g = -A * torch.nn.functional.softplus(torch.randn(1, rows, 4, generator=gen) + 1)
    do, dht = torch.randn(1, rows, 4, 32, generator=gen), torch.randn(4, 4, 32, 32, generator=gen)
    xs = leaves_of(on_dev(t) for t in (q, k, v, g, beta, h0))
    with poisoned_outputs():
        o, fs = call(xs, on_dev(cu), None, True, backend)
        got = with_grads(xs, o, fs, on_dev(do), on_dev(dht))
    rs = [t.detach().cpu().double().requires_grad_() for t in xs]
    ro, rf = reference_gdr(*rs[:5], initial_state=rs[5], cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    ref = with_grads(rs, ro, rf, do.double(), dht.double())
    err = over_budget(errors(got, ref, ("o", "state") + GRADS), torch.float32)
    assert not err, err


@functools.lru_cache(maxsize=None)
def fla_result(ci, dtype):
    """FLA's o, final state and gradients on the same inputs. FLA has no padded layout: it gets the real
    rows only; o and the token gradients are scattered back into the padded rows (0 on padding)."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core (the FLA comparison's oracle) "
                              "is not installed")
    x, cu, cu_pad, rows, do, dht = inputs(ci, dtype)
    real = ~padding(ci)
    leaves = leaves_of(x)
    q, k, v, g, beta = (t[:, real] for t in leaves[:5])
    o, fs = fla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=leaves[5], output_final_state=True,
                                       cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=CASES[ci].l2)
    full_o = o.new_zeros(1, rows, *o.shape[2:])
    full_o[:, real] = o
    return with_grads(leaves, full_o, fs, do, dht)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_ID.get)
@cases(FLA_CASES)
def test_no_worse_than_fla(ci, dtype, backend, report_table):
    """bf16/fp16: o, state and every gradient within 1.1x the error of FLA's chunk_gated_delta_rule on the
    same inputs against the same float64 reference (errors on the real rows)."""
    theirs = fla_result(ci, dtype)
    ref, real = reference(ci, dtype), ~padding(ci)
    got = result(ci, dtype, backend)
    names = ("o", "state") + GRADS
    on_real = lambda d: {n: t if t is None or n in ("state", "dh0") else t[:, real.cpu()]  # noqa: E731
                         for n, t in d.items()}
    ref = on_real(ref)
    ours = errors(on_real({n: None if t is None else t.cpu() for n, t in got.items()}), ref, names)
    fla = errors(on_real({n: None if t is None else t.cpu() for n, t in theirs.items()}), ref, names)
    report_table(f"{backend} vs FLA 0.6.0, rel. error against float64 (ours / FLA)",
                 f"{CASE_IDS[ci]:44s} {DTYPE_ID[dtype]:5s} " + "  ".join(f"{n} {ours[n]:.2e}/{fla[n]:.2e}"
                                                                      for n in ours))
    worse = {n: f"ours {ours[n]:.2e} > 1.1 x FLA {fla[n]:.2e}" for n in ours if ours[n] > 1.1 * fla[n]}
    assert not worse, worse


SEGMENTED = [1, 2, 5]     # mixed (h0, l2, GVA 4), gaps-and-empties (h0), chunk-multiples (K 64, h0, l2)


def run_in_segments(ci, dtype, segments, monkeypatch):
    """The Triton backend on case ci with its state passes in `segments` segments (forced: configs.state_segments
    picks them only for few long sequences on many SMs), checked: o, state and every gradient within the
    budgets, the padding rows exactly 0. Returns (results, float64 reference, names, errors, padding mask)."""
    if "triton" not in [p.values[0] for p in BACKENDS]:
        pytest.skip("the triton backend cannot run here")
    from gdn_packed.triton import chunk as triton_chunk
    monkeypatch.setattr(triton_chunk, "state_segments", lambda *a, **kw: segments)
    got, ref, names = run(ci, dtype, "triton"), reference(ci, dtype), ("o", "state") + GRADS
    err = errors(got, ref, names)
    assert not over_budget(err, dtype), over_budget(err, dtype)
    pad = padding(ci)
    for n in ("o",) + GRADS[:5]:
        assert torch.isfinite(got[n]).all() and (got[n][0, pad] == 0).all(), n
    return got, ref, names, err, pad


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
@cases(SEGMENTED)
def test_segmented_state_pass(ci, dtype, segments, monkeypatch):
    """The Triton state pass with every sequence split into segments (pass A from zero states with the
    segment transitions, the combine of the boundary states, the pass from the entering states:
    gdn_packed/triton/chunk.py). configs.state_segments picks segments only for few long sequences on
    many SMs, so here they are forced, with sequences shorter than the segment count (empty segments),
    zero-length ones and padding: o, state and every gradient within the budgets, padding exactly 0,
    and bf16 no more than 1.1x the error of the unsegmented pass on the same inputs."""
    got, ref, names, err, pad = run_in_segments(ci, dtype, segments, monkeypatch)
    if dtype == torch.bfloat16:
        from gdn_packed.triton import chunk as triton_chunk
        monkeypatch.setattr(triton_chunk, "state_segments", lambda *a, **kw: 1)
        base = errors(result(ci, dtype, "triton"), ref, names)
        worse = {n: f"{err[n]:.2e} > 1.1 x {base[n]:.2e}" for n in err if err[n] > 1.1 * base[n]}
        assert not worse, worse


def test_segmented_state_pass_without_h0(monkeypatch):
    """run_in_segments on around-chunk-gaps (no h0, l2, V = 48; fp32: 16-row state blocks, so pass A has 5
    row blocks a segment, 3 of S^T) in 3 segments: without h0 pass A leaves the first segment's blocks of
    the transition out (chunk_fwd.py), and the combine never reads them. o, state and every gradient
    within the budgets, padding exactly 0."""
    run_in_segments(3, torch.float32, 3, monkeypatch)


@pytest.mark.parametrize("ci, dtype, segments, h0", [(0, torch.float32, 3, False), (0, torch.float32, 3, True),
                                                     (0, torch.bfloat16, 2, True), (0, torch.float32, 2, False),
                                                     (1, torch.float32, 3, False)],
                         ids=["fp32-S3", "fp32-S3-h0", "bf16-S2-h0", "fp32-S2-no-transition", "mixed-fp32-S3"])
def test_pass_a_in_halves(ci, dtype, segments, h0, monkeypatch):
    """Pass A with its transition blocks walking the two halves of each segment (configs.pass_a_plan picks
    that only for few long sequences on many SMs, so it is forced here), the halves' transitions
    multiplied by chunk_compose_kernel, on one-long (300 tokens: 5 chunks, in segments of 2, 2, 1 or 3, 2
    chunks; without h0 the first segment's transition is neither formed nor composed, and at S = 2 no
    transition block is walked at all; with h0 it is) and on mixed (GVA 4, l2norm; sequences of 0, 1
    and up to 5 chunks: empty segments, halves of 0 and 1 chunks),
    with a decay 50x slower than the cases' own (over a segment their transitions are ~0, and leaving
    the second halves out passed): o, state and every gradient within the budgets of float64 (the
    backward's dS pass takes the composed transitions), and on one-long against pass A over whole
    segments: fp32 within 1e-6 of it, bf16 within 1.1x its error (mixed, the slowest case under the
    interpreter, against float64 alone). Without the compose, or with P_second transposed in it, it fails
    (tried: one-long and mixed; on mixed dg 5.6e-2 and 6.6e-3 against the fp32 budget's 1e-5)."""
    if "triton" not in [p.values[0] for p in BACKENDS]:
        pytest.skip("the triton backend cannot run here")
    from gdn_packed.triton import chunk as triton_chunk
    c = CASES[ci]
    x, cu, cu_pad, _, do, dht = inputs(ci, dtype)
    gen = torch.Generator().manual_seed(7)
    h = on_dev(torch.randn(len(c.packing.lengths), c.HV, c.K, c.V, generator=gen) * 0.1) if h0 else None
    x = list(x[:3]) + [x[3] * 0.02, x[4], h]
    rs = [None if t is None else t.detach().cpu().double().requires_grad_() for t in x]
    ro, rf = reference_gdr(*rs[:5], initial_state=rs[5], cu_seqlens=cu.cpu(),
                           cu_seqlens_padded=None if cu_pad is None else cu_pad.cpu(),
                           use_qk_l2norm_in_kernel=CASES[ci].l2)
    ref, names = with_grads(rs, ro, rf, do.cpu().double(), dht.cpu().double()), ("o", "state") + GRADS
    monkeypatch.setattr(triton_chunk, "state_segments", lambda *a, **kw: segments)
    plans, pad = [], padding(ci)

    def halves(N, HV, K, V, S, steps, cfg_a, sms, has_h0=False):
        plans.append(1 if V % cfg_a["BV"] else 2)
        return plans[-1], 0
    out = {}
    for split in (False, True) if ci == 0 else (True,):
        if split:
            monkeypatch.setattr(triton_chunk, "pass_a_plan", halves)
        leaves = leaves_of(x)
        with poisoned_outputs():
            o, fs = call(leaves, cu, cu_pad, CASES[ci].l2, "triton")
            out[split] = with_grads(leaves, o, fs, do, dht)
        for n in ("o",) + GRADS[:5]:
            assert torch.isfinite(out[split][n]).all() and (out[split][n][0, pad] == 0).all(), n
    assert plans and set(plans) == {2}, plans
    err = errors(out[True], ref, names)
    assert not over_budget(err, dtype), over_budget(err, dtype)
    if False not in out:
        return
    if dtype == torch.float32:
        far = {n: f"{rel_err(out[True][n].cpu(), out[False][n].cpu()):.2e}" for n in names
               if ref[n] is not None and rel_err(out[True][n].cpu(), out[False][n].cpu()) > 1e-6}
        assert not far, far
    else:
        base = errors(out[False], ref, names)
        worse = {n: f"{err[n]:.2e} > 1.1 x {base[n]:.2e}" for n in err if err[n] > 1.1 * base[n]}
        assert not worse, worse


@pytest.mark.parametrize("segments", [1, 3])
def test_wide_state_blocks_triton(segments, monkeypatch, report_table):
    """V = 128 in bf16 (case WIDE: h0, l2norm, GVA 2, padding between and after the sequences): the
    forward state pass, its pass A (V + K = 144 carried rows: two 128-row blocks, the second mostly
    masked) and the backward's recompute run 128-row state blocks at 8 warps (configs.state_config), the
    dS pass too. Without segments and with three (forced; sequences of 1 and 2 chunks: empty segments):
    o, state and every gradient within the budgets and within 1.1x FLA's error, padding rows exactly 0."""
    from gdn_packed.triton.configs import state_config
    c, dtype = CASES[WIDE], torch.bfloat16
    for store in (False, True):
        cfg = state_config(c.K, c.V, dtype, store_states=store)
        assert (cfg["BV"], cfg["num_warps"]) == (128, 8), cfg
    got, ref, names, _, pad = run_in_segments(WIDE, dtype, segments, monkeypatch)
    real = (~pad).cpu()
    on_real = lambda d: {n: t if t is None or n in ("state", "dh0") else t.cpu()[:, real]  # noqa: E731
                         for n, t in d.items()}
    ours, fla = (errors(on_real(d), on_real(ref), names) for d in (got, fla_result(WIDE, dtype)))
    report_table("triton vs FLA 0.6.0, rel. error against float64 (ours / FLA)",
                 f"{CASE_IDS[WIDE]:44s} bf16 S={segments} " + "  ".join(f"{n} {ours[n]:.2e}/{fla[n]:.2e}"
                                                                    for n in ours))
    worse = {n: f"ours {ours[n]:.2e} > 1.1 x FLA {fla[n]:.2e}" for n in ours if ours[n] > 1.1 * fla[n]}
    assert not worse, worse


def test_masked_dstate_block_triton(monkeypatch):
    """K = 128, V = 64 in bf16 (case MASKED): the dS pass runs a 128-row block with its rows 64-127 masked
    (configs.bwd_configs: the 64-row block at 4 warps spilled there), 8 warps: o, state and every gradient
    within the budgets, padding rows exactly 0 (run_in_segments, unsegmented)."""
    from gdn_packed.triton.configs import bwd_configs
    c = CASES[MASKED]
    cfg = bwd_configs(c.K, c.V, torch.bfloat16)["dstate"]
    assert (cfg["BV"], cfg["num_warps"]) == (128, 8), cfg
    run_in_segments(MASKED, torch.bfloat16, 1, monkeypatch)


@pytest.mark.parametrize("segments, h0", [(1, True), (3, True), (3, False)], ids=["1", "3", "3-no-h0"])
def test_forward_keeps_segment_states_and_prep(segments, h0, monkeypatch):
    """The Triton forward returns as the op's `kept` (the fake kernel's size, triton/chunk.py kept_shape,
    every element written under NaN-poisoned outputs) the state entering every segment and pass A's end
    rows (the segment transitions the dS pass takes) when it runs in segments, then prep's outputs (Ts,
    M, gates, row factors): the backward started from them gives the gradients of the backward that
    recomputes them bit for bit, and reads each part (kept perturbed: other gradients). Both ops pass
    opcheck with the segments' kept (on the one-token case; prep's alone: test_chunk_gdr_op.py's opcheck with
    kept given). Without h0 pass A forms no transition for the first segment and writes its rows 0: kept
    written and the backward from it, there (the parts read: with h0)."""
    if "triton" not in [p.values[0] for p in BACKENDS]:
        pytest.skip("the triton backend cannot run here")
    from gdn_packed.ops.chunk_gdr import chunk_gdr_bwd, chunk_gdr_fwd
    from gdn_packed.triton import chunk as triton_chunk
    monkeypatch.setattr(triton_chunk, "state_segments", lambda *a, **kw: segments)
    ci = RERUN  # gaps-and-empties: zero-length and one-token sequences (empty segments), gaps, h0
    x, cu, cu_pad, rows, do, dht = inputs(ci, torch.float32)
    if not h0:
        x = (*x[:5], None)
    c = GDR_CASES[ci]
    args = (*x, cu, cu_pad, c.K ** -0.5, c.l2, "triton")
    with poisoned_outputs():
        o, fs, kept = chunk_gdr_fwd(*args, None, None, True)
    N = cu.numel() - 1
    entering = N * segments * c.HV * c.K * c.V if segments > 1 else 0
    states = entering + (N * (segments - 1) * c.HV * (c.V + c.K) * c.K if segments > 1 else 0)
    prep = triton_chunk.prep_words(rows // 64 + N, c.HV, torch.float32)
    assert kept.shape == (states + prep,) and not kept.isnan().any()
    bwd = args[:8] + (do, dht) + args[8:]
    from_kept = chunk_gdr_bwd(*bwd, None, None, kept)
    recomputed = chunk_gdr_bwd(*bwd)
    for name, a, b in zip(GRADS, from_kept, recomputed):
        assert torch.equal(a, b), name
    parts = ([slice(0, entering), slice(entering, states)] if states else []) + [slice(states, None)]
    for part in parts if h0 else []:
        off = kept.clone()
        off[part] *= 1.001
        changed = chunk_gdr_bwd(*bwd, None, None, off)
        assert not all(torch.equal(a, b) for a, b in zip(changed, from_kept) if a is not None), ("kept not read", part)
    if segments > 1 and h0:     # opcheck runs each op several times: on the one-token case (its kept is as laid out)
        x, cu, cu_pad, rows, do, dht = inputs(4, torch.float32)
        args = (*x, cu, cu_pad, GDR_CASES[4].K ** -0.5, GDR_CASES[4].l2, "triton")
        kept = chunk_gdr_fwd(*args, None, None, True)[2]
        assert kept.numel() > triton_chunk.prep_words(rows // 64 + 1, GDR_CASES[4].HV, torch.float32)
        torch.library.opcheck(chunk_gdr_fwd, args + (None, None, True))
        torch.library.opcheck(chunk_gdr_bwd, args[:8] + (do, dht) + args[8:] + (None, None, kept))


def test_training_forward_runs_in_the_segments_it_keeps(monkeypatch):
    """A forward that keeps its segments for the backward (autograd recording) picks S for both directions
    (configs.state_segments with the backward's configs: triton/chunk.py fwd_segments(training=True));
    one that does not, for itself. Forced apart here (2 for inference, 3 for training, on gaps-and-empties:
    zero-length and one-token sequences, h0): under autograd pass A runs over 2 segments and the backward
    runs none (it starts from the kept states), without autograd over 1; o, state and every gradient
    within the fp32 budgets of float64, padding rows 0. And the choice itself at the anchor (1 x 32768,
    32 value heads, K = V = 128, bf16): 4 segments for inference and for a training step, pass A's
    transition blocks in halves (configs.pass_a_plan; over whole segments S = 4 would take it two waves, and
    inference chose 3)."""
    if "triton" not in [p.values[0] for p in BACKENDS]:
        pytest.skip("the triton backend cannot run here")
    from gdn_packed.triton import chunk as triton_chunk
    from gdn_packed.triton import configs
    h200 = torch.device("cpu")      # off CUDA the configs plan for an H200 (132 SMs, 227 KB of shared memory)
    assert triton_chunk.fwd_segments(32768, 1, 32, 128, 128, torch.bfloat16, h200) == 4
    assert triton_chunk.fwd_segments(32768, 1, 32, 128, 128, torch.bfloat16, h200, training=True) == 4
    cfg_a = configs.state_config(128, 128, torch.bfloat16)
    assert configs.pass_a_plan(1, 32, 128, 128, 4, 128, cfg_a, 132) == (2, 128 + 64)
    assert configs.pass_a_plan(1, 32, 128, 128, 4, 128, cfg_a, 132, has_h0=True)[0] == 1     # 96 + 192 CTAs: no gain
    assert configs.pass_a_plan(1, 32, 128, 128, 3, 171, cfg_a, 132) == (1, 171)    # 96 CTAs: one wave
    real = configs.state_segments(32768, 4, 32, 128, 128, configs.state_config(128, 128, torch.bfloat16))
    assert real == 1            # many value heads x sequences fill the GPU: no segments either way
    monkeypatch.setattr(triton_chunk, "state_segments", lambda *a, bwd=None, **kw: 3 if bwd else 2)
    passes_a = []
    real_entering = triton_chunk.entering_states
    monkeypatch.setattr(triton_chunk, "entering_states", lambda pass_a, cu_chunks, N, HV, K, V, S, *a, **kw:
                        passes_a.append(S) or real_entering(pass_a, cu_chunks, N, HV, K, V, S, *a, **kw))
    ci = RERUN
    got, ref, names = run(ci, torch.float32, "triton"), reference(ci, torch.float32), ("o", "state") + GRADS
    err = errors(got, ref, names)
    assert not over_budget(err, torch.float32), over_budget(err, torch.float32)
    assert passes_a == [3, 3], passes_a     # the forward's pass A in 3 segments; the dS pass's (none in the recompute)
    passes_a.clear()
    x, cu, cu_pad, _, _, _ = inputs(ci, torch.float32)
    with torch.no_grad():
        o, fs = gdn_packed.chunk_gated_delta_rule(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=cu,
                                                  cu_seqlens_padded=cu_pad, backend="triton")
    assert passes_a == [2], passes_a
    inf = errors(dict(o=o, state=fs), ref, ("o", "state"))
    assert not over_budget(inf, torch.float32), over_budget(inf, torch.float32)
    assert (o[0, padding(ci)] == 0).all()


class _NanEmpty:
    """torch, except that torch.empty of a floating dtype is NaN-filled (scratch nobody writes shows)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kw):
        x = torch.empty(*size, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x


@pytest.mark.parametrize("ci, dtype, with_dht", [(0, torch.float32, False), (0, torch.float32, True),
                                                 (0, torch.bfloat16, False), (1, torch.float32, False)],
                         ids=["one-long-fp32", "one-long-fp32-dht", "one-long-bf16", "mixed-fp32"])
def test_segmented_dstate_takes_the_forward_transitions(ci, dtype, with_dht, monkeypatch):
    """The dS pass in segments takes the forward's segment transitions, transposed, and its pass A forms
    none of them (triton/chunk.py, chunk_bwd_dstate) but the last segment's, which the forward has not:
    with dht pass A forms it alone, without dht (no gradient of the final state) it is never read (the
    scratch is NaN-filled here). Three segments forced, cases one-long and mixed (h0, l2, GVA 4, empty
    segments; both with a 5-chunk sequence, whose last segment is not empty), gates g / 50 and beta / 4
    (with the cases' own a segment's transition is ~1e-10, so a wrong one passes; these give ~0.3): o and
    every gradient within the budgets against float64, padding rows exactly 0; on one-long the backward
    from the forward's kept bit for bit the one that recomputes everything (test_forward_keeps_segment_
    states_and_prep checks that on gaps-and-empties)."""
    if "triton" not in [p.values[0] for p in BACKENDS]:
        pytest.skip("the triton backend cannot run here")
    from gdn_packed.ops.chunk_gdr import chunk_gdr_bwd, chunk_gdr_fwd
    from gdn_packed.triton import chunk as triton_chunk
    monkeypatch.setattr(triton_chunk, "state_segments", lambda *a, **kw: 3)
    monkeypatch.setattr(triton_chunk, "torch", _NanEmpty())
    (q, k, v, g, beta, h0), cu, cu_pad, _, do, dht = inputs(ci, dtype)
    dht = dht if with_dht else None
    x = (q, k, v, g / 50, beta / 4, h0)
    leaves = leaves_of(x)
    with poisoned_outputs():
        o, fs = call(leaves, cu, cu_pad, CASES[ci].l2, "triton")
        got = with_grads(leaves, o, fs if with_dht else fs.detach(), do, dht)
    ref_leaves = [None if t is None else t.detach().cpu().double().requires_grad_() for t in x]
    o, fs = reference_gdr(*ref_leaves[:5], initial_state=ref_leaves[5], cu_seqlens=cu.cpu(),
                          cu_seqlens_padded=None if cu_pad is None else cu_pad.cpu(),
                          use_qk_l2norm_in_kernel=CASES[ci].l2)
    ref = with_grads(ref_leaves, o, fs if with_dht else fs.detach(), do.cpu().double(),
                     dht.cpu().double() if with_dht else None)
    err = errors(got, ref, ("o",) + GRADS)
    assert not over_budget(err, dtype), over_budget(err, dtype)
    pad = padding(ci)
    for n in ("o",) + GRADS[:5]:
        assert torch.isfinite(got[n]).all() and (got[n][0, pad] == 0).all(), n
    if ci != 0:
        return
    args = (*x, cu, cu_pad, CASES[ci].K ** -0.5, CASES[ci].l2, "triton")
    kept = chunk_gdr_fwd(*args, None, None, True)[2]
    bwd = args[:8] + (do, dht) + args[8:]
    for name, a, b in zip(GRADS, chunk_gdr_bwd(*bwd, None, None, kept), chunk_gdr_bwd(*bwd)):
        assert (a is None and b is None) or torch.equal(a, b), name


def run_l2(ci, dtype, l2):
    """run() of the Triton backend with use_qk_l2norm_in_kernel = l2."""
    x, cu, cu_pad, _, do, dht = inputs(ci, dtype)
    leaves = leaves_of(x)
    with poisoned_outputs():
        o, fs = call(leaves, cu, cu_pad, l2, "triton")
        return with_grads(leaves, o, fs, do, dht)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("ci, l2", [(0, False), (2, True)], ids=[CASE_IDS[0], CASE_IDS[2] + "-l2"])
def test_bounded_backward_in_head_slices(ci, l2, dtype, monkeypatch):
    """Scratch budget forced below one qk head's scratch (configs.BWD_SCRATCH_BUDGET): the forward keeps
    nothing and the Triton backward runs one slice of qk heads after another (configs.bwd_head_slices:
    here one qk head each), each with its own prep, states, segments and, with l2norm, pre-l2norm dq, dk;
    o, state and every gradient bit for bit those of the unbounded backward (no sum crosses a GVA
    group). Cases with two qk heads: one-long, and gaps-and-empties (GVA 2, h0) with l2norm."""
    if "triton" not in [p.values[0] for p in BACKENDS]:
        pytest.skip("the triton backend cannot run here")
    from gdn_packed.triton import chunk as triton_chunk
    from gdn_packed.triton import configs
    want = run_l2(ci, dtype, l2)
    calls = []
    bwd_heads = triton_chunk._bwd_heads
    monkeypatch.setattr(triton_chunk, "_bwd_heads", lambda q, *a: calls.append(q.shape[1]) or bwd_heads(q, *a))
    monkeypatch.setattr(configs, "BWD_SCRATCH_BUDGET", 1)
    c = GDR_CASES[ci]
    rows = inputs(ci, dtype)[3]
    assert triton_chunk.kept_shape(rows, len(c.packing.lengths), c.HV, c.K, c.V, 64, torch.device("cpu"),
                                   dtype) == (0,)
    got = run_l2(ci, dtype, l2)
    assert calls == [1] * c.H, calls
    for name in got:
        assert (got[name] is None and want[name] is None) or torch.equal(got[name], want[name]), name
