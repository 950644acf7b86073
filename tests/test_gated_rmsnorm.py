"""Gated RMSNorm op: both backends against a float64 autograd reference, opcheck, torch.compile,
deterministic weight gradient, bad input. Without a GPU the triton backend runs under the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
import pytest
import torch

from gdn_packed.ops._common import triton_usable
from gdn_packed.ops.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_bwd, gated_rmsnorm_fwd
from gdn_packed.testing import poisoned_outputs, rel_err
from gdn_packed.torch_ref.gated_rmsnorm import gated_rmsnorm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    bool(triton_usable(torch.device(DEVICE))), reason="triton cannot run here"))]
# docs/DESIGN.md section 7: output budgets, and the gradient budgets (fp32 CPU 1e-5, fp32 GPU 3e-3, bf16 2.5e-2)
BUDGET = {torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3, torch.bfloat16: 2e-2}
GRAD_BUDGET = {torch.float32: 1e-5 if DEVICE == "cpu" else 3e-3, torch.bfloat16: 2.5e-2}


def inputs(shape, dtype, seed=0, requires_grad=True, zero_centered=False):
    """x, z and a weight around 1 (around 0 when zero-centred: the scale 1 + weight is then ~1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 3
    z = torch.randn(*shape, generator=gen) * 2
    w = (0.0 if zero_centered else 1.0) + 0.5 * torch.randn(shape[-1], generator=gen)
    return [t.to(DEVICE, dtype).requires_grad_(requires_grad) for t in (x, z, w)]


def check_against_float64(backend, dtype, shape, zero_centered):
    x, z, w = inputs(shape, dtype, zero_centered=zero_centered)
    with poisoned_outputs():
        y = gated_rmsnorm(x, z, w, eps=1e-6, backend=backend, zero_centered=zero_centered)
        dy = torch.randn_like(y)
        gx, gz, gw = torch.autograd.grad(y, (x, z, w), dy)
    xd, zd, wd = (t.detach().double().requires_grad_() for t in (x, z, w))
    yd = gated_rmsnorm_ref(xd, zd, wd, 1e-6, zero_centered=zero_centered)
    rx, rz, rw = torch.autograd.grad(yd, (xd, zd, wd), dy.double())
    assert y.dtype == dtype and gx.dtype == dtype and gw.dtype == dtype
    budget = BUDGET[dtype]
    assert rel_err(y, yd) <= budget
    for got, ref in ((gx, rx), (gz, rz), (gw, rw)):
        assert rel_err(got, ref) <= GRAD_BUDGET[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 37, 4, 32), (3, 5, 2, 64), (1, 1, 1, 24), (100, 128)],
                         ids=["T37-H4-V32", "B3-T5-H2-V64", "T1-V24", "M100-V128"])
def test_matches_float64_reference(backend, dtype, shape):
    check_against_float64(backend, dtype, shape, zero_centered=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 37, 4, 32), (100, 128)], ids=["T37-H4-V32", "M100-V128"])
def test_zero_centered_matches_float64_reference(backend, dtype, shape):
    """Zero-centred weight (scale 1 + weight): outputs and all three gradients against float64."""
    check_against_float64(backend, dtype, shape, zero_centered=True)


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


def test_zero_rows_give_zero_output_and_finite_grads():
    x, z, w = inputs((6, 16), torch.float32)
    x = x.detach().clone()
    x[2:4] = 0
    x.requires_grad_()
    y = gated_rmsnorm(x, z, w, backend="torch")
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


def test_torch_compile_fullgraph_matches_eager():
    x, z, w = inputs((2, 9, 4, 32), torch.float32)

    def f(x, z, w):
        return gated_rmsnorm(x, z, w, eps=1e-5).square().sum()

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
    (dict(zero_centered=1), TypeError, "zero_centered must be a bool"),
])
def test_bad_input_raises_a_named_error(bad, err, match):
    args = dict(x=torch.randn(2, 4), z=torch.randn(2, 4), weight=torch.ones(4), eps=1e-6, backend="torch")
    args.update(bad)
    with pytest.raises(err, match=match):
        gated_rmsnorm(**args)
