"""The chunked gated delta rule as a custom op, on every backend that can run on CPU tensors here
(gdn_packed.testing.backend_params): opcheck, torch.compile, no host sync, corrupt cu_seqlens; bad
input (checked before any backend is chosen)."""

import pytest
import torch

import gdn_packed
from gdn_packed._runtime import device_schedule
from gdn_packed.ops.chunk_gdr import chunk_gdr_bwd, chunk_gdr_fwd
from gdn_packed.testing import backend_params, gdr_inputs, layout, no_host_sync, poisoned_outputs, rel_err

# short sequences (one chunk each: the op-level checks here do not depend on chunking, and opcheck runs
# the op many times, which the Triton interpreter makes slow), an empty one, gaps and a padding tail
LENS, GAPS, TAIL = [5, 0, 9, 1], [2, 1, 0, 3], 4
BACKENDS = backend_params("chunk_gated_delta_rule", "cpu")


def packed_inputs(requires_grad=False, h0=True):
    cu, cu_pad, rows = layout(LENS, gaps=GAPS, tail=TAIL)
    q, k, v, g, beta, s0 = gdr_inputs(rows, 1, 2, 16, 8, N=len(LENS), initial_state=h0)
    xs = [q, k, v, g, beta, s0]
    if requires_grad:
        xs = [None if x is None else x.requires_grad_() for x in xs]
    return xs, cu, cu_pad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_opcheck_forward(h0, backend):
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs(requires_grad=True, h0=h0)
    torch.library.opcheck(chunk_gdr_fwd, (q, k, v, g, beta, s0, cu, cu_pad, 0.25, True, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_backward(backend):
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs()
    do, dht = torch.randn_like(v), torch.randn_like(s0)
    torch.library.opcheck(chunk_gdr_bwd, (q, k, v, g, beta, s0, cu, cu_pad, do, dht, 0.25, False, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_segments_worked_out_once_per_call(backend, monkeypatch):
    """The public function builds the chunk table and the gating's token mask once, the forward saves
    them and the backward takes them (no rebuild: one make_chunk_table and one real_rows call for
    forward + backward); both ops pass opcheck with them given, and give what they build themselves."""
    from gdn_packed import segments
    from gdn_packed.ops import chunk_gdr, chunk_table
    (q, k, v, a, b, s0), cu, cu_pad = packed_inputs(requires_grad=True)
    A_log, dt_bias = torch.zeros(2, requires_grad=True), torch.ones(2, requires_grad=True)
    calls = {"table": 0, "real": 0}

    def counted(name, fn):
        def f(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return f
    monkeypatch.setattr(chunk_table, "make_chunk_table", counted("table", chunk_table.make_chunk_table))
    monkeypatch.setattr(chunk_gdr, "make_chunk_table", counted("table", chunk_gdr.make_chunk_table))
    monkeypatch.setattr(segments, "real_rows", counted("real", segments.real_rows))
    o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, a, b, initial_state=s0, output_final_state=True,
                                              cu_seqlens=cu, cu_seqlens_padded=cu_pad, A_log=A_log,
                                              dt_bias=dt_bias, backend=backend)
    (o.sum() + fs.sum()).backward()
    assert calls == {"table": 1, "real": 1}, calls
    monkeypatch.undo()
    T = q.shape[1]
    table, cu_chunks = chunk_table.build_chunk_table(cu, cu_pad, T, 64)
    real = segments.real_rows(cu, cu_pad, T)
    args = (q, k, v, a, b, s0, cu, cu_pad, 0.25, True, backend, A_log, dt_bias)
    given = chunk_gdr_fwd(*args, True, table, cu_chunks, real)
    built = chunk_gdr_fwd(*args, True)
    assert all(torch.equal(x, y) for x, y in zip(given, built))
    torch.library.opcheck(chunk_gdr_fwd, args + (True, table, cu_chunks, real))
    do, dht = torch.randn_like(v), torch.randn_like(s0)
    bwd = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args[:8]) + (do, dht) + args[8:11] \
        + (A_log.detach(), dt_bias.detach(), given[2] if given[2].numel() else None)
    torch.library.opcheck(chunk_gdr_bwd, bwd + (table, cu_chunks, real))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_matches_eager(backend):
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs()

    def f(q, k, v, g, beta, s0, cu, cu_pad):
        o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                                                  use_qk_l2norm_in_kernel=True, backend=backend)
        return o * 2, fs

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    eo, efs = f(q, k, v, g, beta, s0, cu, cu_pad)
    co, cfs = compiled(q, k, v, g, beta, s0, cu, cu_pad)
    assert torch.equal(eo, co) and torch.equal(efs, cfs)
    explained = torch._dynamo.explain(f)(q, k, v, g, beta, s0, cu, cu_pad)
    assert explained.graph_break_count == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_make_no_host_sync(backend):
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs(requires_grad=True)
    with no_host_sync():
        o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad, backend=backend)
        (o.sum() + fs.sum()).backward()
    assert q.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_grads_match_backward_op_under_torch_compile(backend):
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs(requires_grad=True)

    def loss(q, k, v, g, beta, s0):
        o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad, backend=backend)
        return o.square().sum() + fs.sum()

    eager = torch.autograd.grad(loss(q, k, v, g, beta, s0), (q, k, v, g, beta, s0))
    torch._dynamo.reset()
    comp = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, s0),
                               (q, k, v, g, beta, s0))
    for a, b in zip(eager, comp):
        assert rel_err(b, a) <= 1e-6


