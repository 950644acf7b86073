"""Isolation to the bit (docs/DESIGN.md section 7): NaN, +Inf and -Inf planted in one document (the
first, a one-token one, the last, which owns the last row when there is no tail padding) or in the
padding rows, in each input tensor in turn, leave every other document's outputs, final states and
input gradients bit-identical to a clean run; padding outputs and padding gradients are exactly 0; and
with poison only in padding the parameter gradients are bit-identical to the clean run (so finite).
Every op, on every backend that runs here (torch; triton under the interpreter; the csrc/ kernels
through their host mirrors), and the layers. Also: hard resets (g = -inf, very negative g) in the
chunked op equal the recurrence and the float64 reference; float64 refused by the triton backend;
repeated state_indices in the recurrent op defined the same on every backend.

Layouts: short documents (every op) and, for the chunked op, documents across chunks (the packings
across-chunks and across-chunks-gaps of gdn_packed.testing.PACKINGS), where poison in the upstream
gradient do is planted too. The Triton chunked op is slow under the interpreter, so its runs poison
several tensors, in all targets at once. On a GPU machine the triton and cuda cases run on CUDA
tensors (fp32 GPU budgets for the hard resets); the isolation checks stay bit-exact there."""
import functools

import pytest
import torch

import gdn_packed
from gdn_packed import _cext
from gdn_packed.layers import GatedAttention, GatedDeltaNet, GDNState, HybridConfig, HybridLM, HybridStack
from gdn_packed import cuda as gdn_cuda
from gdn_packed.ops._common import triton_usable
from gdn_packed.testing import (PACKING_BY_NAME, Packing, gdr_inputs, layout, poisoned_outputs, reference_gdr,
                                rel_err)

LENS = [20, 1, 37, 9, 12]
LAYOUTS = {"padded": Packing("padded", LENS, gaps=[3, 0, 5, 0, 2], tail=4),   # gaps and tail rows
           # no padding: the last document owns the last row, the one out-of-range gathers clamp to
           # (tested for "last" only)
           "packed": Packing("packed", LENS),
           # documents across chunks, for the chunked op (its state hand-over from chunk to chunk)
           "across-chunks-gaps": PACKING_BY_NAME["across-chunks-gaps"],
           "across-chunks": PACKING_BY_NAME["across-chunks"]}
SHORT = ("padded", "packed")
ALL_TARGETS = ("first", "one_token", "last", "padding")
GPU = torch.cuda.is_available()
DEVICE = {"torch": "cpu", "host": "cpu", "cuda": "cuda", "triton": "cuda" if GPU else "cpu"}
TRITON_REASON = triton_usable(torch.device(DEVICE["triton"]))
CUDA_REASON = _cext.cuda_unavailable_reason() or ("" if GPU else "torch has no CUDA")
HAVE_CONV_HOST = _cext.built() and hasattr(_cext.get_C(), "conv1d_varlen_fwd_host")
HAVE_REC_HOST = _cext.built() and hasattr(_cext.get_C(), "recurrent_gdr_fwd_host")
TRITON = pytest.param("triton", marks=pytest.mark.skipif(bool(TRITON_REASON), reason=TRITON_REASON))
CONV_HOST = pytest.param("host", marks=pytest.mark.skipif(not HAVE_CONV_HOST, reason="no _C conv kernels"))
REC_HOST = pytest.param("host", marks=pytest.mark.skipif(not HAVE_REC_HOST, reason="no _C recurrent kernel"))
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(bool(CUDA_REASON), reason=f"no GPU: {CUDA_REASON}"))


def on(backend, *ts):
    """The tensors on the device `backend` runs on (None stays None)."""
    out = tuple(None if t is None else t.detach().to(DEVICE[backend]) for t in ts)
    return out if len(out) > 1 else out[0]


def to_cpu(out):
    return {n: (kind, t.detach().cpu()) for n, (kind, t) in out.items()}


@functools.lru_cache(maxsize=None)
def geometry(name):
    """(cu_seqlens, cu_seqlens_padded, rows, owner): owner[r] is the document of row r, -1 on padding."""
    p = LAYOUTS[name]
    cu, pad, rows = p.layout()
    owner = torch.full((rows,), -1)
    for i, (s, n) in enumerate(zip((cu if pad is None else pad).tolist(), p.lengths)):
        owner[s:s + n] = i
    return cu, pad, rows, owner


