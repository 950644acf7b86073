"""The sm_90a chunked forward (csrc/chunk_gdr_fwd_sm90.cu) through its host mirror: the kernel's tile
program (csrc/chunk_gdr_sm90.cuh: the chunk walk, gate sums, E, the Gram products, the inverse by block
doubling, the state step, the padding rows) with plain loops in place of wgmma / TMA / ldmatrix, on CPU
tensors, K = V = 128 (the kernel's only head size), GVA 2:
  - o and the final state against the float64 per-sequence reference on every packing of
    gdn_packed.testing.PACKINGS: fp32 (no rounding in the mirror) within 1e-5, bf16 / fp16 within the
    budgets, padding rows exactly 0 with NaN-poisoned outputs, NaN in the inputs' padding rows isolated;
  - bf16 no worse than 1.1x FLA's chunk_gated_delta_rule on the same inputs (fla-core, the oracle);
  - the gates from raw a, b (A_log, dt_bias) as the torch backend forms them;
  - the same for the tile programs of the split kernel (prep CTAs beside the state CTAs; the state step's
    output a step later) and of the state-only kernel (on Triton prep's outputs, under the interpreter).
What the mirror cannot check (fragment layouts, swizzles, barriers, async proxies): docs/DESIGN.md
section 10; tools/gpu_check.py runs the device kernel."""
import functools

import pytest
import torch

import gdn_packed
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
def case(pi, dtype, poison_padding=False, kernel="fused"):
    """Inputs of packing pi (l2norm, h0), the mirror's (o, final state) of `kernel`'s tile program and the
    float64 reference."""
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
    chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, K ** -0.5, 64, True, o, fs, host=True,
                       kernel=kernel)
    clean = [torch.where(pad[None, :, None, None], 0.0, x.double()) for x in (q, k, v)]
    ro, rf = reference_gdr(*clean, g.double(), beta.double(), initial_state=h0.double(), cu_seqlens=cu,
                           cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=True)
    return (q, k, v, g, beta, h0), cu, pad, o[None], fs, ro, rf


@pytest.mark.parametrize("kernel", ["fused", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("pi", range(len(PACKINGS)), ids=IDS)
def test_mirror_matches_float64_reference(pi, dtype, kernel):
    _, _, pad, o, fs, ro, rf = case(pi, dtype, kernel=kernel)
    b = BUDGETS[dtype]
    assert rel_err(o, ro) <= b["o"] and rel_err(fs, rf) <= b["state"], (rel_err(o, ro), rel_err(fs, rf))
    assert (o[0, pad] == 0).all() and torch.isfinite(o).all()


@pytest.mark.parametrize("kernel", ["fused", "split"])
@pytest.mark.parametrize("pi", [1, 2, 3], ids=[IDS[i] for i in (1, 2, 3)])
def test_mirror_isolates_nan_in_padding_rows(pi, kernel):
    """NaN in q, k, v of every padding row: o and the state as without it (TMA loads those rows; prep
    zeroes them), padding rows 0."""
    _, _, pad, o, fs, _, _ = case(pi, torch.bfloat16, poison_padding=True, kernel=kernel)
    _, _, _, o0, fs0, _, _ = case(pi, torch.bfloat16, kernel=kernel)
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


def test_mirror_hard_resets_give_exact_zeros():
    """g = -inf (a hard reset) and g = -1e30 rows, inside a chunk and at its first row: the gate sums
    are sums of g over row ranges (strips of 8 rows), never a difference of two sums, so the decay
    across them is exactly 0 (no inf - inf): o and the state as the float64 reference, finite."""
    cu, cu_pad, rows = PACKINGS[3].layout()      # around-chunk-gaps: 127, 64, 63 tokens
    N = len(PACKINGS[3].lengths)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, K, torch.float32, N=N, initial_state=True, unit_k=False)
    for row, val in ((5, float("-inf")), (64, -1e30), (70, float("-inf")), (131, -1e30), (200, float("-inf"))):
        g[0, row] = val
    table, cc = make_chunk_table(cu, cu_pad, rows, 64)
    o, fs = torch.full_like(v[0], float("nan")), torch.full((N, HV, K, K), float("nan"))
    chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, K ** -0.5, 64, True, o, fs, host=True)
    ro, rf = reference_gdr(q.double(), k.double(), v.double(), g.double(), beta.double(), initial_state=h0.double(),
                           cu_seqlens=cu, cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(fs).all()
    assert rel_err(o[None], ro) <= BUDGETS[torch.float32]["o"] and rel_err(fs, rf) <= BUDGETS[torch.float32]["state"]


def _skip_without_triton_prep():
    from gdn_packed.ops._common import triton_usable
    if triton_usable(torch.device("cpu")):
        pytest.skip(f"Triton prep cannot run here: {triton_usable(torch.device('cpu'))}")


@pytest.mark.parametrize("kernel", ["fused", "split", "state"])
def test_mirror_raw_gates(kernel):
    """With A_log, dt_bias the fused and split kernels form g = -exp(A_log) softplus(a + dt_bias),
    beta = sigmoid(b) (their producers); the two-kernel forward ("state") forms them with the Triton gate
    pass before prep: o and the final state as from the gates formed by the torch backend (float32)."""
    if kernel == "state":
        _skip_without_triton_prep()
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
                           A_log=A_log if raw else None, dt_bias=dt_bias if raw else None, kernel=kernel)
        outs.append((o, fs))
    assert rel_err(outs[1][0], outs[0][0].double()) <= 1e-6 and rel_err(outs[1][1], outs[0][1].double()) <= 1e-6