def _good():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q, k, v, g, beta, h0 = gdr_inputs(10, 2, 4, 16, 8, N=2, initial_state=True)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


def _bad(**change):
    kw = _good()
    kw.update(change)
    return kw


BAD = {
    "float-cu_seqlens": (lambda: _bad(cu_seqlens=torch.tensor([0., 3., 10.])), TypeError, "cu_seqlens"),
    "2d-cu_seqlens": (lambda: _bad(cu_seqlens=torch.tensor([[0, 3, 10]], dtype=torch.int32)), ValueError,
                      "cu_seqlens"),
    "batch2-with-cu_seqlens": (lambda: {**_good(), **{n: x.expand(2, *x.shape[1:]) for n, x in _good().items()
                                                      if n in ("q", "k", "v", "g", "beta")}},
                               ValueError, "batch"),
    "HV-not-multiple-of-H": (lambda: _bad(q=torch.randn(1, 10, 3, 16), k=torch.randn(1, 10, 3, 16)), ValueError,
                             "v.shape\\[2\\]"),
    "K-too-large": (lambda: _bad(q=torch.randn(1, 10, 2, 512), k=torch.randn(1, 10, 2, 512)), ValueError, "K"),
    "V-too-large": (lambda: _bad(v=torch.randn(1, 10, 4, 320)), ValueError, "V"),
    "T-mismatch": (lambda: _bad(v=torch.randn(1, 11, 4, 8)), ValueError, "v must"),
    "g-wrong-shape": (lambda: _bad(g=torch.randn(1, 10, 2)), ValueError, "g must"),
    "beta-wrong-shape": (lambda: _bad(beta=torch.rand(1, 10, 4, 1)), ValueError, "beta must"),
    "h0-wrong-N": (lambda: _bad(initial_state=torch.zeros(3, 4, 16, 8)), ValueError, "initial_state"),
    "h0-wrong-dtype": (lambda: _bad(initial_state=torch.zeros(2, 4, 16, 8, dtype=torch.bfloat16)), TypeError,
                       "initial_state"),
    "padded-shorter": (lambda: _bad(cu_seqlens_padded=torch.tensor([0, 3], dtype=torch.int32)), ValueError,
                       "cu_seqlens_padded"),
    "int-q": (lambda: _bad(q=torch.zeros(1, 10, 2, 16, dtype=torch.int32)), TypeError, "q must"),
    "qkv-dtype-mix": (lambda: _bad(k=torch.randn(1, 10, 2, 16, dtype=torch.float16)), TypeError, "dtype"),
    "bad-backend": (lambda: _bad(backend="fast"), ValueError, "backend"),
    "nan-scale": (lambda: _bad(scale=float("nan")), ValueError, "scale must be finite"),
    "inf-scale": (lambda: _bad(scale=float("inf")), ValueError, "scale must be finite"),
    "bool-scale": (lambda: _bad(scale=True), TypeError, "scale must be a float"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_argument(name):
    make, exc, match = BAD[name]
    with pytest.raises(exc, match=match):
        gdn_packed.chunk_gated_delta_rule(**make())


@pytest.mark.parametrize("cu, pad, match", [
    ([0, 3, 10], [0, 2, 10], "slot"),            # sequence longer than its padded slot
    ([0, 3, 12], None, "10"),                    # last offset beyond T
    ([0, 5, 3], None, "cu_seqlens"),             # decreasing
    ([0, 3, 10], [0, 4, 14], "14|10"),           # padded tail beyond T
])
def test_value_errors_with_validate(cu, pad, match):
    kw = _good()
    kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    kw["cu_seqlens_padded"] = None if pad is None else torch.tensor(pad, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        gdn_packed.chunk_gated_delta_rule(**kw, validate=True)


def embedded(t, pad=64):
    """t copied into the middle of a larger buffer of NaN sentinels: (the view, the buffer)."""
    buf = torch.full((t.numel() + 2 * pad,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[pad:pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


def check_corrupt_cu_seqlens(cu, backend):
    """The op on corrupt cu_seqlens (validate off; on the device schedule, which CPU tensors otherwise
    leave for a ValueError: segments.check_values_where_free) with every input a view inside a
    NaN-filled buffer and outputs NaN-poisoned: no error, the sentinels around the inputs untouched, o and the final state
    finite (a read outside an input brings NaN in; a row nobody wrote stays NaN), the rows that
    no sequence covers exactly 0, and the same for the backward (finite gradients, sentinels intact)."""
    kw = _good()
    views = {}
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        kw[name], views[name] = embedded(kw[name])
        kw[name].requires_grad_()
    kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    with poisoned_outputs(), device_schedule():
        o, fs = gdn_packed.chunk_gated_delta_rule(**kw, output_final_state=True, backend=backend)
        (o.float().sum() + fs.sum()).backward()
    assert all(torch.isfinite(kw[name].grad).all() for name in views), "non-finite gradient"
    assert o.shape == kw["v"].shape and fs.shape == kw["initial_state"].shape
    for name, buf in views.items():
        pad = buf.numel() - kw[name].numel()
        assert buf[:pad // 2].isnan().all() and buf[-(pad // 2):].isnan().all(), f"sentinels around {name} changed"
    assert torch.isfinite(o).all() and torch.isfinite(fs).all()
    T = o.shape[1]
    covered = torch.zeros(T, dtype=torch.bool)
    for a, b in zip(cu[:-1], cu[1:]):
        covered[max(0, min(a, T)):max(0, min(b, T))] = True
    assert (o[0, ~covered] == 0).all(), "rows outside every sequence are not 0"


CORRUPT = [[0, 5, 3], [0, 3, 40], [0, -7, 10], [0, 3, -5], [5, 2, 2**30]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu", CORRUPT, ids=lambda c: ",".join(map(str, c)))
def test_corrupt_cu_seqlens_without_validate_stays_in_bounds(cu, backend):
    """[0, -7, 10] gives a zero-length chunk whose start row is -7: the triton padding zeroing once
    wrote before row 0 there (heap corruption under the interpreter, fixed in triton/common.py)."""
    check_corrupt_cu_seqlens(cu, backend)


def test_cuda_backend_on_cpu_tensors_is_clear():
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        gdn_packed.chunk_gated_delta_rule(**_good(), backend="cuda")