def docs(name):
    """The poisoned documents of a layout: the first, the first one-token one and the last."""
    lengths = LAYOUTS[name].lengths
    return {"first": 0, "one_token": lengths.index(1), "last": len(lengths) - 1}


def targets(layout_name, per_sequence=False):
    """Poison targets of a layout: every target where there is padding (padding rows only for row
    tensors), every document in a dense one, the last document only in the short dense one."""
    if layout_name == "packed":
        return ["last"]
    if not LAYOUTS[layout_name].has_padding:
        per_sequence = True
    return [t for t in ALL_TARGETS if t != "padding" or not per_sequence]


def cases(tensors, seq_tensors=(), layouts=SHORT):
    """(layout, tensor, target) for row tensors and per-sequence tensors (initial states)."""
    return [(lay, t, tgt) for lay in layouts for t in tensors + seq_tensors
            for tgt in targets(lay, per_sequence=t in seq_tensors)]


def case_id(c):
    return "-".join(c) if isinstance(c[2], str) else f"{c[0]}-{c[1]}-all"


def poison(x, hits, lay, per_sequence=False):
    """A copy of x whose elements in the hit rows (dim 1; dim 0 for per-sequence tensors) of layout
    lay cycle through NaN, +Inf, -Inf. hits: target names."""
    doc, owner = docs(lay), geometry(lay)[3]
    if per_sequence:
        sel = torch.tensor([doc[h] for h in hits])
    else:
        sel = torch.cat([torch.nonzero(owner == (doc[h] if h != "padding" else -1))[:, 0] for h in hits])
    dim = 0 if per_sequence else 1
    y = x.detach().clone()
    shape = list(y.shape)
    shape[dim] = sel.numel()
    y.index_copy_(dim, sel, bad_values(shape, y.dtype))
    return y


def bad_values(shape, dtype):
    """A tensor of `shape` cycling through NaN, +Inf, -Inf."""
    n = torch.Size(shape).numel()
    return torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype).repeat(n // 3 + 1)[:n].view(shape)


def assert_isolated(clean, dirty, lay, hits):
    """clean/dirty: name -> (kind, tensor); kind 'rows' (dim 1 = rows), 'seq' (dim 0 = sequences) or
    'param'. Rows and sequences not hit are bit-identical, padding rows are exactly 0, and with only
    padding hit the parameter gradients are bit-identical."""
    owner = geometry(lay)[3]
    hit = {docs(lay)[h] for h in hits if h != "padding"}
    keep = (owner >= 0) & ~torch.isin(owner, torch.tensor(sorted(hit), dtype=owner.dtype))
    keep_seq = [i for i in range(len(LAYOUTS[lay].lengths)) if i not in hit]
    for name, (kind, c) in clean.items():
        d = dirty[name][1]
        if kind == "rows":
            assert torch.equal(d[:, keep], c[:, keep]), f"{name}: other documents changed"
            assert (d[:, owner < 0] == 0).all(), f"{name}: padding rows are not exactly 0"
        elif kind == "seq":
            assert torch.equal(d[keep_seq], c[keep_seq]), f"{name}: other sequences changed"
        elif not hit:
            assert torch.equal(d, c), f"{name}: parameter gradient changed by padding"


def grads(loss, named):
    """name -> gradient of loss for the named tensors (None-safe)."""
    names = [n for n, t in named.items() if t is not None]
    gs = torch.autograd.grad(loss, [named[n] for n in names])
    return dict(zip(names, gs))


_CLEAN = {}


def check_op(run, inputs, backend, case):
    """run(backend, layout, inputs) on clean inputs (cached) and with case's tensor poisoned."""
    lay, tensor, tgt = case
    key = (run.__name__, backend, lay)
    if key not in _CLEAN:
        _CLEAN[key] = run(backend, lay, dict(inputs(lay)))
    ins = dict(inputs(lay))
    ins[tensor] = poison(ins[tensor], (tgt,), lay, per_sequence=tensor == "initial_state")
    assert_isolated(_CLEAN[key], run(backend, lay, ins), lay, (tgt,))


# ---- the chunked op -----------------------------------------------------------------------------------
GDR_ROW_TENSORS = ("q", "k", "v", "g", "beta")


@functools.lru_cache(maxsize=None)
def gdr_inputs_for(layout_name):
    cu, pad, rows, owner = geometry(layout_name)
    N = len(LAYOUTS[layout_name].lengths)
    q, k, v, g, beta, h0 = gdr_inputs(rows, 1, 2, 16, 16, N=N, initial_state=True, unit_k=False)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, rows, 2, 16, generator=gen)        # nonzero on padding rows too
    dht = torch.randn(N, 2, 16, 16, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0), do, dht