# ---- the two-kernel forward: Triton prep, then the state-only kernel on its outputs --------------------
@functools.lru_cache(maxsize=None)
def two_kernel_case(pi, dtype, poison_padding=False):
    """case(pi, dtype)'s inputs through Triton prep (the interpreter) and the state-only kernel's mirror
    (kernel="state"): (o [1, T, HV, V], final state)."""
    (q, k, v, g, beta, h0), cu, pad, _, _, _, _ = case(pi, dtype)
    if poison_padding:
        q, k, v = (torch.where(pad[None, :, None, None], float("nan"), x) for x in (q, k, v))
    p = PACKINGS[pi]
    table, cc = make_chunk_table(cu, p.layout()[1], q.shape[1], 64)
    o, fs = torch.full_like(v[0], float("nan")), torch.full((len(p.lengths), HV, K, K), float("nan"))
    chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, K ** -0.5, 64, True, o, fs, host=True,
                       kernel="state")
    return o[None], fs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("pi", range(len(PACKINGS)), ids=IDS)
def test_state_only_mirror_matches_float64_reference(pi, dtype):
    """Triton prep's outputs (Ts, M, the gate rows and chunk decays of every chunk slot) through the state-only
    kernel's tile program (its producer's loads in place of prep; the state step as the fused kernel's): o
    and the final state within the budgets of float64 on every packing, padding rows exactly 0. (bf16 is the
    GPU check's: Triton's interpreter computes bf16 dots wrongly, docs/DESIGN.md section 10.)"""
    _skip_without_triton_prep()
    _, _, pad, _, _, ro, rf = case(pi, dtype)
    o, fs = two_kernel_case(pi, dtype)
    b = BUDGETS[dtype]
    assert rel_err(o, ro) <= b["o"] and rel_err(fs, rf) <= b["state"], (rel_err(o, ro), rel_err(fs, rf))
    assert (o[0, pad] == 0).all() and torch.isfinite(o).all()


@pytest.mark.parametrize("pi", [1, 2, 3], ids=[IDS[i] for i in (1, 2, 3)])
def test_state_only_mirror_isolates_nan_in_padding_rows(pi):
    """NaN in q, k, v of every padding row: Triton prep masks them, the state-only kernel zeroes a last
    chunk's dead rows of its k, q, v tiles itself (no prep of its own does): o and the state unchanged."""
    _skip_without_triton_prep()
    o, fs = two_kernel_case(pi, torch.float16, poison_padding=True)
    o0, fs0 = two_kernel_case(pi, torch.float16)
    pad = case(pi, torch.float16)[2]
    assert torch.equal(o, o0) and torch.equal(fs, fs0) and (o[0, pad] == 0).all()


def test_forward_kernel_splits_where_the_fused_kernel_leaves_half_the_sms_idle():
    """The dispatch rule (gdn_packed.cuda.chunk.forward_kernel): the split kernel where the fused kernel's
    2 HV N CTAs fill at most half of the SMs (the anchor, 1 x 32768 with 32 value heads: 64 CTAs on an
    H200's 132; the split kernel's 128 then fit one wave) and the device can hold its HV N clusters of 4
    at once (as many as cudaOccupancyMaxActiveClusters says; SMs / 4 where it cannot say), the fused
    kernel from there on (4 x 8192: 256 CTAs); CPU tensors (the host mirror) take the fused kernel's tile
    program unless `kernel` names one; "state" is never picked, and a kernel not in KERNELS is a ValueError
    naming them. The fused and split kernels take GVA pairs wherever the value heads pair (the split
    kernel's clusters of 8 also need to fit at once); the state-only kernel never does."""
    from gdn_packed.cuda.chunk import KERNELS, _kernel, forward_kernel, gva_pairs
    split = lambda *a: forward_kernel(*a) == "split"   # noqa: E731
    assert split(1, 32, 132) and split(2, 16, 132) and split(1, 33, 132)
    assert not split(1, 34, 132) and not split(4, 32, 132) and not split(2, 32, 132)
    assert split(1, 32, 128) and not split(1, 33, 128)
    # the split kernel's HV N clusters of 4 must be resident at once (GPC placement: split_clusters)
    assert forward_kernel(1, 32, 132, 32) == "split" and forward_kernel(1, 32, 132, 31) == "fused"
    assert forward_kernel(1, 32, 132, -1) == "split" and forward_kernel(1, 33, 132, -1) == "split"
    assert forward_kernel(1, 33, 132, 32) == "fused"
    assert {forward_kernel(n, hv, 132) for n in (1, 2, 4, 64) for hv in (1, 8, 32, 64)} == {"fused", "split"}
    # on GVA pairs (gva_pairs) clusters of 8: HV N / 2 of them
    assert gva_pairs(16, 32) and gva_pairs(1, 4) and not gva_pairs(16, 16) and not gva_pairs(2, 6)
    assert forward_kernel(1, 32, 132, 16, True) == "split" and forward_kernel(1, 32, 132, 15, True) == "fused"
    assert forward_kernel(1, 32, 132, None, True) == "split" and forward_kernel(1, 34, 132, None, True) == "fused"
    assert _kernel(torch.device("cpu"), 1, 1, 1, None) == ("fused", False)
    assert _kernel(torch.device("meta"), 1, 16, 32, None) == ("split", True)
    assert _kernel(torch.device("meta"), 1, 32, 32, None) == ("split", False)
    assert _kernel(torch.device("meta"), 4, 16, 32, None) == ("fused", True)     # (the fused kernel's pairs)
    assert _kernel(torch.device("meta"), 4, 32, 32, None) == ("fused", False)
    assert all(_kernel(torch.device("cpu"), 1, 1, 1, k) == (k, False) for k in KERNELS)
    assert [_kernel(torch.device("cpu"), 1, 1, 2, k) for k in KERNELS] == [("fused", True), ("split", True),
                                                                         ("state", False)]
    with pytest.raises(ValueError, match=r"kernel must be one of \('fused', 'split', 'state'\)"):
        _kernel(torch.device("cpu"), 1, 1, 1, "two")


