"""gdn_packed.causal_conv1d_varlen: forward, final state and gradients against F.conv1d run per
sequence, unpacked, in float64, on every backend that runs here (tests/cuda_backends.py: torch, the
host mirror of the csrc/ kernels, the CUDA kernels on a GPU), over the shared packings. Plus sequence
isolation, determinism, the custom ops (opcheck, torch.compile) and input errors."""
import pytest
import torch

import gdn_packed
from gdn_packed import cuda as gdn_cuda
from gdn_packed.ops import conv1d as conv_op
from gdn_packed.ops._common import poisoned_outputs
from gdn_packed.segments import segments_or_rows
from gdn_packed.testing import PACKINGS, layout, no_host_sync, real_rows, rel_err
from gdn_packed.torch_ref.conv1d import causal_conv1d_ref

from cuda_backends import backends

BACKENDS = backends()
# the op's own dimensions, crossed with every packing: (W, D, bias, initial_state, activation);
# D = 13 is not a multiple of any vector width
DIMS = [(2, 16, False, True, "silu"), (3, 13, True, False, "silu"), (4, 8, True, True, None)]


def dims_id(d):
    W, D, bias, h0, act = d
    return f"W{W}-D{D}" + ("-bias" if bias else "") + ("-h0" if h0 else "") + (f"-{act}" if act else "")


def conv(backend, x, w, b, act, cu, pad, h0, dy, df):
    """(y, final, dx, dw, db, dh0) of one backend; the float64 reference when backend='ref'."""
    if backend == "ref":
        xs = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b, h0)]
        y, f = causal_conv1d_ref(xs[0], xs[1], xs[2], act, cu, pad, xs[3])
        loss = (y * dy.double()).sum() + (f * df.double()).sum()
        grads = torch.autograd.grad(loss, [t for t in xs if t is not None], materialize_grads=True)
        it = iter(grads)
        return (y, f) + tuple(next(it) if t is not None else None for t in xs)
    if backend == "host":   # the csrc/ per-thread bodies run over the whole grid on the CPU
        return conv_host(x, w, b, act, cu, pad, h0, dy, df)
    dev = "cuda" if backend == "cuda" else "cpu"
    to = lambda t: None if t is None else t.detach().to(dev).requires_grad_()  # noqa: E731
    xs = [to(t) for t in (x, w, b, h0)]
    with poisoned_outputs():
        y, f = gdn_packed.causal_conv1d_varlen(xs[0], xs[1], xs[2], act, cu if cu is None else cu.to(dev),
                                               cu_seqlens_padded=None if pad is None else pad.to(dev),
                                               initial_state=xs[3], output_final_state=True, backend=backend)
        loss = (y.float() * dy.to(dev)).sum() + (f.float() * df.to(dev)).sum()
        grads = torch.autograd.grad(loss, [t for t in xs if t is not None], materialize_grads=True)
    it = iter(grads)
    return tuple(t.cpu() for t in (y, f)) + tuple(next(it).cpu() if t is not None else None for t in xs)


def conv_host(x, w, b, act, cu, pad, h0, dy, df):
    B, L, D = x.shape
    W, N = w.shape[1], (B if cu is None else cu.numel() - 1)
    full = lambda *s, dt=x.dtype: torch.full(s, float("nan"), dtype=dt)  # noqa: E731
    rows = lambda t: t.reshape(B * L, D)  # noqa: E731
    cus = segments_or_rows(x, cu)[0]
    y, f = full(B, L, D), full(N, D, W - 1)
    gdn_cuda.conv1d_fwd_cuda(rows(x), w, b, h0, cus, pad, act is not None, rows(y), f, host=True)
    dx, dw, db, dh0 = full(B, L, D), full(D, W, dt=w.dtype), full(D, dt=w.dtype), full(N, D, W - 1)
    gdn_cuda.conv1d_bwd_cuda(rows(x), w, b, h0, cus, pad, act is not None, rows(dy.to(x.dtype)), df.to(x.dtype),
                             rows(dx), dw, db, dh0, host=True)
    return y, f, dx, dw, (db if b is not None else None), (dh0 if h0 is not None else None)