def run_chunk(backend, layout_name, ins, gated=False):
    """ins: the inputs by name, and the upstream gradient `do` when it is poisoned."""
    cu, pad = on(backend, *geometry(layout_name)[:2])
    ins = dict(ins)
    _, do, dht = gdr_inputs_for(layout_name)
    do, dht = on(backend, ins.pop("do", do), dht)
    ts = {n: on(backend, t).clone().requires_grad_() for n, t in ins.items()}
    extra = {}
    if gated:   # g, beta hold the raw a, b of the gating
        gen = torch.Generator().manual_seed(6)
        extra = {n: on(backend, torch.randn(2, generator=gen) * 0.5).requires_grad_() for n in ("A_log", "dt_bias")}
    with poisoned_outputs():
        o, fs = gdn_packed.chunk_gated_delta_rule(
            ts["q"], ts["k"], ts["v"], ts["g"], ts["beta"], initial_state=ts["initial_state"],
            output_final_state=True, cu_seqlens=cu, cu_seqlens_padded=pad, use_qk_l2norm_in_kernel=True,
            backend=backend, **extra)
        gs = grads((o * do).sum() + (fs * dht).sum(), {**ts, **extra})
    out = {"o": ("rows", o.detach()), "final_state": ("seq", fs.detach())}
    out.update({"d" + n: ("seq" if n == "initial_state" else "rows", gv) for n, gv in gs.items() if n in ts})
    out.update({"d" + n: ("param", gs[n]) for n in extra})
    return to_cpu(out)


@functools.lru_cache(maxsize=None)
def clean_chunk(backend, layout_name, gated=False):
    return run_chunk(backend, layout_name, gdr_inputs_for(layout_name)[0], gated)


def check_chunk(backend, case, gated=False):
    """case: (layout, tensor name(s) joined by '+', target name or tuple of target names)."""
    lay, tensors, tgt = case
    hits = (tgt,) if isinstance(tgt, str) else tgt
    ins = dict(gdr_inputs_for(lay)[0], do=gdr_inputs_for(lay)[1])
    for t in tensors.split("+"):
        seq = t == "initial_state"
        ins[t] = poison(ins[t], [h for h in hits if h != "padding" or not seq], lay, per_sequence=seq)
    assert_isolated(clean_chunk(backend, lay, gated), run_chunk(backend, lay, ins, gated), lay, hits)


@pytest.mark.parametrize("case", cases(GDR_ROW_TENSORS + ("do",), ("initial_state",), layouts=LAYOUTS),
                         ids=case_id)
def test_chunk_torch(case):
    """Also the upstream gradient do (poison in one document's rows reaches no other document's
    gradients) and documents across chunks."""
    check_chunk("torch", case)


@pytest.mark.skipif(bool(TRITON_REASON), reason=TRITON_REASON)
@pytest.mark.parametrize("case", [("padded", "q+k+v", ALL_TARGETS), ("padded", "g+beta+initial_state", ALL_TARGETS)],
                         ids=case_id)
def test_chunk_triton(case):
    check_chunk("triton", case)


@pytest.mark.parametrize("case", cases(("g", "beta"), layouts=("padded",)), ids=case_id)
def test_chunk_gated_torch(case):
    """Raw gate inputs a, b (A_log, dt_bias given): da, db exactly 0 on padding, dA_log and ddt_bias
    unchanged by padding."""
    check_chunk("torch", case, gated=True)


@pytest.mark.skipif(bool(TRITON_REASON), reason=TRITON_REASON)
def test_chunk_gated_triton():
    check_chunk("triton", ("padded", "g+beta", ALL_TARGETS), gated=True)


# ---- hard resets: g = -inf, very negative g ------------------------------------------------------------
def budgets(backend):
    """fp32 budgets of docs/DESIGN.md section 7: 1e-5 on CPU; tf32 dots on a GPU."""
    if DEVICE[backend] == "cpu":
        return dict(o=1e-5, grad=1e-5, dg=1e-5)
    return dict(o=2e-3, grad=3e-3, dg=5e-3)


