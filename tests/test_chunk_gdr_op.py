"""The chunked gated delta rule as a custom op: opcheck, torch.compile, no host sync, bad input."""
import pytest
import torch

import gdn_packed
from gdn_packed.ops.chunk_gdr import chunk_gdr_bwd, chunk_gdr_fwd
from gdn_packed.testing import gdr_inputs, layout, no_host_sync, rel_err

LENS, GAPS, TAIL = [5, 0, 70, 1], [2, 1, 0, 3], 4


def packed_inputs(requires_grad=False, h0=True):
    cu, cu_pad, rows = layout(LENS, gaps=GAPS, tail=TAIL)
    q, k, v, g, beta, s0 = gdr_inputs(rows, 2, 4, 16, 8, N=len(LENS), initial_state=h0)
    xs = [q, k, v, g, beta, s0]
    if requires_grad:
        xs = [None if x is None else x.requires_grad_() for x in xs]
    return xs, cu, cu_pad


@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_opcheck_forward(h0):
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs(requires_grad=True, h0=h0)
    torch.library.opcheck(chunk_gdr_fwd, (q, k, v, g, beta, s0, cu, cu_pad, 0.25, True, "torch"))


def test_opcheck_backward():
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs()
    do, dht = torch.randn_like(v), torch.randn_like(s0)
    torch.library.opcheck(chunk_gdr_bwd, (q, k, v, g, beta, s0, cu, cu_pad, do, dht, 0.25, False, "torch"))


def test_torch_compile_fullgraph_matches_eager():
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs()

    def f(q, k, v, g, beta, s0, cu, cu_pad):
        o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                                                  use_qk_l2norm_in_kernel=True)
        return o * 2, fs

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    eo, efs = f(q, k, v, g, beta, s0, cu, cu_pad)
    co, cfs = compiled(q, k, v, g, beta, s0, cu, cu_pad)
    assert torch.equal(eo, co) and torch.equal(efs, cfs)
    explained = torch._dynamo.explain(f)(q, k, v, g, beta, s0, cu, cu_pad)
    assert explained.graph_break_count == 0


def test_forward_and_backward_make_no_host_sync():
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs(requires_grad=True)
    with no_host_sync():
        o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad)
        (o.sum() + fs.sum()).backward()
    assert q.grad is not None


def test_autograd_grads_match_backward_op_under_torch_compile():
    (q, k, v, g, beta, s0), cu, cu_pad = packed_inputs(requires_grad=True)

    def loss(q, k, v, g, beta, s0):
        o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad)
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


@pytest.mark.parametrize("cu", [[0, 5, 3], [0, 3, 40], [0, -7, 10], [5, 2, 2**30]])
def test_corrupt_cu_seqlens_without_validate_stays_in_bounds(cu):
    kw = _good()
    kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    o, fs = gdn_packed.chunk_gated_delta_rule(**kw, output_final_state=True)
    assert o.shape == kw["v"].shape and fs.shape == kw["initial_state"].shape


def test_unimplemented_backend_is_clear():
    with pytest.raises((NotImplementedError, RuntimeError), match="cuda|triton"):
        gdn_packed.chunk_gated_delta_rule(**_good(), backend="cuda")