def make(rows, D, W, dtype=torch.float32, N=1, batch=1, bias=True, h0=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = r(batch, rows, D).to(dtype)
    w = (r(D, W) / W ** 0.5)
    b = r(D) if bias else None
    s0 = r(N, D, W - 1).to(dtype) if h0 else None
    dy = r(batch, rows, D)
    df = r(N, D, W - 1)
    return x, w, b, s0, dy, df


NAMES = ("y", "final_state", "dx", "dweight", "dbias", "dinitial_state")


def check_against_reference(backend, x, w, b, act, cu, pad, s0, dy, df, budget=1e-5):
    """Every output and gradient of `backend` within `budget` (relative error) of the float64
    reference, None exactly where the reference has None; returns the backend's values."""
    got = conv(backend, x, w, b, act, cu, pad, s0, dy, df)
    ref = conv("ref", x, w, b, act, cu, pad, s0, dy, df)
    for name, a, r in zip(NAMES, got, ref):
        assert (a is None) == (r is None), name
        if a is not None:
            assert rel_err(a, r) <= budget, f"{name}: {rel_err(a, r):.3g}"
    return got


def test_packings_include_padding():
    """The padding assertions below are not vacuous: some shared packings have padding rows."""
    assert any(p.has_padding for p in PACKINGS) and any(not p.has_padding for p in PACKINGS)


@pytest.mark.parametrize("dims", DIMS, ids=dims_id)
@pytest.mark.parametrize("packing", PACKINGS, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_per_sequence_conv1d(backend, packing, dims):
    W, D, bias, with_h0, act = dims
    cu, pad, rows = packing.layout()
    x, w, b, s0, dy, df = make(rows, D, W, N=len(packing.lengths), h0=with_h0, bias=bias, seed=W)
    got = check_against_reference(backend, x, w, b, act, cu, pad, s0, dy, df)
    pad_rows = ~real_rows(cu, pad, rows)
    assert bool(pad_rows.any()) == packing.has_padding
    if packing.has_padding:   # y and dx exactly 0 on every padding row
        assert torch.equal(got[0][0, pad_rows], torch.zeros_like(got[0][0, pad_rows]))
        assert torch.equal(got[2][0, pad_rows], torch.zeros_like(got[2][0, pad_rows]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W", [1, 5, 8])
def test_other_widths_on_a_noncontiguous_view(backend, W):
    cu, pad, rows = layout([0, 9, 1, 20], gaps=[1, 0, 2, 0], tail=2)
    x, w, b, s0, dy, df = make(rows, 8, W, N=4, seed=W)
    x = torch.cat([x, x.flip(-1)], -1)[..., 8:]
    assert not x.is_contiguous()
    check_against_reference(backend, x, w, b, "silu", cu, pad, s0, dy, df)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision(backend, dtype):
    cu, pad, rows = layout([37, 0, 5, 70], gaps=[2, 1, 0, 0], tail=3)
    x, w, b, s0, dy, df = make(rows, 24, 4, dtype, N=4)
    check_against_reference(backend, x, w, b, "silu", cu, pad, s0, dy, df, budget=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_without_cu_seqlens(backend):
    x, w, b, s0, dy, df = make(33, 12, 4, batch=3, N=3)
    check_against_reference(backend, x, w, b, "silu", None, None, s0, dy, df)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequences_never_mix(backend):
    """Huge values in sequence 1 leave sequences 0 and 2 (outputs and gradients) bit-unchanged."""
    cu, pad, rows = layout([9, 6, 9], gaps=[0, 2, 0], tail=1)
    x, w, b, s0, dy, df = make(rows, 10, 4, N=3)
    base = conv(backend, x, w, b, "silu", cu, pad, s0, dy, df)
    x2, s2, dy2, df2 = x.clone(), s0.clone(), dy.clone(), df.clone()
    x2[0, 9:15], s2[1], dy2[0, 9:17], df2[1] = 1e30, -1e30, 1e30, 1e30
    hot = conv(backend, x2, w, b, "silu", cu, pad, s2, dy2, df2)
    others = torch.ones(rows, dtype=torch.bool)
    others[9:17] = False
    for i in (0, 2):   # outputs, dx (row-indexed) and per-sequence states of the other sequences
        assert torch.equal(base[1][i], hot[1][i]) and torch.equal(base[5][i], hot[5][i])
    assert torch.equal(base[0][0, others], hot[0][0, others])
    assert torch.equal(base[2][0, others], hot[2][0, others])


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_and_bias_grads_are_deterministic(backend):
    cu, pad, rows = layout([300, 1, 127, 0, 64], gaps=None, tail=0)
    x, w, b, s0, dy, df = make(rows, 40, 4, N=5)
    runs = [conv(backend, x, w, b, "silu", cu, pad, s0, dy, df) for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(r[3], runs[0][3]) and torch.equal(r[4], runs[0][4])


def test_final_state_feeds_the_next_call():
    """Splitting sequences in two and carrying the conv state reproduces the unsplit conv."""
    cu, _, rows = layout([50, 2, 40])
    x, w, b, _, _, _ = make(rows, 12, 4, N=3)
    y, _ = gdn_packed.causal_conv1d_varlen(x, w, b, cu_seqlens=cu)
    cut = torch.tensor([20, 1, 15])
    lens = torch.tensor([50, 2, 40])
    xa = torch.cat([x[:, s:s + n] for s, n in zip([0, 50, 52], cut.tolist())], 1)
    xb = torch.cat([x[:, s + n:s + m] for s, n, m in zip([0, 50, 52], cut.tolist(), lens.tolist())], 1)
    cua = torch.cat([torch.zeros(1), cut.cumsum(0)]).int()
    cub = torch.cat([torch.zeros(1), (lens - cut).cumsum(0)]).int()
    ya, fa = gdn_packed.causal_conv1d_varlen(xa, w, b, cu_seqlens=cua, output_final_state=True)
    yb, _ = gdn_packed.causal_conv1d_varlen(xb, w, b, cu_seqlens=cub, initial_state=fa)
    for i, (s, n, m) in enumerate(zip([0, 50, 52], cut.tolist(), lens.tolist())):
        sa, sb = int(cua[i]), int(cub[i])
        assert torch.allclose(y[:, s:s + n], ya[:, sa:sa + n], atol=1e-6)
        assert torch.allclose(y[:, s + n:s + m], yb[:, sb:sb + m - n], atol=1e-6)


def test_megatron_weight_layout():
    cu, _, rows = layout([7, 9])
    x, w, b, _, _, _ = make(rows, 6, 4, N=2)
    y1, _ = gdn_packed.causal_conv1d_varlen(x, w, b, cu_seqlens=cu)
    y2, _ = gdn_packed.causal_conv1d_varlen(x, w[:, None, :], b, cu_seqlens=cu)
    assert torch.equal(y1, y2)


def _op_args():
    cu, pad, rows = layout([5, 0, 11, 1], gaps=[1, 0, 2, 0], tail=2)
    x, w, b, s0, dy, df = make(rows, 6, 4, N=4)
    return x, w, b, s0, cu, pad, dy, df


def test_opcheck_forward():
    x, w, b, s0, cu, pad, _, _ = _op_args()
    args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), s0.requires_grad_(), cu, pad, True, "torch")
    torch.library.opcheck(conv_op.conv1d_varlen_fwd, args)


def test_opcheck_backward():
    x, w, b, s0, cu, pad, dy, df = _op_args()
    torch.library.opcheck(conv_op.conv1d_varlen_bwd, (x, w, b, s0, cu, pad, True, "torch", dy, df))


def test_torch_compile_fullgraph_and_no_host_sync():
    x, w, b, s0, cu, pad, _, _ = _op_args()
    leaves = [t.clone().requires_grad_() for t in (x, w, b, s0)]

    def f(x, w, b, s0):
        y, fs = gdn_packed.causal_conv1d_varlen(x, w, b, cu_seqlens=cu, cu_seqlens_padded=pad,
                                                initial_state=s0, output_final_state=True)
        return y.square().sum() + fs.sum()

    eager = torch.autograd.grad(f(*leaves), leaves)
    torch._dynamo.reset()
    comp = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves), leaves)
    for a, c in zip(eager, comp):
        assert torch.equal(a, c)
    with no_host_sync():
        torch.autograd.grad(f(*leaves), leaves)


def _good():
    cu, _, rows = layout([3, 7])
    x, w, b, s0, _, _ = make(rows, 6, 4, N=2)
    return dict(x=x, weight=w, bias=b, initial_state=s0, cu_seqlens=cu)


BAD = {
    "int-x": (dict(x=torch.zeros(1, 10, 6, dtype=torch.int32)), TypeError, "x must"),
    "2d-x": (dict(x=torch.zeros(10, 6)), ValueError, "x must"),
    "W-9": (dict(weight=torch.zeros(6, 9), initial_state=torch.zeros(2, 6, 8)), ValueError, "W = .*9"),
    "weight-D": (dict(weight=torch.zeros(5, 4)), ValueError, "weight"),
    "bias-shape": (dict(bias=torch.zeros(5)), ValueError, "bias"),
    "h0-shape": (dict(initial_state=torch.zeros(3, 6, 3)), ValueError, "initial_state"),
    "h0-dtype": (dict(initial_state=torch.zeros(2, 6, 3, dtype=torch.bfloat16)), TypeError, "initial_state"),
    "float-cu": (dict(cu_seqlens=torch.tensor([0.0, 3.0, 10.0])), TypeError, "cu_seqlens"),
    "activation": (dict(activation="relu"), ValueError, "activation"),
    "backend": (dict(backend="fast"), ValueError, "backend"),
    "meta-weight": (dict(weight=torch.zeros(6, 4, device="meta")), ValueError, "weight"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_argument(name):
    change, exc, match = BAD[name]
    with pytest.raises(exc, match=match):
        gdn_packed.causal_conv1d_varlen(**{**_good(), **change})


def test_cuda_backend_on_cpu_tensors_is_refused():
    with pytest.raises((ValueError, RuntimeError), match="cuda"):
        gdn_packed.causal_conv1d_varlen(**_good(), backend="cuda")


@pytest.mark.parametrize("rows, cu", [(0, [0]), (5, [0]), (5, [0, 0, 0]), (0, [0, 0])],
                         ids=["T0-N0", "T5-N0", "T5-N2-empty", "T0-N1-empty"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_degenerate_packings(backend, rows, cu):
    """No sequence, or only empty ones: y and dx are all padding (0), the final state is the initial
    state and its gradient passes through; dweight is 0."""
    c = torch.tensor(cu, dtype=torch.int32)
    x, w, _, h0, dy, df = make(rows, 12, 4, N=len(cu) - 1, bias=False)
    y, st, dx, dw, _, dh0 = conv(backend, x, w, None, "silu", c, None, h0, dy, df)
    assert (y == 0).all() and (dx == 0).all() and (dw == 0).all()
    assert torch.equal(st, h0) and torch.equal(dh0, df)