def test_kernel_on_a_device_keeps_what_forward_kernel_says(monkeypatch):
    """_kernel on a CUDA device (faked here: 132 SMs, clusters as split_clusters says) runs forward_kernel's
    kernel with the pairs that kernel takes: the fused one on GVA pairs wherever they pair, the split one in
    the pair form whose clusters fit, and a kernel the GPU tests force through forward_kernel ("state"
    among them) as it is, never the fused one in its place."""
    from gdn_packed.cuda import chunk as cuda_chunk
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"multi_processor_count": 132}))
    monkeypatch.setattr(cuda_chunk, "split_clusters", lambda index, pairs: 16 if pairs else 32)
    assert cuda_chunk._kernel(dev, 4, 16, 32, None) == ("fused", True)
    assert cuda_chunk._kernel(dev, 4, 32, 32, None) == ("fused", False)
    assert cuda_chunk._kernel(dev, 1, 16, 32, None) == ("split", True)
    monkeypatch.setattr(cuda_chunk, "split_clusters", lambda index, pairs: 15 if pairs else 32)
    assert cuda_chunk._kernel(dev, 1, 16, 32, None) == ("split", False)      # (16 clusters of 8 needed)
    for forced, want in (("fused", ("fused", True)), ("split", ("split", True)), ("state", ("state", False))):
        monkeypatch.setattr(cuda_chunk, "forward_kernel", lambda *a, k=forced: k)
        assert cuda_chunk._kernel(dev, 1, 16, 32, None) == want, forced


def test_split_clusters_asked_once_and_never_during_a_graph_capture(monkeypatch):
    """gdn_packed.cuda.chunk.split_clusters asks _C once per (device, form) and keeps the answer; during a
    CUDA-graph capture it answers -1 (SMs / 4 or / 8 for the rule) without asking and keeps nothing."""
    from gdn_packed.cuda import chunk as cuda_chunk
    asked = []

    class FakeC:
        @staticmethod
        def chunk_gdr_fwd_sm90_split_clusters(device, pairs):
            asked.append((device, pairs))
            return 15 if pairs else 32
    monkeypatch.setattr(cuda_chunk, "_CLUSTERS", {})
    monkeypatch.setattr(_cext, "get_C", lambda: FakeC)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cuda_chunk.split_clusters(0, True) == -1 and asked == [] and cuda_chunk._CLUSTERS == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert [cuda_chunk.split_clusters(0, p) for p in (True, False, True, False)] == [15, 32, 15, 32]
    assert asked == [(0, True), (0, False)]
    assert cuda_chunk.forward_kernel(1, 32, 132, 15, True) == "fused"        # (16 clusters of 8 needed)
    assert cuda_chunk.forward_kernel(1, 32, 132, 32, False) == "split"


def test_forced_state_kernel_names_why_it_cannot_run(monkeypatch):
    """kernel='state' on CPU tensors without the Triton interpreter is a RuntimeError saying so, not an
    error from inside Triton; on other devices (the sm_90 report's meta tensors) it is not refused."""
    pytest.importorskip("triton", reason="Triton is not installed (the two-kernel forward needs it)")
    from gdn_packed.cuda.chunk import _triton_prep
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"kernel='state' on CPU tensors .* TRITON_INTERPRET=1"):
        _triton_prep(torch.device("cpu"))
    assert _triton_prep(torch.device("meta")) is not None


# ---- backend="cuda" of the op: dispatch, refusals, autograd through the Triton backward --------------

