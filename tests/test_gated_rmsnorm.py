"""Specification of the gated RMSNorm op, run on every backend it has (gdn_packed.ops.BACKENDS) that can
run here (torch; triton, on CPU under the Triton interpreter; a backend that cannot run is a visible
skip), from one case list: packed layouts x [1, T, H, N] from gdn_packed.testing.PACKINGS (with
cu_seqlens, NaN planted in the padding rows of x and z) and unpacked shapes. Checked: y and the
gradients of x, z and weight against a float64 autograd reference, exact zeros on padding rows with
NaN-poisoned outputs; opcheck, torch.compile, deterministic weight gradient, bad input."""
import pytest
import torch

from gdn_packed.ops.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_bwd, gated_rmsnorm_fwd
from gdn_packed.testing import DTYPE_ID, PACKING_BY_NAME, backend_params, case_id, poisoned_outputs, real_rows, rel_err
from gdn_packed.torch_ref.gated_rmsnorm import gated_rmsnorm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = backend_params("gated_rmsnorm", DEVICE)
# docs/DESIGN.md section 7: output budgets, and the gradient budgets (fp32 CPU 1e-5, fp32 GPU 3e-3, bf16 2.5e-2)
BUDGET = {torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3, torch.bfloat16: 2e-2}
GRAD_BUDGET = {torch.float32: 1e-5 if DEVICE == "cpu" else 3e-3, torch.bfloat16: 2.5e-2}

# (packing name or None, shape, zero_centered): packed x is [1, rows, H, N] with the packing's cu_seqlens
# (and cu_seqlens_padded); None: x has that shape and every row is normalised. The op is row-wise: the
# packings with padding rows (and one token), not the long ones, which only cost interpreter time.
CASES = [
    ("gaps-and-empties", (4, 32), False),
    ("around-chunk-gaps", (1, 64), True),
    ("one-token", (1, 24), False),
    ("only-padding", (2, 16), True),
    (None, (3, 5, 2, 64), False),
    (None, (1, 1, 1, 24), False),
    (None, (100, 128), False),
    (None, (100, 128), True),
]


def norm_case_id(c):
    name, shape, zc = c
    tail = "-zc" if zc else ""
    if name is None:
        return "x" + "x".join(map(str, shape)) + tail
    return case_id(PACKING_BY_NAME[name], f"H{shape[0]}", f"N{shape[1]}", flags=(("zc", zc),))