# layout -> case -> {row: g value}; -3e38 is finite, but a cumulative sum of two overflows. In
# across-chunks-gaps the documents hold rows [0, 40), [43, 113), 113 and [116, 182); rows 106 | 107 and
# 179 | 180 are 64-row chunk boundaries, 32-row ones (the torch backend's CPU chunks) every 32 rows.
RESETS = {
    "padded": {"g=-inf@1row": {25: float("-inf")},
               "g=-1e30@4rows+-3e38@2rows": {2: -1e30, 3: -1e30, 4: -1e30, 40: -1e30, 41: -3e38, 42: -3e38}},
    "across-chunks-gaps": {
        "g=-inf@3rows": {3: float("-inf"), 100: float("-inf"), 113: float("-inf")},   # mid chunk, one token
        "g=-1e30@9rows": {r: -1e30 for r in (0, 5, 6, 106, 107, 113, 116, 179, 181)},  # starts, boundaries
        "g=-3e38@2pairs": {10: -3e38, 11: -3e38, 106: -3e38, 107: -3e38}},          # one across a boundary
}
# (backend, layout, case); the Triton interpreter runs the short layout only
RESET_CASES = [pytest.param(b, lay, name, id=f"{b}-{lay}-{name}", marks=TRITON.marks if b == "triton" else ())
               for lay in RESETS for name in RESETS[lay]
               for b in (("torch", "triton") if lay == "padded" else ("torch",))]


@functools.lru_cache(maxsize=None)
def reset_case(lay, name):
    ins = dict(gdr_inputs_for(lay)[0])
    g = ins["g"].clone()
    for row, value in RESETS[lay][name].items():
        g[0, row] = value
    ins["g"] = g
    return ins


@functools.lru_cache(maxsize=None)
def reset_results(backend, lay, name):
    cu, pad, _, _ = geometry(lay)
    ins = reset_case(lay, name)
    _, do, dht = gdr_inputs_for(lay)
    ours = run_chunk(backend, lay, ins)
    ref = {n: t.detach().double().requires_grad_() for n, t in ins.items()}
    o, fs = reference_gdr(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], initial_state=ref["initial_state"],
                          cu_seqlens=cu, cu_seqlens_padded=pad, use_qk_l2norm_in_kernel=True)
    rg = grads((o * do.double()).sum() + (fs * dht.double()).sum(), ref)
    return ours, dict(o=o.detach(), final_state=fs.detach(), **{"d" + n: t for n, t in rg.items()})


@pytest.mark.parametrize("backend, lay, name", RESET_CASES)
def test_hard_reset_matches_recurrence_and_float64(backend, lay, name):
    cu, pad, _, _ = geometry(lay)
    ours, ref = reset_results(backend, lay, name)
    ins = reset_case(lay, name)
    rec_o, rec_fs = gdn_packed.fused_recurrent_gated_delta_rule(
        *(ins[n] for n in GDR_ROW_TENSORS), initial_state=ins["initial_state"], output_final_state=True,
        cu_seqlens=cu, cu_seqlens_padded=pad, use_qk_l2norm_in_kernel=True, backend="torch")
    budget = budgets(backend)["o"]
    for name_, got in (("o", ours["o"][1]), ("final_state", ours["final_state"][1])):
        assert rel_err(got, ref[name_]) <= budget, (name_, rel_err(got, ref[name_]))
    assert rel_err(rec_o, ref["o"]) <= 1e-5 and rel_err(rec_fs, ref["final_state"]) <= 1e-5
    assert rel_err(ours["o"][1], rec_o) <= budget and rel_err(ours["final_state"][1], rec_fs) <= budget


@pytest.mark.parametrize("backend, lay, name", RESET_CASES)
def test_hard_reset_gradients_match_float64(backend, lay, name):
    ours, ref = reset_results(backend, lay, name)
    for n in ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"):
        budget = budgets(backend)["dg" if n in ("dg", "dbeta") else "grad"]
        assert rel_err(ours[n][1], ref[n]) <= budget, (n, rel_err(ours[n][1], ref[n]))


# ---- float64 -------------------------------------------------------------------------------------------
@pytest.mark.skipif(bool(TRITON_REASON), reason=TRITON_REASON)
def test_triton_refuses_float64():
    ins = {n: t.double() for n, t in gdr_inputs_for("packed")[0].items()}
    with pytest.raises(TypeError, match="float64"):
        gdn_packed.chunk_gated_delta_rule(*(ins[n] for n in GDR_ROW_TENSORS), backend="triton")
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        gdn_packed.gated_rmsnorm(x, x, torch.ones(8, dtype=torch.float64), backend="triton")
    o, _ = gdn_packed.chunk_gated_delta_rule(*(ins[n] for n in GDR_ROW_TENSORS), backend="auto")
    assert o.dtype == torch.float64     # "auto" runs float64 on the torch backend, in float64