def test_cuda_backend_refuses_what_its_kernel_does_not_take():
    """Asked by name, an input the kernel does not take is an error naming why (never a silent switch to
    another backend, so a 'cuda' run or benchmark row is the cuda kernel); 'auto' passes over it."""
    from gdn_packed.cuda.chunk import refusal
    cpu = torch.device("cpu")
    q, v = torch.zeros(4, 1, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert refusal(q, v, cpu, N=3) is None
    for qq, vv, n, kind, words in ((q[..., :64], v, 1, ValueError, "K = 64"), (q, v[..., :32], 1, ValueError, "V = 32"),
                                   (q.float(), v.float(), 1, TypeError, "torch.float32"),
                                   (q, v, 65536, ValueError, "65535 sequences")):
        err = refusal(qq, vv, cpu, N=n)
        assert isinstance(err, kind) and words in str(err) and "backend='triton'" in str(err), err
    x = dict(q=torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16), k=torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16),
             v=torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16), g=torch.zeros(1, 4, 2), beta=torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="CUDA tensors"):        # on CPU tensors: resolve_backend's error
        gdn_packed.chunk_gated_delta_rule(**x, backend="cuda")


def test_device_launch_taken_on_sm90_refused_elsewhere(monkeypatch):
    """An H200 ran the forward (2026-12-04, second session): on an sm_90 device backend='cuda' is taken
    (no variable needed); on another GPU it is refused naming sm_90 and backend='triton'."""
    from gdn_packed.cuda import chunk
    q, v = torch.zeros(4, 1, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert chunk.refusal(q, v, torch.device("cuda"), N=1) is None
    assert chunk.refusal(q, v, torch.device("cpu"), N=1) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    err = chunk.refusal(q, v, torch.device("cuda"), N=1)
    assert isinstance(err, RuntimeError) and "sm_90" in str(err) and "backend='triton'" in str(err), err


def test_auto_never_picks_cuda_yet(monkeypatch):
    """Opt-in until tools/gpu_check.py has passed it on an H200: with the cuda backend usable and triton
    not, 'auto' on CUDA tensors takes torch, not cuda; the dispatch table lists cuda after triton."""
    from gdn_packed.ops import BACKENDS, _common, chunk_gdr
    monkeypatch.setattr(_common, "_cuda_ok", lambda: True)
    monkeypatch.setattr(_common, "triton_usable", lambda device: "no triton in this test")
    assert BACKENDS[chunk_gdr.OP] == ("triton", "cuda", "torch") and "cuda" not in chunk_gdr.AUTO_BACKENDS
    assert _common.resolve_backend("auto", torch.device("cuda"), have=chunk_gdr.AUTO_BACKENDS) == "torch"
    assert _common.resolve_backend("auto", torch.device("cuda"), have=BACKENDS[chunk_gdr.OP]) == "cuda"


@pytest.fixture
def mirror_as_cuda_forward(monkeypatch):
    """The dispatch table's cuda forward and its backward's dS pass and chunk-parallel gradients run their
    host mirrors (CPU tensors) for the test's duration."""
    from gdn_packed.cuda import chunk as cuda_chunk
    from gdn_packed.ops import _dispatch

    class Calls(list):
        opts = {}           # chunk_gdr_fwd_cuda's own options for the test (kernel)
    calls = Calls()
    real_dstate, real_grads = cuda_chunk.chunk_bwd_dstate_cuda, cuda_chunk.chunk_bwd_grads_cuda

    def fwd(*args, **kw):
        calls.append(sorted(kw))
        return chunk_gdr_fwd_cuda(*args, **kw, host=True, **calls.opts)

    def dstate(*args, **kw):
        calls.append("dS pass")
        return real_dstate(*args, **kw, host=True)
    def grads(*args, **kw):
        calls.append("grads")
        return real_grads(*args, **kw, host=True)
    monkeypatch.setattr(cuda_chunk, "chunk_gdr_fwd_cuda", fwd)
    monkeypatch.setattr(cuda_chunk, "chunk_bwd_dstate_cuda", dstate)
    monkeypatch.setattr(cuda_chunk, "chunk_bwd_grads_cuda", grads)
    _dispatch.kernel.cache_clear()
    yield calls
    _dispatch.kernel.cache_clear()


@pytest.mark.parametrize("keep, segments, gating, kernel",
                         [(k, 1, g, "fused") for k in (False, True) for g in (False, True)] + [(True, 3, False, "fused")]
                         + [(True, 1, g, "state") for g in (False, True)] + [(True, 3, False, "state")]
                         + [(True, 1, True, "split"), (True, 3, False, "split")],
                         ids=["recompute-g-beta", "recompute-raw-a-b", "kept-prep-g-beta", "kept-prep-raw-a-b",
                              "kept-segments-g-beta", "two-kernel-g-beta", "two-kernel-raw-a-b",
                              "two-kernel-segments", "split-raw-a-b", "split-segments"])
def test_cuda_op_autograd_is_the_triton_backward(gating, keep, segments, kernel, mirror_as_cuda_forward, monkeypatch):
    """gdn_packed::chunk_gdr_fwd with backend='cuda' (the host mirrors standing in for the forward kernel
    and the backward's dS pass and chunk-parallel gradients, the rest of the Triton backward under the interpreter; fp16: the
    interpreter's bf16 is wrong): o within the fp16 budget of float64. Without keep, the backward runs
    Triton prep again: the gradients of every input (A_log, dt_bias too with the raw gates, which the cuda
    forward takes itself: no gate launch) within 1e-4 of backend='triton''s (the same backward but for the
    dS pass, whose products are rounded at the same points, and the chunk-parallel gradients, whose state
    products are exact where Triton's round the gated operands to two). With keep, the forward keeps its kernel's prep
    (kept_shape: a Prep's words) and the backward runs on it, no prep of its own: every gradient within the
    fp16 budget of float64, and within 2x backend='triton''s error there (the mirror rounds the inverse's
    doubling operands to fp16 as the kernel does, where Triton prep under the interpreter rounds nothing:
    on a GPU its tf32 dots round as much; measured 1.13x on dg with g, beta given, 1.00-1.02x elsewhere,
    every error under 4.1e-4). With the Triton state pass in 3 segments (state_segments forced), the forward
    also keeps the state entering each segment, and the backward's recompute starts from them: no pass A
    (entering_states) in the backward, the same bounds. The two-kernel forward (kernel="state": Triton prep,
    then the state-only kernel) keeps Triton prep's own outputs, the split kernel its prep CTAs' (the fused
    kernel's prep): the same bounds, no prep in the backward."""
    from gdn_packed.ops.chunk_gdr import chunk_gdr_fwd
    from gdn_packed.ops._common import triton_usable
    from gdn_packed.triton import chunk as triton_chunk
    if triton_usable(torch.device("cpu")):
        pytest.skip(f"the Triton backward cannot run here: {triton_usable(torch.device('cpu'))}")
    (q, k, v, g, beta, h0), cu, _, _, _, ro, _ = case(2, torch.float16)
    cu_pad = PACKINGS[2].layout()[1]
    A_log, dt_bias = (torch.tensor([0.3, -1.0]), torch.tensor([0.5, 1.5])) if gating else (None, None)
    gen = torch.Generator().manual_seed(7)
    do, dht = torch.randn(v.shape, generator=gen).half(), torch.randn(h0.shape, generator=gen)
    got, preps, passes_a = {}, [], []
    real_prep, real_entering = triton_chunk.chunk_fwd_prep, triton_chunk.entering_states
    monkeypatch.setattr(triton_chunk, "chunk_fwd_prep", lambda *a, **kw: preps.append(1) or real_prep(*a, **kw))
    monkeypatch.setattr(triton_chunk, "entering_states",
                        lambda *a, **kw: passes_a.append(1) or real_entering(*a, **kw))
    monkeypatch.setattr(triton_chunk, "state_segments", lambda *a, **kw: segments)
    mirror_as_cuda_forward.opts["kernel"] = kernel
    for backend in ("cuda", "triton"):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        gates = [x.clone().requires_grad_() for x in (A_log, dt_bias)] if gating else [None, None]
        o, fs, kept = chunk_gdr_fwd(*leaves, cu, cu_pad, K ** -0.5, True, backend, *gates, keep)
        n, m = len(preps), len(passes_a)          # the backward's prep launches and passes A
        grads = torch.autograd.grad([o, fs], leaves + [x for x in gates if x is not None], [do, dht])
        got[backend] = (o.detach(), kept, grads, len(preps) - n, len(passes_a) - m)
    fwd_kw = sorted((["A_log", "dt_bias"] if gating else []) + (["kept"] if keep else []))
    assert mirror_as_cuda_forward == [fwd_kw, "dS pass", "grads"]
    if not gating:
        assert rel_err(got["cuda"][0], ro) <= BUDGETS[torch.float16]["o"]
    if not keep:
        assert got["cuda"][1].numel() == 0 and got["cuda"][3] == 1          # the backward ran prep
        for a, b in zip(got["cuda"][2], got["triton"][2]):
            assert rel_err(a, b.double()) <= 1e-4
        return
    NC, N = cu.numel() - 1 + q.shape[1] // 64, cu.numel() - 1
    entering = N * segments * HV * K * K if segments > 1 else 0
    assert got["cuda"][1].numel() == entering + triton_chunk.prep_words(NC, HV, torch.float16)
    assert got["cuda"][3] == 0 and got["cuda"][4] == 0        # neither prep nor pass A in the backward
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    ref_gates = [x.double().requires_grad_() for x in (A_log, dt_bias)] if gating else []
    rg, rb = ref[3], ref[4]
    if gating:      # the gates as the op forms them from the raw a, b (the torch backend's, in float64)
        from gdn_packed.torch_ref.chunk import gate_fwd_torch
        rg, rb = gate_fwd_torch(ref[3][0], ref[4][0], *ref_gates)
        rg, rb = rg[None], rb[None]
    pad = ~real_rows(cu, cu_pad, q.shape[1])
    clean = [torch.where(pad[None, :, None, None], 0.0, x) for x in ref[:3]]
    ro2, rf2 = reference_gdr(*clean, torch.where(pad[None, :, None], 0.0, rg), torch.where(pad[None, :, None], 0.0, rb),
                             scale=K ** -0.5, initial_state=ref[5], cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                             use_qk_l2norm_in_kernel=True)
    want = torch.autograd.grad([ro2, rf2], ref + ref_gates, [do.double(), dht.double()])
    for i, (a, b, r) in enumerate(zip(got["cuda"][2], got["triton"][2], want)):
        real = (lambda x: x[:, ~pad]) if i < 5 else (lambda x: x)     # noqa: E731  padding rows: 0 by both
        ea, eb = rel_err(real(a), real(r)), rel_err(real(b), real(r))
        assert ea <= BUDGETS[torch.float16]["grad"] and ea <= 2 * eb + 1e-6, (i, ea, eb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("pi", [0, 2, 4], ids=[IDS[i] for i in (0, 2, 4)])
def test_mirror_keeps_triton_preps_outputs(pi, dtype):
    """With kept (kept_shape), the forward writes its prep's outputs of the sequences' chunk slots in the
    layout of Triton prep's (gdn_packed.triton.chunk.Prep), which the Triton backward then takes: against
    Triton prep (chunk_fwd_prep, the interpreter) on the same inputs, the gate rows, row factors and chunk
    decays within 1e-5 (exp2 of base-2 sums against exp) and Ts, M within 1e-5 in fp32 (the two inverses,
    substitution + doubling against 5 doubling levels, exact in fp32: measured <= 4e-7); in bf16 Ts and M
    within 2^-8, one bf16 rounding (the mirror rounds the doubling operands to fp16, the interpreter
    nothing; both round Ts and M to bf16: measured 4.6e-4); dead rows and columns 0; other slots untouched."""
    from gdn_packed.ops._common import triton_usable
    if triton_usable(torch.device("cpu")):
        pytest.skip(f"Triton prep cannot run here: {triton_usable(torch.device('cpu'))}")
    from gdn_packed.cuda.chunk import kept_shape
    from gdn_packed.triton import chunk as triton_chunk
    p = PACKINGS[pi]
    cu, cu_pad, rows = p.layout()
    N = len(p.lengths)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, K, dtype, N=N, initial_state=True, unit_k=False, seed=pi)
    table, cc = make_chunk_table(cu, cu_pad, rows, 64)
    NC = table.shape[0]
    (words,) = kept_shape(rows, N, HV, K, K, 64, torch.device("cpu"), dtype)
    assert words == triton_chunk.prep_words(NC, HV, dtype)
    kept = torch.full((words,), float("nan"))
    o, fs = torch.empty_like(v[0]), torch.empty(N, HV, K, K)
    chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, K ** -0.5, 64, True, o, fs, kept=kept,
                       host=True)
    got = triton_chunk.prep_in(kept, NC, HV, dtype)
    qr, kr, _, gr, br, rws = triton_chunk._rows(q[0], k[0], v[0], g[0], beta[0])
    want = triton_chunk.chunk_fwd_prep(qr, kr, gr, br, table, HV, K ** -0.5, True, rws)
    used = torch.arange(NC) < int(cc[-1])
    nan_word = torch.tensor(float("nan")).view(torch.int32)       # the fill, as the words of any view
    for x in got:
        assert (x[~used].contiguous().view(torch.int32) == nan_word).all()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8       # bf16: one rounding apart (measured 4.6e-4)
    for name in ("gates", "rn", "eg_last", "ts", "mm"):
        a, b = getattr(got, name)[used], getattr(want, name)[used]
        assert rel_err(a, b) <= (1e-5 if name in ("gates", "rn", "eg_last") else tol), (name, rel_err(a, b))
    length = table[used, 3].long()
    dead = torch.arange(64)[None, :] >= length[:, None]                       # [used slots, C]
    last = lambda x: x.permute(0, 3, 1, 2)[dead]        # noqa: E731  entries at a dead row of the last axis
    for x in (got.rn[used], got.gates[used], got.ts[used].float(), got.mm[used].float()):
        assert (last(x) == 0).all()
    for x in (got.ts[used].float(), got.mm[used].float()):     # and at a dead row of Ts, M
        assert (x.permute(0, 2, 1, 3)[dead] == 0).all()