def inputs(shape, dtype, seed=0, requires_grad=True, zero_centered=False):
    """x, z and a weight around 1 (around 0 when zero-centred: the scale 1 + weight is then ~1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 3
    z = torch.randn(*shape, generator=gen) * 2
    w = (0.0 if zero_centered else 1.0) + 0.5 * torch.randn(shape[-1], generator=gen)
    return [t.to(DEVICE, dtype).requires_grad_(requires_grad) for t in (x, z, w)]


def case_inputs(case, dtype):
    """x, z, weight (x and z NaN on padding rows), the layout kwargs and real [rows] (None unpacked)."""
    name, shape, zc = case
    if name is None:
        return inputs(shape, dtype, zero_centered=zc), {}, None
    cu, cu_pad, rows = PACKING_BY_NAME[name].layout()
    x, z, w = inputs((1, rows) + shape, dtype, zero_centered=zc, requires_grad=False)
    real = real_rows(cu, cu_pad, rows).to(DEVICE)
    x, z = (torch.where(real[None, :, None, None], t, float("nan")).requires_grad_() for t in (x, z))
    kw = dict(cu_seqlens=cu.to(DEVICE), cu_seqlens_padded=None if cu_pad is None else cu_pad.to(DEVICE))
    return [x, z, w.requires_grad_()], kw, real


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("case", CASES, ids=norm_case_id)
def test_matches_float64_reference(case, dtype, backend):
    """y, dx, dz, dweight against float64 autograd of the reference on the real rows; on padding rows
    (which hold NaN) y, dx and dz are exactly 0 and nothing reaches dweight."""
    zc = case[2]
    (x, z, w), kw, real = case_inputs(case, dtype)
    with poisoned_outputs():
        y = gated_rmsnorm(x, z, w, eps=1e-6, backend=backend, zero_centered=zc, **kw)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
        gx, gz, gw = torch.autograd.grad(y, (x, z, w), dy)
    xd, zd, wd = (t.detach().cpu().double().requires_grad_() for t in (x, z, w))
    if real is None:
        yd = gated_rmsnorm_ref(xd, zd, wd, 1e-6, zero_centered=zc)
    else:
        r = real.cpu()[None, :, None, None]
        yd = torch.where(r, gated_rmsnorm_ref(*(torch.where(r, t, 0.0) for t in (xd, zd)), wd, 1e-6,
                                              zero_centered=zc), 0.0)
        pad = ~real
        assert pad.any() == PACKING_BY_NAME[case[0]].has_padding
        for name, t in (("y", y), ("dx", gx), ("dz", gz)):
            assert torch.isfinite(t).all(), f"{name} is not finite"
            if pad.any():
                assert (t[0, pad] == 0).all(), f"{name} is not exactly 0 on padding rows"
    rx, rz, rw = torch.autograd.grad(yd, (xd, zd, wd), dy.cpu().double())
    assert y.dtype == dtype and gx.dtype == dtype and gw.dtype == dtype
    assert rel_err(y.cpu(), yd) <= BUDGET[dtype]
    for name, got, ref in (("dx", gx, rx), ("dz", gz, rz), ("dweight", gw, rw)):
        assert rel_err(got.cpu(), ref) <= GRAD_BUDGET[dtype], name


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_centered_scale_is_formed_in_float32(backend):
    """A small bf16 zero-centred weight: 1 + weight rounded to bf16 would lose it (bf16 spacing at 1
    is 2^-7), the op keeps it. Its output equals the plain op given the fp32 scale 1 + weight."""
    x, z, _ = inputs((8, 64), torch.bfloat16, requires_grad=False)
    w = torch.full((64,), 2.0 ** -10, device=DEVICE, dtype=torch.bfloat16)
    y = gated_rmsnorm(x.float(), z.float(), w, backend=backend, zero_centered=True)
    want = gated_rmsnorm(x.float(), z.float(), 1 + w.float(), backend=backend)
    assert torch.equal(y, want)
    assert not torch.equal(y, gated_rmsnorm(x.float(), z.float(), (1 + w).float(), backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_give_zero_output_and_finite_grads(backend):
    x, z, w = inputs((6, 16), torch.float32)
    x = x.detach().clone()
    x[2:4] = 0
    x.requires_grad_()
    y = gated_rmsnorm(x, z, w, backend=backend)
    assert torch.equal(y[2:4], torch.zeros_like(y[2:4]))
    gz = torch.autograd.grad(y.sum(), z)[0]
    assert torch.equal(gz[2:4], torch.zeros_like(gz[2:4]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_gradient_is_deterministic(backend):
    x, z, w = inputs((300, 48), torch.float32)
    dy = torch.randn(300, 48, device=DEVICE)
    grads = [torch.autograd.grad(gated_rmsnorm(x, z, w, backend=backend), w, dy)[0] for _ in range(2)]
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
def test_opcheck(backend, zero_centered):
    x, z, w = inputs((2, 7, 3, 16), torch.float32)
    torch.library.opcheck(gated_rmsnorm_fwd, (x, z, w, 1e-6, zero_centered, backend))
    _, rstd = gated_rmsnorm_fwd(x.detach(), z.detach(), w.detach(), 1e-6, zero_centered, backend)
    dy = torch.randn_like(x)
    torch.library.opcheck(gated_rmsnorm_bwd,
                          (dy, x.detach(), z.detach(), w.detach(), rstd, zero_centered, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_with_the_token_mask(backend):
    """The ops take the packed layout as real [T], one bool per token (segments.real_rows, the mask the
    chunked op takes too), for x [1, T, heads, N]: opcheck, and padding tokens' rows 0 in y."""
    x, z, w = inputs((1, 7, 3, 16), torch.float32)
    real = torch.tensor([True, False, True, True, False, False, True], device=DEVICE)
    torch.library.opcheck(gated_rmsnorm_fwd, (x, z, w, 1e-6, False, backend, real))
    y, rstd = gated_rmsnorm_fwd(x.detach(), z.detach(), w.detach(), 1e-6, False, backend, real)
    assert (y[0, ~real] == 0).all() and (y[0, real] != 0).all()
    torch.library.opcheck(gated_rmsnorm_bwd,
                          (torch.randn_like(x), x.detach(), z.detach(), w.detach(), rstd, False, backend, real))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_matches_eager(backend):
    x, z, w = inputs((2, 9, 4, 32), torch.float32)

    def f(x, z, w):
        return gated_rmsnorm(x, z, w, eps=1e-5, backend=backend).square().sum()

    eager = torch.autograd.grad(f(x, z, w), (x, z, w))
    torch._dynamo.reset()
    comp = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(comp(x, z, w), (x, z, w))
    for a, b in zip(eager, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad, err, match", [
    (dict(z=torch.randn(2, 5)), ValueError, "z must have shape"),
    (dict(weight=torch.randn(3)), ValueError, "weight must have shape"),
    (dict(x=torch.randint(0, 3, (2, 4))), TypeError, "x must have dtype"),
    (dict(backend="cuda"), NotImplementedError, "backend='cuda'"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps must be finite"),
    (dict(eps=True), TypeError, "eps must be a float"),
    (dict(zero_centered=1), TypeError, "zero_centered must be a bool"),
])
def test_bad_input_raises_a_named_error(bad, err, match):
    args = dict(x=torch.randn(2, 4), z=torch.randn(2, 4), weight=torch.ones(4), eps=1e-6, backend="torch")
    args.update(bad)
    with pytest.raises(err, match=match):
        gated_rmsnorm(**args)


def test_cases_include_padding_rows():
    """The padding checks above are not vacuous: some packed cases have padding rows."""
    assert any(name is not None and PACKING_BY_NAME[name].has_padding for name, _, _ in CASES)