# ---- the recurrent op ---------------------------------------------------------------------------------
def run_recurrent(backend, layout_name, ins):
    cu, pad = on(backend, *geometry(layout_name)[:2])
    ins = {n: on(backend, t) for n, t in ins.items()}
    args = [ins[n] for n in GDR_ROW_TENSORS]
    if backend == "host":
        o = torch.full(ins["v"].shape, float("nan"))
        fs = torch.full(ins["initial_state"].shape, float("nan"))
        rows = lambda x: x[0]  # noqa: E731
        gdn_cuda.recurrent_fwd_cuda(*map(rows, args), cu, pad, ins["initial_state"], None, 16 ** -0.5, True,
                                    o[0], fs, host=True)
    else:
        with poisoned_outputs():
            o, fs = gdn_packed.fused_recurrent_gated_delta_rule(
                *args, initial_state=ins["initial_state"], output_final_state=True, cu_seqlens=cu,
                cu_seqlens_padded=pad, use_qk_l2norm_in_kernel=True, backend=backend)
    return to_cpu({"o": ("rows", o), "final_state": ("seq", fs)})


@pytest.mark.parametrize("backend", ["torch", REC_HOST, CUDA])
@pytest.mark.parametrize("case", cases(GDR_ROW_TENSORS, ("initial_state",), layouts=("padded",)), ids=case_id)
def test_recurrent(backend, case):
    check_op(run_recurrent, lambda lay: gdr_inputs_for(lay)[0], backend, case)


@pytest.mark.parametrize("backend", ["torch", REC_HOST, CUDA])
def test_recurrent_repeated_state_indices(backend):
    """Sequences 0, 2 and 4 share pool slot 2: each starts from the slot's state before the call and
    the last of them (sequence 4) writes it back; the other slots behave as usual."""
    cu, _, rows = layout([3, 1, 4, 2, 2])
    q, k, v, g, beta, _ = gdr_inputs(rows, 1, 2, 16, 8, N=5)
    pool0 = torch.randn(4, 2, 16, 8, generator=torch.Generator().manual_seed(1))
    idx = torch.tensor([2, 0, 2, -1, 2])
    pool = pool0.clone()
    if backend == "host":
        o = torch.full(v.shape, float("nan"))
        gdn_cuda.recurrent_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], cu, None, pool, idx, 16 ** -0.5, False, o[0],
                                    pool, host=True)
    else:
        dev_pool = on(backend, pool)
        with poisoned_outputs():
            o, _ = gdn_packed.fused_recurrent_gated_delta_rule(
                *on(backend, q, k, v, g, beta), initial_state=dev_pool, state_indices=on(backend, idx),
                cu_seqlens=on(backend, cu), backend=backend)
        o, pool = o.cpu(), dev_pool.cpu()
    h0 = torch.stack([pool0[i] if i >= 0 else torch.zeros_like(pool0[0]) for i in idx.tolist()])
    ro, rfs = reference_gdr(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert rel_err(o, ro) <= 1e-5
    want = pool0.double().clone()
    want[0], want[2] = rfs[1], rfs[4]
    assert rel_err(pool, want) <= 1e-5
    assert torch.equal(pool[[1, 3]], pool0[[1, 3]])
    if backend == "torch":
        with pytest.raises(ValueError, match="repeat"):
            gdn_packed.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool0.clone(),
                                                        state_indices=idx, cu_seqlens=cu, validate=True)


# ---- the conv ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def conv_inputs(layout_name):
    _, _, rows, _ = geometry(layout_name)
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    N = len(LENS)
    return dict(x=r(1, rows, 12), initial_state=r(N, 12, 3)), r(12, 4), r(12), r(1, rows, 12), r(N, 12, 3)


