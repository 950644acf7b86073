"""gdn_packed.fused_recurrent_gated_delta_rule on every backend that runs here (tests/cuda_backends.py:
torch, the host mirror of the csrc/ kernel, the CUDA kernel on a GPU) against the float64 per-token
reference, over the shared packings (plus a decode step), and against the chunked op; state pools;
the custom ops; input errors."""
import functools

import pytest
import torch

import gdn_packed
from gdn_packed import cuda as gdn_cuda
from gdn_packed.ops import recurrent_gdr as rec_op
from gdn_packed.ops._common import poisoned_outputs
from gdn_packed.testing import (PACKING_BY_NAME, PACKINGS, Packing, gdr_inputs, layout, no_host_sync, real_rows,
                                reference_gdr, rel_err)

from cuda_backends import backends

BACKENDS = backends()
# the shared packings and the decode step (one token per sequence), crossed with the op's own
# dimensions: (H, HV, K, V, initial_state, l2norm); K = 128 is the cuda kernel's largest
DECODE_STEP = Packing("decode-step", [1, 1, 1, 1, 1, 1])
DIMS = [(2, 4, 32, 16, True, True), (1, 2, 48, 8, True, False), (2, 2, 16, 24, False, True),
        (2, 8, 128, 8, True, True)]


def dims_id(d):
    H, HV, K, V, h0, l2 = d
    return f"H{H}x{HV}-K{K}-V{V}" + ("-h0" if h0 else "") + ("-l2" if l2 else "")


def recurrent(backend, q, k, v, g, beta, h0=None, cu=None, pad=None, l2=False, idx=None, final=True, scale=None):
    """(o, final_state or pool) of one backend; 'host' runs csrc/'s host mirror on CPU tensors."""
    if backend == "host":
        B, L = q.shape[:2]
        N = B if cu is None else cu.numel() - 1
        o = torch.full(v.shape, float("nan"), dtype=v.dtype)
        fs = None if idx is not None else torch.full((N, *v.shape[2:3], q.shape[3], v.shape[3]), float("nan"))
        sc = q.shape[-1] ** -0.5 if scale is None else scale
        rows = lambda x: x.reshape(B * L, *x.shape[2:])  # noqa: E731
        cus = torch.arange(B + 1) * L if cu is None else cu
        gdn_cuda.recurrent_fwd_cuda(rows(q), rows(k), rows(v), rows(g), rows(beta), cus, pad, h0, idx, sc, l2,
                                  rows(o), fs, host=True)
        return o, (h0 if idx is not None else fs)
    dev = "cuda" if backend == "cuda" else "cpu"
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    with poisoned_outputs():
        o, fs = gdn_packed.fused_recurrent_gated_delta_rule(
            to(q), to(k), to(v), to(g), to(beta), scale=scale, initial_state=to(h0), output_final_state=final,
            cu_seqlens=to(cu), cu_seqlens_padded=to(pad), state_indices=to(idx), use_qk_l2norm_in_kernel=l2,
            backend=backend)
    if idx is not None and dev == "cuda":
        h0.copy_(fs.cpu())
        fs = h0
    return o.cpu(), (None if fs is None else fs.cpu())


def make_case(packing, dims, dtype=torch.float32, seed=0):
    H, HV, K, V, with_h0, l2 = dims
    cu, pad, rows = packing.layout()
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, V, dtype, N=len(packing.lengths), seed=seed,
                                      initial_state=with_h0, unit_k=not l2)
    return (q, k, v, g, beta, h0, cu, pad, l2), real_rows(cu, pad, rows)


def test_packings_include_padding():
    """The padding assertion below is not vacuous: some shared packings have padding rows."""
    assert any(p.has_padding for p in PACKINGS) and any(not p.has_padding for p in PACKINGS)


@functools.lru_cache(maxsize=None)
def reference(packing, dims):
    """The float64 reference of make_case(packing, dims), computed once for all backends."""
    (q, k, v, g, beta, h0, cu, pad, l2), _ = make_case(packing, dims)
    return reference_gdr(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, cu_seqlens_padded=pad,
                         use_qk_l2norm_in_kernel=l2)