@pytest.mark.parametrize("pi", [1, 2, 5, 6], ids=[IDS[i] for i in (1, 2, 5, 6)])
def test_mirror_keeps_the_segments_entering_states(pi, monkeypatch):
    """With kept and the Triton state pass in S = 3 segments (fwd_segments forced: these sequences are too
    short for the shapes to choose it), kept starts with the state entering every segment of every
    sequence ([N S, HV, K, V], the segments of gdn_packed.triton.common.segment_chunks: cdiv(chunks, 3)
    chunk slots each, the last ones shorter or empty), which the backward's recompute starts from:
    each within the fp32 state budget of the float64 recurrence run over the sequence's chunks before the
    segment (h0 for the first, the final state for the empty ones after the last chunk; zero-length
    sequences: h0 throughout), every word written."""
    from gdn_packed.ops._common import triton_usable
    if triton_usable(torch.device("cpu")):
        pytest.skip(f"Triton's Prep layout cannot be imported here: {triton_usable(torch.device('cpu'))}")
    from gdn_packed.cuda.chunk import kept_shape
    from gdn_packed.triton import chunk as triton_chunk
    S = 3
    monkeypatch.setattr(triton_chunk, "fwd_segments", lambda *a, **kw: S)
    p = PACKINGS[pi]
    cu, cu_pad, rows = p.layout()
    N = len(p.lengths)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, K, torch.float32, N=N, initial_state=True, unit_k=False,
                                      seed=pi)
    table, cc = make_chunk_table(cu, cu_pad, rows, 64)
    (words,) = kept_shape(rows, N, HV, K, K, 64, torch.device("cpu"), torch.float32)
    assert words == N * S * HV * K * K + triton_chunk.prep_words(table.shape[0], HV, torch.float32)
    kept = torch.full((words,), float("nan"))
    o, fs = torch.empty_like(v[0]), torch.empty(N, HV, K, K)
    chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, K ** -0.5, 64, True, o, fs, kept=kept,
                       host=True)
    entering = kept[:N * S * HV * K * K].view(N, S, HV, K, K)
    assert not entering.isnan().any()
    for n in range(N):
        c0, c1 = int(cc[n]), int(cc[n + 1])
        per = -(-(c1 - c0) // S)
        for s in range(S):
            done = min(s * per, c1 - c0)                  # the sequence's chunks before segment s
            if done == 0:
                want = h0[n].double()
            else:
                r0, r1 = int(table[c0, 2]), int(table[c0 + done - 1, 2] + table[c0 + done - 1, 3])
                x = [t[:, r0:r1].double() for t in (q, k, v, g, beta)]
                _, want = reference_gdr(*x, scale=K ** -0.5, initial_state=h0[n:n + 1].double(),
                                        cu_seqlens=torch.tensor([0, r1 - r0]), use_qk_l2norm_in_kernel=True)
                want = want[0]
            assert rel_err(entering[n, s], want) <= BUDGETS[torch.float32]["state"], (n, s)


def _entry_args(T=5, N=1, H=1, HV=2, raw=False):
    """A complete, valid argument set of _C.chunk_gdr_fwd_sm90_host (float32: the mirror), and the tensors."""
    cu = torch.tensor([0, T], dtype=torch.int32)
    table, cc = make_chunk_table(cu, None, T, 64)
    z = torch.zeros
    NC = table.shape[0]
    ts = dict(q=z(T, H, K), k=z(T, H, K), v=z(T, HV, K), g=z(T, HV), beta=z(T, HV), A_log=z(HV), dt_bias=z(HV),
              table=table, cu_chunks=cc, initial_state=z(N, HV, K, K), final_state=z(N, HV, K, K), o=z(T, HV, K),
              kept_gates=z(NC, HV, 5, 64), kept_eg_last=z(NC, HV), kept_rn=z(NC, HV, 2, 64),
              kept_ts=z(NC, HV, 64, 64), kept_mm=z(NC, HV, 64, 64), kept_entering=z(2 * N, HV, K, K))
    args = {n: t.data_ptr() for n, t in ts.items()}
    args.update(kept_segments=2, prep_gates=None, prep_eg_last=None, prep_ts=None, prep_mm=None, NC=NC, N=N, T=T,
                H=H, HV=HV, K=K, V=K, chunk_size=64, dtype=0, scale=0.1, l2norm=True, raw_gates=raw, split=False,
                pairs=False)
    return args, ts


def test_entry_point_names_its_arguments():
    """_C.chunk_gdr_fwd_sm90(_host) takes the declared keywords only; a required pointer passed as None is
    a ValueError naming it before anything runs (A_log, dt_bias only with raw_gates; initial_state and
    final_state are optional; the five kept_* pointers of prep are too, but come together or not at all;
    kept_entering is too, with kept_segments >= 1; so are the four prep_* inputs of the state-only kernel,
    together, with NC >= 1 and never with kept_* or split)."""
    C = _cext.get_C()
    args, keep = _entry_args()
    doc = "chunk_gdr_fwd_sm90_host(*, " + ", ".join(args) + ")"
    assert doc in C.chunk_gdr_fwd_sm90_host.__doc__.splitlines()
    C.chunk_gdr_fwd_sm90_host(**args)
    for name in ("q", "k", "v", "g", "beta", "table", "cu_chunks", "o"):
        with pytest.raises(ValueError, match=f"^chunk_gdr_fwd_sm90_host\\(\\): argument '{name}' "):
            C.chunk_gdr_fwd_sm90_host(**dict(args, **{name: None}))
    for name in ("A_log", "dt_bias"):
        C.chunk_gdr_fwd_sm90_host(**dict(args, **{name: None}))
        with pytest.raises(ValueError, match=f"argument '{name}' "):
            C.chunk_gdr_fwd_sm90_host(**dict(args, raw_gates=True, **{name: None}))
    C.chunk_gdr_fwd_sm90_host(**dict(args, initial_state=None, final_state=None))
    kept = [n for n in args if n.startswith("kept_") and n not in ("kept_entering", "kept_segments")]
    C.chunk_gdr_fwd_sm90_host(**dict(args, **{n: None for n in kept}))
    C.chunk_gdr_fwd_sm90_host(**dict(args, kept_entering=None, kept_segments=0))
    with pytest.raises(ValueError, match=r"kept_entering needs kept_segments in \[1, 2\^31\)"):
        C.chunk_gdr_fwd_sm90_host(**dict(args, kept_segments=0))
    for name in kept:
        with pytest.raises(ValueError, match="kept_gates, kept_eg_last, kept_rn, kept_ts and kept_mm come together"):
            C.chunk_gdr_fwd_sm90_host(**dict(args, **{name: None}))
    prep = {f"prep_{n}": args[f"kept_{n}"] for n in ("gates", "eg_last", "ts", "mm")}
    no_kept = {n: None for n in kept}
    C.chunk_gdr_fwd_sm90_host(**dict(args, **no_kept, **prep))          # the state-only kernel's inputs
    for name in prep:
        with pytest.raises(ValueError, match="prep_gates, prep_eg_last, prep_ts and prep_mm come together"):
            C.chunk_gdr_fwd_sm90_host(**dict(args, **no_kept, **dict(prep, **{name: None})))
    with pytest.raises(ValueError, match="prep_.* and kept_gates .. kept_mm exclude each other"):
        C.chunk_gdr_fwd_sm90_host(**dict(args, **prep))
    with pytest.raises(ValueError, match=r"split \(prep in the kernel's own prep CTAs\) and prep_\* .* exclude"):
        C.chunk_gdr_fwd_sm90_host(**dict(args, **no_kept, **prep, split=True))
    C.chunk_gdr_fwd_sm90_host(**dict(args, split=True))                 # the split kernel's tile program
    C.chunk_gdr_fwd_sm90_host(**dict(args, split=True, pairs=True))   # (H 1, HV 2: a pair)
    C.chunk_gdr_fwd_sm90_host(**dict(args, pairs=True))               # (the fused kernel's pair form)
    for bad in (dict(pairs=True, HV=1, H=1), dict(split=True, pairs=True, HV=1, H=1),
                dict(args, **no_kept, **prep, pairs=True)):
        with pytest.raises(ValueError, match=r"pairs needs the fused or split kernel \(no prep_\*\) and an even"):
            C.chunk_gdr_fwd_sm90_host(**dict(args, **bad))
    with pytest.raises(ValueError, match="prep_\\* need NC >= 1"):
        C.chunk_gdr_fwd_sm90_host(**dict(args, **no_kept, **prep, NC=0))
    with pytest.raises(TypeError, match="unexpected keyword argument 'cu_chunk'"):
        C.chunk_gdr_fwd_sm90_host(**{("cu_chunk" if n == "cu_chunks" else n): x for n, x in args.items()})
    with pytest.raises(ValueError, match="K and V must be 128"):
        C.chunk_gdr_fwd_sm90_host(**dict(args, K=64))


def test_bench_skips_what_the_cuda_kernel_refuses(monkeypatch):
    """python -m bench: inputs the cuda kernel does not take (float32, K = 64) make ours-cuda's gate and
    cases skipped with the refusal's reason, not failed; the gate runs at K = V = 128, the kernel's one
    head size. (The op stands in by raising gdn_packed.cuda.chunk.refusal's error, as it does on a GPU.)"""
    from bench import gdr, runner
    from bench.common import Skip
    from bench.providers import PROVIDERS
    from gdn_packed.cuda.chunk import refusal
    seen = []

    def op(q, k, v, g, beta, **kw):
        seen.append((q.shape[-1], v.shape[-1], q.dtype))
        err = refusal(q, v, q.device, None if kw["cu_seqlens"] is None else kw["cu_seqlens"].numel() - 1)
        if err is not None:
            raise err
        return (v,)
    monkeypatch.setattr(gdn_packed, "chunk_gated_delta_rule", op)
    p = PROVIDERS["gdr"]["ours-cuda"]
    status, err, detail = runner._gate(p, torch.device("cpu"), torch.float32, False)
    assert (status, err) == ("skipped", None) and "torch.float32" in detail and "backend='triton'" in detail
    assert seen == [(K, K, torch.float32)]
    xs, cu = gdr.make_inputs(1, 2, 64, 64, (5, 9), torch.bfloat16, torch.device("cpu"))
    with pytest.raises(Skip, match="K = 64"):
        gdr.varlen_call(p)(*xs, cu)
    xs, cu = gdr.make_inputs(1, 2, K, K, (5, 9), torch.bfloat16, torch.device("cpu"))
    assert gdr.varlen_call(p)(*xs, cu) is xs[2]      # taken: the op's output