def run_conv(backend, layout_name, ins):
    cu, pad = on(backend, *geometry(layout_name)[:2])
    w, b, dy, df = on(backend, *conv_inputs(layout_name)[1:])
    x, h0 = on(backend, ins["x"], ins["initial_state"])
    if backend == "host":
        nan = lambda *s: torch.full(s, float("nan"))  # noqa: E731
        y, fs, dx, dw, db, dh0 = nan(*x.shape), nan(*h0.shape), nan(*x.shape), nan(*w.shape), nan(12), nan(*h0.shape)
        gdn_cuda.conv1d_fwd_cuda(x[0], w, b, h0, cu, pad, True, y[0], fs, host=True)
        gdn_cuda.conv1d_bwd_cuda(x[0], w, b, h0, cu, pad, True, dy[0], df, dx[0], dw, db, dh0, host=True)
    else:
        ts = {n: t.clone().requires_grad_() for n, t in dict(x=x, w=w, b=b, h0=h0).items()}
        with poisoned_outputs():
            y, fs = gdn_packed.causal_conv1d_varlen(ts["x"], ts["w"], ts["b"], "silu", cu, cu_seqlens_padded=pad,
                                                    initial_state=ts["h0"], output_final_state=True,
                                                    backend=backend)
            gs = grads((y * dy).sum() + (fs * df).sum(), ts)
        y, fs, dx, dw, db, dh0 = y.detach(), fs.detach(), gs["x"], gs["w"], gs["b"], gs["h0"]
    return to_cpu(dict(y=("rows", y), final_state=("seq", fs), dx=("rows", dx), dinitial_state=("seq", dh0),
                       dweight=("param", dw), dbias=("param", db)))


@pytest.mark.parametrize("backend", ["torch", CONV_HOST, CUDA])
@pytest.mark.parametrize("case", cases(("x",), ("initial_state",)), ids=case_id)
def test_conv(backend, case):
    check_op(run_conv, lambda lay: conv_inputs(lay)[0], backend, case)


# ---- the gated RMSNorm ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def norm_inputs(layout_name):
    gen = torch.Generator().manual_seed(9)
    return {n: torch.randn(1, len(geometry(layout_name)[3]), 2, 16, generator=gen) for n in ("x", "z")}


def run_norm(backend, layout_name, ins):
    cu, pad, rows, _ = geometry(layout_name)
    cu, pad = on(backend, cu, pad)
    gen = torch.Generator().manual_seed(8)
    w, dy = on(backend, torch.rand(16, generator=gen) + 0.5, torch.randn(1, rows, 2, 16, generator=gen))
    ts = {n: on(backend, t).clone().requires_grad_() for n, t in dict(x=ins["x"], z=ins["z"], w=w).items()}
    with poisoned_outputs():
        y = gdn_packed.gated_rmsnorm(ts["x"], ts["z"], ts["w"], backend=backend, cu_seqlens=cu,
                                     cu_seqlens_padded=pad)
        gs = grads((y * dy).sum(), ts)
    return to_cpu(dict(y=("rows", y), dx=("rows", gs["x"]), dz=("rows", gs["z"]), dweight=("param", gs["w"])))


@pytest.mark.parametrize("backend", ["torch", TRITON])
@pytest.mark.parametrize("case", cases(("x", "z")), ids=case_id)
def test_gated_rmsnorm(backend, case):
    check_op(run_norm, norm_inputs, backend, case)


# ---- the layers ----------------------------------------------------------------------------------------
HIDDEN = 32


def run_module(module, layout_name, x, **kw):
    """Forward + backward of a packed module; outputs, final states, input and parameter gradients."""
    cu, pad, rows, _ = geometry(layout_name)
    dy = torch.randn(1, rows, HIDDEN, generator=torch.Generator().manual_seed(10))
    x = x.detach().clone().requires_grad_()
    init = {n: t.detach().clone().requires_grad_() for n, t in kw.items()}
    with poisoned_outputs():
        if isinstance(module, GatedDeltaNet):
            y, st = module(x, cu, cu_seqlens_padded=pad, output_final_state=True,
                           initial_state=GDNState(init["conv"], init["recurrent"]))
            loss = (y * dy).sum() + st.conv.square().sum() + st.recurrent.sum()
            states = {"conv_state": ("seq", st.conv.detach()), "recurrent_state": ("seq", st.recurrent.detach())}
        else:
            y, states = module(x, cu, cu_seqlens_padded=pad), {}
            loss = (y * dy).sum()
        params = dict(module.named_parameters())
        gs = grads(loss, {"x": x, **init, **params})
    out = {"y": ("rows", y.detach()), "dx": ("rows", gs["x"]), **states}
    out.update({"d" + n: ("seq", gs[n]) for n in init})
    out.update({"d" + n: ("param", gs[n]) for n in params})
    return out