@pytest.mark.parametrize("dims", DIMS, ids=dims_id)
@pytest.mark.parametrize("packing", PACKINGS + [DECODE_STEP], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64_reference(backend, packing, dims):
    (q, k, v, g, beta, h0, cu, pad, l2), real = make_case(packing, dims)
    o, fs = recurrent(backend, q, k, v, g, beta, h0, cu, pad, l2)
    ro, rfs = reference(packing, dims)
    assert rel_err(o, ro) <= 1e-5 and rel_err(fs, rfs) <= 1e-5, (rel_err(o, ro), rel_err(fs, rfs))
    assert bool((~real).any()) == packing.has_padding
    if packing.has_padding:   # o exactly 0 on every padding row
        assert torch.equal(o[0, ~real], torch.zeros_like(o[0, ~real]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_chunked_op(backend):
    (q, k, v, g, beta, h0, cu, pad, l2), _ = make_case(PACKING_BY_NAME["gaps-and-empties"], DIMS[1])
    o, fs = recurrent(backend, q, k, v, g, beta, h0, cu, pad, l2)
    co, cfs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, cu_seqlens_padded=pad, use_qk_l2norm_in_kernel=l2,
                                                backend="torch")
    assert rel_err(o, co) <= 1e-5 and rel_err(fs, cfs) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision(backend, dtype):
    (q, k, v, g, beta, h0, cu, pad, l2), _ = make_case(PACKING_BY_NAME["around-chunk-gaps"], DIMS[2], dtype)
    o, fs = recurrent(backend, q, k, v, g, beta, h0, cu, pad, l2, scale=0.3)
    ro, rfs = reference_gdr(q, k, v, g, beta, scale=0.3, initial_state=h0, cu_seqlens=cu, cu_seqlens_padded=pad,
                            use_qk_l2norm_in_kernel=l2)
    assert o.dtype == dtype and rel_err(o, ro) <= 2e-2 and rel_err(fs, rfs) <= 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_without_cu_seqlens(backend):
    q, k, v, g, beta, h0 = gdr_inputs(20, 2, 4, 16, 8, batch=3, initial_state=True)
    o, fs = recurrent(backend, q, k, v, g, beta, h0)
    ro, rfs = reference_gdr(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o, ro) <= 1e-5 and rel_err(fs, rfs) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("oob", [False, True], ids=["neg", "neg-and-oob"])
def test_state_pool_with_negative_indices(backend, oob):
    """Sequence i starts from pool[idx[i]] and writes back there; -1: zeros and no write-back; every
    other slot is untouched."""
    cu, pad, rows = layout([4, 0, 7, 3], gaps=[1, 2, 0, 0], tail=2)
    q, k, v, g, beta, _ = gdr_inputs(rows, 2, 4, 16, 8, N=4)
    pool = torch.randn(6, 4, 16, 8) * 0.1
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    h0 = torch.where((idx >= 0)[:, None, None, None], pool[idx.clamp_min(0).long()], torch.zeros(1))
    if oob:   # without validate=True an index >= P behaves like -1 (never an out-of-bounds access)
        idx[1] = 6
    ro, rfs = reference_gdr(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, cu_seqlens_padded=pad)
    before = pool.clone()
    o, after = recurrent(backend, q, k, v, g, beta, pool, cu, pad, idx=idx)
    assert rel_err(o, ro) <= 1e-5
    for i, s in enumerate(idx.tolist()):
        if 0 <= s < pool.shape[0]:
            assert rel_err(after[s], rfs[i]) <= 1e-5
    for s in (1, 3, 4):
        assert torch.equal(after[s], before[s])


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_slot_reused_across_calls(backend):
    """Decoding a sequence in three calls through one pool slot equals one call over all its tokens."""
    q, k, v, g, beta, h0 = gdr_inputs(9, 1, 2, 16, 8, initial_state=True)
    ro, rfs = reference_gdr(q, k, v, g, beta, initial_state=h0)
    pool = torch.zeros(3, 2, 16, 8)
    pool[1] = h0[0]
    idx = torch.tensor([1])
    outs = []
    for a, b in ((0, 4), (4, 5), (5, 9)):
        o, pool = recurrent(backend, q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], pool, idx=idx)
        outs.append(o)
    assert rel_err(torch.cat(outs, 1), ro) <= 1e-5 and rel_err(pool[1], rfs[0]) <= 1e-5
    assert torch.equal(pool[0], torch.zeros_like(pool[0]))


def _op_inputs():
    cu, pad, rows = layout([3, 0, 5], gaps=[1, 0, 2], tail=1)
    q, k, v, g, beta, h0 = gdr_inputs(rows, 2, 4, 16, 8, N=3, initial_state=True)
    return q, k, v, g, beta, h0, cu, pad


def test_opcheck():
    q, k, v, g, beta, h0, cu, pad = _op_inputs()
    torch.library.opcheck(rec_op.recurrent_gdr_fwd, (q, k, v, g, beta, h0, cu, pad, 0.25, True, True, "torch"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    pool, idx = torch.randn(4, 4, 16, 8), torch.tensor([2, -1, 0])
    torch.library.opcheck(rec_op.recurrent_gdr_fwd_pool, (q, k, v, g, beta, pool, idx, cu, pad, 0.25, False, "torch"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_torch_compile_fullgraph_and_no_host_sync(monkeypatch):
    q, k, v, g, beta, h0, cu, pad = _op_inputs()
    idx = torch.tensor([2, -1, 0])

    def f(q, k, v, g, beta, h0, pool):
        o, fs = gdn_packed.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                            cu_seqlens=cu, cu_seqlens_padded=pad)
        o2, _ = gdn_packed.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                                                            cu_seqlens_padded=pad, state_indices=idx)
        return o + o2, fs

    pool_e = torch.randn(4, 4, 16, 8)
    pool_c = pool_e.clone()
    eo, efs = f(q, k, v, g, beta, h0, pool_e)
    torch._dynamo.reset()
    co, cfs = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, h0, pool_c)
    assert torch.equal(eo, co) and torch.equal(efs, cfs) and torch.equal(pool_e, pool_c)
    # on a device the torch path loops over the static bound T; with that bound nothing reads back
    from gdn_packed.torch_ref import recurrent
    monkeypatch.setattr(recurrent, "_steps", lambda lens, T: T)
    with no_host_sync():
        f(q, k, v, g, beta, h0, pool_e)


def _good():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q, k, v, g, beta, h0 = gdr_inputs(10, 2, 4, 16, 8, N=2, initial_state=True)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


BAD = {
    "int-q": (dict(q=torch.zeros(1, 10, 2, 16, dtype=torch.int32)), TypeError, "q must"),
    "HV-not-multiple": (dict(q=torch.randn(1, 10, 3, 16), k=torch.randn(1, 10, 3, 16)), ValueError, "v.shape"),
    "h0-shape": (dict(initial_state=torch.zeros(3, 4, 16, 8)), ValueError, "initial_state"),
    "h0-dtype": (dict(initial_state=torch.zeros(2, 4, 16, 8, dtype=torch.bfloat16)), TypeError, "initial_state"),
    "indices-dtype": (dict(state_indices=torch.tensor([0.0, 1.0])), TypeError, "state_indices"),
    "indices-shape": (dict(state_indices=torch.tensor([0, 1, 2])), ValueError, "state_indices"),
    "pool-shape": (dict(initial_state=torch.zeros(5, 4, 8, 8), state_indices=torch.tensor([0, 1])), ValueError,
                   "initial_state"),
    "indices-out-of-range": (dict(initial_state=torch.zeros(3, 4, 16, 8), state_indices=torch.tensor([0, 3]),
                                  validate=True), ValueError, "state_indices"),
    "indices-repeat": (dict(initial_state=torch.zeros(3, 4, 16, 8), state_indices=torch.tensor([1, 1]),
                            validate=True), ValueError, "state_indices"),
    "cuda-on-cpu": (dict(backend="cuda"), ValueError, "cuda"),
    "pool-requires-grad": (dict(initial_state=torch.zeros(3, 4, 16, 8, requires_grad=True),
                                state_indices=torch.tensor([0, 2])), ValueError, "updated in place"),
    "nan-scale": (dict(scale=float("nan")), ValueError, "scale must be finite"),
    "bool-scale": (dict(scale=True), TypeError, "scale must be a float"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_argument(name):
    change, exc, match = BAD[name]
    with pytest.raises(exc, match=match):
        gdn_packed.fused_recurrent_gated_delta_rule(**{**_good(), **change})