def gdn_module():
    torch.manual_seed(0)
    return GatedDeltaNet(HIDDEN, 1, 2, 16, 16, conv_kernel=4, backend="torch")


def attention_module():
    torch.manual_seed(0)
    return GatedAttention(HIDDEN, 4, 2, 8)


def stack_module():
    torch.manual_seed(0)
    return HybridStack(HybridConfig(vocab_size=31, hidden_size=HIDDEN, intermediate_size=48, pattern="GA",
                                    num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, num_heads=4,
                                    num_kv_heads=2, head_dim=8))


def layer_inputs(layout_name):
    rows = len(geometry(layout_name)[3])
    gen = torch.Generator().manual_seed(11)
    return dict(x=torch.randn(1, rows, HIDDEN, generator=gen),
                conv=torch.randn(len(LENS), 16 * 2 + 32, 3, generator=gen),
                recurrent=torch.randn(len(LENS), 2, 16, 16, generator=gen) * 0.1)


MODULES = {"gdn": (gdn_module, ("conv", "recurrent")), "attention": (attention_module, ()),
           "stack": (stack_module, ())}


def module_inputs(kind, layout_name):
    return {n: t for n, t in layer_inputs(layout_name).items() if n == "x" or n in MODULES[kind][1]}


@functools.lru_cache(maxsize=None)
def clean_module(kind, layout_name):
    return run_module(MODULES[kind][0](), layout_name, **module_inputs(kind, layout_name))


def check_module(kind, case):
    lay, tensor, tgt = case
    ins = module_inputs(kind, lay)
    ins[tensor] = poison(ins[tensor], (tgt,), lay, per_sequence=tensor != "x")
    assert_isolated(clean_module(kind, lay), run_module(MODULES[kind][0](), lay, **ins), lay, (tgt,))


@pytest.mark.parametrize("case", cases(("x",), ("conv", "recurrent")), ids=case_id)
def test_gated_deltanet(case):
    """Also: NaN/Inf padding input gives exactly 0 padding output and 0 padding gradient."""
    check_module("gdn", case)


@pytest.mark.parametrize("case", cases(("x",)), ids=case_id)
def test_gated_attention(case):
    check_module("attention", case)


@pytest.mark.parametrize("case", cases(("x",)), ids=case_id)
def test_hybrid_stack(case):
    check_module("stack", case)


@functools.lru_cache(maxsize=None)
def hybrid_lm():
    """HybridLM whose token 30 has a NaN/+Inf/-Inf embedding row, token ids (never 30) and dlogits."""
    torch.manual_seed(0)
    lm = HybridLM(HybridConfig(vocab_size=31, hidden_size=HIDDEN, intermediate_size=48, pattern="GA",
                               num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, num_heads=4,
                               num_kv_heads=2, head_dim=8))
    with torch.no_grad():
        lm.embed.weight[30] = bad_values([HIDDEN], lm.embed.weight.dtype)
    gen = torch.Generator().manual_seed(12)
    rows = len(geometry("padded")[3])
    return lm, torch.randint(0, 30, (1, rows), generator=gen), torch.randn(1, rows, 31, generator=gen)


def run_lm(backend, layout_name, ins):
    cu, pad, _, _ = geometry(layout_name)
    lm, _, dlogits = hybrid_lm()
    with poisoned_outputs():
        logits = lm(ins["ids"], cu, cu_seqlens_padded=pad)
        gs = grads((logits * dlogits).sum(), dict(lm.named_parameters()))
    return {"logits": ("rows", logits.detach()), **{"d" + n: ("param", g) for n, g in gs.items()}}


@pytest.mark.parametrize("target", ["last", "padding"])
def test_hybrid_lm_poisoned_embedding(target):
    """HybridLM from token ids: the token with the NaN/Inf embedding row, used only in one document or
    only on padding rows, changes no other document's logits and, on padding, no parameter gradient."""
    owner = geometry("padded")[3]
    _, ids, _ = hybrid_lm()
    key = (run_lm.__name__, "torch", "padded")
    if key not in _CLEAN:
        _CLEAN[key] = run_lm("torch", "padded", {"ids": ids})
    hit = owner == (docs("padded")[target] if target != "padding" else -1)
    assert_isolated(_CLEAN[key], run_lm("torch", "padded", {"ids": torch.where(hit[None], 30, ids)}), "padded",
                    (target,))
