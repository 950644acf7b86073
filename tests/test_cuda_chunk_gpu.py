"""The sm_90a chunked forward on the device (an H100 / H200; tools/gpu_check.py runs these): the kernel
itself, not its host mirror, which cannot check the fragment layouts, GMMA descriptors, TMA boxes,
mbarrier phases, the cluster's copies or setmaxnreg (docs/DESIGN.md section 10):
  - o and the final state against the float64 reference on every packing of PACKINGS (bf16; fp16 on
    two: the budgets of docs/DESIGN.md section 7) and against the mirror on the same inputs; padding rows
    exactly 0 with NaN-poisoned outputs; NaN in the inputs' padding rows changes nothing;
  - long sequences (the TMA ring and the prep buffers wrap around many times; a partial last chunk)
    against backend="triton"; bit-identical reruns;
  - the gates from raw a, b in the kernel; autograd through backend="cuda" = the Triton backward on the
    prep outputs the kernel kept (against its host mirror's and Triton prep's);
  - each of the above for the three forward kernels (fwd_kernel): the fused one (on these GVA pairs
    chunk_gdr_fwd_sm90_pair_kernel, and without pairs chunk_gdr_fwd_sm90_kernel, tested on its own), the
    split one (prep CTAs beside the state CTAs; on these GVA pairs chunk_gdr_fwd_sm90_split_pair_kernel, and
    without pairs chunk_gdr_fwd_sm90_split_kernel, tested on its own) and, after Triton prep, the state-only one
    (chunk_gdr_fwd_sm90_state_kernel; its kept prep is Triton prep's own, so the kept-prep test takes the
    other two);
  - the backward's reverse dS pass (csrc/chunk_gdr_bwd_sm90.cu) on Triton prep's outputs against the
    Triton pass it replaces and its host mirror, on every packing and on long sequences (fp16 too),
    bit-identical reruns;
  - the backward's chunk-parallel gradients (csrc/chunk_gdr_grads_sm90.cu) inside the Triton backward
    against the Triton kernels they replace and the host mirror, the same way.
The forward hung on its first GPU (an H200, 2026-12-04): test_forward_finishes runs it once in a child
process with a timeout, and while that fails every forward test fails at once without a launch (a hung
kernel would hold the GPU for the rest of the run). Without such a GPU every test here is a visible skip."""
import functools
import subprocess
import sys

import pytest
import torch

import gdn_packed
from gdn_packed import _cext
from gdn_packed.testing import (BUDGETS, PACKINGS, Packing, case_id, gdr_inputs, poisoned_outputs, real_rows,
                                reference_gdr, rel_err)


def _why_not():
    why = _cext.cuda_unavailable_reason() or ("" if torch.cuda.is_available() else "torch has no CUDA")
    if not why and not hasattr(_cext.get_C(), "chunk_gdr_fwd_sm90"):
        why = f"gdn_packed._C has no sm_90a chunked kernel: {_cext.get_C().chunk_gdr_fwd_sm90_missing}"
    if not why and torch.cuda.get_device_capability()[0] != 9:
        why = f"{torch.cuda.get_device_name()} is not an sm_90 GPU"
    return why


WHY = _why_not()
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"no sm_90 GPU (H100 / H200) here: {WHY}")
H, HV, K = 1, 2, 128
IDS = [case_id(p, f"H{H}x{HV}", f"K{K}") for p in PACKINGS]


def inputs(packing, dtype, seed, poison=False):
    cu, cu_pad, rows = packing.layout()
    x = gdr_inputs(rows, H, HV, K, K, dtype, N=len(packing.lengths), initial_state=True, unit_k=False, seed=seed)
    pad = ~real_rows(cu, cu_pad, rows)
    if poison:
        for t in x[:3]:
            t[0, pad] = float("nan")
    return x, cu, cu_pad, pad


PROBE = "from gdn_packed.testing import cuda_forward_probe\ncuda_forward_probe()\nprint('FINISHED')"


@functools.lru_cache(maxsize=1)
def forward_hangs():
    """'' when the forward finishes one 64-token sequence in a child process within 60 s, else why not.
    It hung on an H200 on 2026-12-04 (bench/NOTES.md "First GPU run"); a hung kernel holds the GPU until
    its process dies, so no test launches it in this process before the child has finished."""
    try:
        r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "the sm_90a forward did not finish one 64-token sequence within 60 s (a hang)"
    return "" if "FINISHED" in r.stdout else f"the probe failed: {r.stderr.strip()[-300:]}"


def test_forward_finishes():
    why = forward_hangs()
    assert not why, why


@pytest.mark.parametrize("pairs", [False, True], ids=["clusters-of-4", "pairs-clusters-of-8"])
def test_split_kernel_clusters_are_counted(pairs, report_table):
    """The split kernel's clusters the GPU holds at once (cudaOccupancyMaxActiveClusters, which
    forward_kernel bounds the split kernel by): a positive count of at most SMs / 4 (/ 8 on GVA pairs; GPC
    placement can make it fewer: the anchor's 32 (16) clusters then take two waves and the rule picks the
    fused kernel)."""
    from gdn_packed.cuda.chunk import split_clusters
    sms, size = torch.cuda.get_device_properties(0).multi_processor_count, 8 if pairs else 4
    n = split_clusters(0, pairs)
    report_table("sm_90a split forward kernel, resident clusters", f"{torch.cuda.get_device_name(0)}: {n} of {size} "
                                                                   f"(SMs {sms}, SMs / {size} = {sms // size})")
    assert 0 < n <= sms // size, (n, sms)


@pytest.fixture(params=["fused", "split", "state"])
def fwd_kernel(request, monkeypatch):
    """The forward kernel backend='cuda' runs here (gdn_packed.cuda.chunk.KERNELS; forward_kernel forced:
    it would pick the split one for these few heads)."""
    from gdn_packed.cuda import chunk as cuda_chunk
    monkeypatch.setattr(cuda_chunk, "forward_kernel", lambda *a: request.param)
    return request.param


def run(x, cu, cu_pad, backend, device="cuda"):
    if backend == "cuda" and forward_hangs():
        pytest.fail(f"not launched: {forward_hangs()}")
    q, k, v, g, beta, h0 = (t.to(device) for t in x)
    with poisoned_outputs():
        o, fs = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  cu_seqlens=cu.to(device),
                                                  cu_seqlens_padded=None if cu_pad is None else cu_pad.to(device),
                                                  use_qk_l2norm_in_kernel=True, backend=backend)
    return o.cpu(), fs.cpu()


def mirror(x, cu, cu_pad):
    from gdn_packed.cuda.chunk import chunk_gdr_fwd_cuda
    from gdn_packed.ops.chunk_table import make_chunk_table
    q, k, v, g, beta, h0 = x
    table, cc = make_chunk_table(cu, cu_pad, q.shape[1], 64)
    o, fs = torch.full_like(v[0], float("nan")), torch.full(h0.shape, float("nan"))
    chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, K ** -0.5, 64, True, o, fs, host=True)
    return o[None], fs


@pytest.mark.parametrize("pi, dtype", [(pi, torch.bfloat16) for pi in range(len(PACKINGS))]
                         + [(pi, torch.float16) for pi in (1, 5)],
                         ids=[f"{i}-bf16" for i in IDS] + [f"{IDS[pi]}-fp16" for pi in (1, 5)])
def test_kernel_matches_float64_and_the_mirror(pi, dtype, fwd_kernel):
    x, cu, cu_pad, pad = inputs(PACKINGS[pi], dtype, pi)
    o, fs = run(x, cu, cu_pad, "cuda")
    clean = [torch.where(pad[None, :, None, None], 0.0, t.double()) for t in x[:3]]
    ro, rf = reference_gdr(*clean, x[3].double(), x[4].double(), initial_state=x[5].double(), cu_seqlens=cu,
                           cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=True)
    b = BUDGETS[dtype]
    assert torch.isfinite(o).all() and torch.isfinite(fs).all() and (o[0, pad] == 0).all()
    assert rel_err(o, ro) <= b["o"] and rel_err(fs, rf) <= b["state"], (rel_err(o, ro), rel_err(fs, rf))
    mo, mf = mirror(x, cu, cu_pad)        # the same tile program on the CPU: a layout bug shows as O(1)
    assert rel_err(o, mo.double()) <= 1e-2 and rel_err(fs, mf.double()) <= 1e-2, (rel_err(o, mo.double()),
                                                                                     rel_err(fs, mf.double()))


@pytest.mark.parametrize("kernel", ["fused", "split"])
@pytest.mark.parametrize("pi", [1, 2, 5], ids=[IDS[i] for i in (1, 2, 5)])
def test_kernels_without_value_head_pairs(pi, kernel, monkeypatch):
    """The fused and split kernels where the value heads do not pair (H = HV = 2: clusters of 2,
    chunk_gdr_fwd_sm90_kernel, and of 4, chunk_gdr_fwd_sm90_split_kernel; the tests above, GVA 2:1, run
    their pair forms, clusters of 4 and 8): o and the final state within the bf16 budgets of float64,
    padding rows 0."""
    from gdn_packed.cuda import chunk as cuda_chunk
    monkeypatch.setattr(cuda_chunk, "forward_kernel", lambda *a: kernel)
    p = PACKINGS[pi]
    cu, cu_pad, rows = p.layout()
    x = gdr_inputs(rows, 2, 2, K, K, torch.bfloat16, N=len(p.lengths), initial_state=True, unit_k=False, seed=pi)
    pad = ~real_rows(cu, cu_pad, rows)
    o, fs = run(x, cu, cu_pad, "cuda")
    clean = [torch.where(pad[None, :, None, None], 0.0, t.double()) for t in x[:3]]
    ro, rf = reference_gdr(*clean, x[3].double(), x[4].double(), initial_state=x[5].double(), cu_seqlens=cu,
                           cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=True)
    b = BUDGETS[torch.bfloat16]
    assert torch.isfinite(o).all() and (o[0, pad] == 0).all()
    assert rel_err(o, ro) <= b["o"] and rel_err(fs, rf) <= b["state"], (rel_err(o, ro), rel_err(fs, rf))


@pytest.mark.parametrize("pi", [2, 3], ids=[IDS[2], IDS[3]])
def test_nan_in_padding_rows_changes_nothing(pi, fwd_kernel):
    x, cu, cu_pad, pad = inputs(PACKINGS[pi], torch.bfloat16, pi)
    xp, *_ = inputs(PACKINGS[pi], torch.bfloat16, pi, poison=True)
    (o, fs), (op, fsp) = run(x, cu, cu_pad, "cuda"), run(xp, cu, cu_pad, "cuda")
    assert torch.equal(o, op) and torch.equal(fs, fsp) and (op[0, pad] == 0).all()


LONG = [Packing("long", [4096 + 17]), Packing("long-mixed", [1500, 64, 2049, 1], gaps=[5, 0, 64, 3], tail=40)]


@pytest.mark.parametrize("packing", LONG, ids=[p.name for p in LONG])
def test_long_sequences_match_triton_and_rerun_bit_identical(packing, fwd_kernel):
    """Hundreds of chunks a sequence: the 3-stage ring, the 4 prep buffers and the two CTAs' alternating
    preps (the state-only kernel's Ts / M multicasts) wrap around many times; against backend="triton" (within twice the bf16 budget of either from
    the other) and a second run of the kernel (bit-identical)."""
    x, cu, cu_pad, pad = inputs(packing, torch.bfloat16, 5)
    o, fs = run(x, cu, cu_pad, "cuda")
    to, tf = run(x, cu, cu_pad, "triton")
    assert rel_err(o, to.double()) <= BUDGETS[torch.bfloat16]["o"] and rel_err(fs, tf.double()) <= 2e-2
    assert (o[0, pad] == 0).all()
    o2, fs2 = run(x, cu, cu_pad, "cuda")
    assert torch.equal(o, o2) and torch.equal(fs, fs2)


def kept_prep(x, cu, cu_pad, device, kernel="fused"):
    """(Prep of the sequences' chunk slots the forward keeps for the backward, a mask of those slots, the
    chunk table, the states entering the segments [N S, HV, K, V] or None): the cuda forward with kept (the
    kernel on `device`, its host mirror on "cpu"), `kernel` one of gdn_packed.cuda.chunk.KERNELS."""
    from gdn_packed.cuda.chunk import _kept_parts, chunk_gdr_fwd_cuda, kept_shape
    from gdn_packed.ops.chunk_table import make_chunk_table
    q, k, v, g, beta, h0 = (t.to(device) for t in x)
    table, cc = make_chunk_table(cu.to(device), None if cu_pad is None else cu_pad.to(device), q.shape[1], 64)
    N = h0.shape[0]
    (words,) = kept_shape(q.shape[1], N, HV, K, K, 64, torch.device(device), q.dtype)
    kept = torch.full((words,), float("nan"), device=device)
    o, fs = torch.empty_like(v[0]), torch.empty(h0.shape, device=device)
    chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, h0, K ** -0.5, 64, True, o, fs, kept=kept,
                       host=device == "cpu", kernel=kernel)
    entering, prep = _kept_parts(kept, q.shape[1], N, table.shape[0], HV, q.dtype, torch.device(device))
    return (type(prep)(*(t.cpu() for t in prep)), (torch.arange(table.shape[0]) < int(cc[-1])), table.cpu(),
            None if entering is None else entering.cpu())


@pytest.mark.parametrize("kernel", ["fused", "split"])
@pytest.mark.parametrize("pi", range(len(PACKINGS)), ids=IDS)
def test_kept_prep_matches_the_mirror_and_triton_prep(pi, kernel):
    """With kept (the forward under autograd), the kernel's prep writes its outputs of the sequences' chunk
    slots for the backward (Ts, M unswizzled from their shared-memory tiles, the gate rows and row factors):
    against its host mirror on the same inputs (a layout or swizzle bug shows as O(1); the same arithmetic
    but the tensor cores' order: within 1e-2) and Triton prep's (chunk_fwd_prep, whose values the Triton
    backward otherwise takes: within one bf16 rounding of Ts, M, 1e-4 of the rest); slots of no chunk
    untouched. Both kernels that prep themselves: the fused kernel's prep warpgroups, the split kernel's
    prep CTAs."""
    if forward_hangs():
        pytest.fail(f"not launched: {forward_hangs()}")
    from gdn_packed.triton import chunk as triton_chunk
    x, cu, cu_pad, _ = inputs(PACKINGS[pi], torch.bfloat16, pi)
    got, used, table, _ = kept_prep(x, cu, cu_pad, "cuda", kernel)
    mir, _, _, _ = kept_prep(x, cu, cu_pad, "cpu")
    q, k, v, g, beta, _ = (t.cuda() for t in x)
    qr, kr, _, gr, br, rws = triton_chunk._rows(q[0], k[0], v[0], g[0], beta[0])
    tri = triton_chunk.chunk_fwd_prep(qr, kr, gr, br, table.cuda(), HV, K ** -0.5, True, rws)
    nan_word = torch.tensor(float("nan")).view(torch.int32)
    for name in ("ts", "mm", "gates", "rn", "eg_last"):
        a, m, t = getattr(got, name), getattr(mir, name)[used], getattr(tri, name).cpu()[used]
        assert (a[~used].contiguous().view(torch.int32) == nan_word).all(), name
        assert rel_err(a[used], m) <= 1e-2, (name, rel_err(a[used], m))
        assert rel_err(a[used], t) <= (2 ** -8 if name in ("ts", "mm") else 1e-4), (name, rel_err(a[used], t))


@pytest.mark.parametrize("pi", [1, 2, 5, 6], ids=[IDS[i] for i in (1, 2, 5, 6)])
def test_kept_entering_states_match_the_mirror(pi, fwd_kernel, monkeypatch):
    """With kept and the Triton state pass in 3 segments (fwd_segments forced), the kernel's state
    warpgroups store the state entering every segment of every sequence (the final state for the empty
    ones), from which the backward's recompute starts them: against the host mirror's (within the fp32
    state budget's 2e-2 of bf16 inputs: the same arithmetic, the tensor cores' order), every word written."""
    if forward_hangs():
        pytest.fail(f"not launched: {forward_hangs()}")
    from gdn_packed.triton import chunk as triton_chunk
    monkeypatch.setattr(triton_chunk, "fwd_segments", lambda *a, **kw: 3)
    x, cu, cu_pad, _ = inputs(PACKINGS[pi], torch.bfloat16, pi)
    *_, got = kept_prep(x, cu, cu_pad, "cuda", fwd_kernel)
    *_, mir = kept_prep(x, cu, cu_pad, "cpu")
    assert got.shape == mir.shape == (3 * x[5].shape[0], HV, K, K) and not got.isnan().any()
    assert rel_err(got, mir.double()) <= 2e-2


@pytest.mark.parametrize("segments", [1, 3])
def test_raw_gates_and_autograd_through_the_triton_backward(segments, fwd_kernel, monkeypatch):
    """With A_log, dt_bias the kernel forms the gates itself (no gate launch): o within the bf16 budget of
    backend="triton"'s; the gradients of every input for the same cotangents within the bf16 gradient
    budget of triton's (the same backward on the same saved inputs, but for the sm_90a dS pass and the
    prep outputs: the cuda forward keeps its kernel's, the triton forward Triton prep's). With the Triton
    state pass in 3 segments (forced), the cuda forward keeps the segments' entering states too and the
    backward's recompute starts from them."""
    from gdn_packed.triton import chunk as triton_chunk
    monkeypatch.setattr(triton_chunk, "state_segments", lambda *a, **kw: segments)
    x, cu, cu_pad, _ = inputs(PACKINGS[2], torch.bfloat16, 3)
    dev = "cuda"
    if forward_hangs():
        pytest.fail(f"not launched: {forward_hangs()}")
    got = {}
    for backend in ("cuda", "triton"):
        leaves = [t.to(dev).requires_grad_() for t in x]
        gates = [torch.tensor([0.3, -1.0], device=dev, requires_grad=True),
                 torch.tensor([0.5, 1.5], device=dev, requires_grad=True)]
        o, fs = gdn_packed.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                  cu_seqlens=cu.to(dev), cu_seqlens_padded=cu_pad.to(dev),
                                                  use_qk_l2norm_in_kernel=True, A_log=gates[0], dt_bias=gates[1],
                                                  backend=backend)
        grads = torch.autograd.grad([o, fs], leaves + gates, [torch.ones_like(o), torch.ones_like(fs)])
        got[backend] = (o.detach().cpu(), grads)
    assert rel_err(got["cuda"][0], got["triton"][0].double()) <= BUDGETS[torch.bfloat16]["o"]
    for a, b in zip(got["cuda"][1], got["triton"][1]):
        assert rel_err(a.cpu(), b.cpu().double()) <= BUDGETS[torch.bfloat16]["grad"]



@pytest.mark.parametrize("pi", [2, len(PACKINGS) - 1], ids=[IDS[2], IDS[-1]])
def test_recompute_beside_the_dstate_pass_is_bit_identical(pi, monkeypatch):
    """The backward of backend="cuda" runs the recompute on a side stream beside its dS pass
    (gdn_packed._runtime.fork in gdn_packed.triton.chunk._bwd_heads): the recompute is launched on another
    stream than the dS pass, and every gradient is bit-identical to the same backward with the fork
    replaced by program order on one stream (the kernels are the same; only their overlap differs)."""
    from gdn_packed import _runtime
    from gdn_packed.triton import chunk as triton_chunk
    if forward_hangs():
        pytest.fail(f"not launched: {forward_hangs()}")
    x, cu, cu_pad, _ = inputs(PACKINGS[pi], torch.bfloat16, 5)
    streams, real_state = [], triton_chunk.chunk_fwd_state

    def state(*a, **kw):
        streams.append(torch.cuda.current_stream().cuda_stream)
        return real_state(*a, **kw)
    monkeypatch.setattr(triton_chunk, "chunk_fwd_state", state)

    def grads():
        leaves = [t.cuda().requires_grad_() for t in x]
        o, fs = gdn_packed.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                  cu_seqlens=cu.cuda(), cu_seqlens_padded=cu_pad.cuda(),
                                                  backend="cuda")
        main = torch.cuda.current_stream().cuda_stream
        out = torch.autograd.grad([o, fs], leaves, [torch.ones_like(o), torch.ones_like(fs)])
        torch.cuda.synchronize()
        return main, [g.cpu() for g in out]
    main, forked = grads()
    assert streams and streams[-1] != main
    real_fork = _runtime.fork
    with monkeypatch.context() as m:
        m.setattr(_runtime, "fork", lambda device: real_fork(torch.device("cpu")))
        main, serial = grads()
    assert streams[-1] == main
    for a, b in zip(forked, serial):
        assert torch.equal(a, b)


# ---- the backward's reverse dS pass (csrc/chunk_gdr_bwd_sm90.cu; helpers: tests/test_cuda_chunk_bwd.py) ----

@pytest.mark.parametrize("pi", range(len(PACKINGS)), ids=IDS)
def test_dstate_kernel_matches_triton_and_the_mirror(pi):
    """The sm_90a dS pass on every packing (bf16), against the Triton pass it replaces (within the bf16
    gradient budget: the same products, rounded at the same points) and its host mirror on the same prep
    (a layout bug shows as O(1)); the padding rows exactly 0, nothing else of dq, dk, dg, dbeta written."""
    from test_cuda_chunk_bwd import assert_dstate_close, dstate_pass
    got, used, pad = dstate_pass(PACKINGS[pi], torch.bfloat16, pi, "cuda")
    tri, _, _ = dstate_pass(PACKINGS[pi], torch.bfloat16, pi, "triton")
    mir, _, _ = dstate_pass(PACKINGS[pi], torch.bfloat16, pi, "mirror")
    assert_dstate_close(got, tri, used, pad, BUDGETS[torch.bfloat16]["grad"])
    assert_dstate_close(got, mir, used, pad, 1e-2)


@pytest.mark.parametrize("pi", range(len(PACKINGS)), ids=IDS)
def test_dstate_kernel_on_gva_pairs_is_bit_identical(pi):
    """The dS pass's two forms (GVA 1:2 here): clusters of 4, the pair's CTAs sharing each k / q load, and
    clusters of 2, each loading its own: the same products in the same order, so every output is
    bit-identical (the sharing is only in which CTA's producer loads a K-half)."""
    from test_cuda_chunk_bwd import dstate_pass
    pair, _, _ = dstate_pass(PACKINGS[pi], torch.bfloat16, pi, "cuda", pairs=True)
    single, _, _ = dstate_pass(PACKINGS[pi], torch.bfloat16, pi, "cuda", pairs=False)
    for n in pair:
        assert torch.equal(pair[n].isnan(), single[n].isnan()), n
        assert torch.equal(pair[n].nan_to_num(), single[n].nan_to_num()), n


@pytest.mark.parametrize("packing", LONG, ids=[p.name for p in LONG])
def test_dstate_long_sequences_match_triton_and_rerun_bit_identical(packing):
    """Hundreds of chunks a sequence (the ring wraps around many times; the Triton pass runs in segments
    there) and fp16: against the Triton pass, and a second run of the kernel (bit-identical)."""
    from test_cuda_chunk_bwd import assert_dstate_close, dstate_pass
    for dtype in (torch.bfloat16, torch.float16):
        got, used, pad = dstate_pass(packing, dtype, 5, "cuda")
        tri, _, _ = dstate_pass(packing, dtype, 5, "triton")
        assert_dstate_close(got, tri, used, pad, BUDGETS[dtype]["grad"])
        again, _, _ = dstate_pass(packing, dtype, 5, "cuda")
        assert all(torch.equal(got[n], again[n]) or (got[n].isnan() == again[n].isnan()).all()
                   and torch.equal(got[n].nan_to_num(), again[n].nan_to_num()) for n in got)


# ---- the backward's chunk-parallel gradients (csrc/chunk_gdr_grads_sm90.cu) ----

def grads_backward(packing, dtype, seed, impl, poison=False):
    """The Triton backward on the GPU (l2norm, h0, dht) with its P, dq, A and dk kernels ("triton"), or with
    the sm_90a gradient kernel as its `grads` ("cuda"), or with that kernel's host mirror on CPU copies of the
    same arguments ("mirror"): dq, dk, dg, dbeta as CPU tensors, and the padding rows. poison: NaN in the
    padding rows of q, k, v and dO."""
    from gdn_packed.cuda.chunk import chunk_bwd_grads_cuda
    from gdn_packed.ops.chunk_table import make_chunk_table
    from gdn_packed.triton.chunk import Prep, chunk_gdr_bwd_triton
    (q, k, v, g, beta, h0), cu, cu_pad, pad = inputs(packing, dtype, seed, poison)
    q, k, v, g, beta = (t[0].cuda() for t in (q, k, v, g, beta))
    h0 = h0.cuda()
    gen = torch.Generator().manual_seed(seed + 100)
    do, dht = torch.randn(v.shape, generator=gen).to(dtype).cuda(), torch.randn(h0.shape, generator=gen).cuda()
    if poison:
        do[pad.cuda()] = float("nan")
    table, cc = make_chunk_table(cu.cuda(), None if cu_pad is None else cu_pad.cuda(), q.shape[0], 64)

    def mirror(*args):
        cpu = [Prep(*(None if t is None else t.cpu() for t in a)) if isinstance(a, Prep) else
               a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        chunk_bwd_grads_cuda(*cpu, host=True)
        for a, c in zip(args[12:], cpu[12:]):          # dq, dk, dg_part, dbeta_part
            a.copy_(c)

    hook = {"triton": None, "cuda": chunk_bwd_grads_cuda, "mirror": mirror}[impl]
    out = [torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda") for x in (q, k, v, g, beta)]
    dh0 = torch.full(h0.shape, float("nan"), device="cuda")
    chunk_gdr_bwd_triton(q, k, v, g, beta, table, cc, h0, K ** -0.5, 64, True, do, dht, *out, dh0, grads=hook)
    return [out[i].cpu() for i in (0, 1, 3, 4)], pad


@pytest.mark.parametrize("pi", range(len(PACKINGS)), ids=IDS)
def test_grads_kernel_matches_triton_and_the_mirror(pi):
    """The sm_90a chunk-parallel gradients on every packing (bf16) inside the Triton backward: dq, dk, dg,
    dbeta against the same backward with the Triton kernels it replaces (the bf16 gradient budget: its state
    products are exact where those round their gated operands to two) and against its host mirror on the
    same arguments (1e-3: the same products summed in other orders; a fragment layout or descriptor bug
    shows as O(1)); every row written, the padding rows 0."""
    got, pad = grads_backward(PACKINGS[pi], torch.bfloat16, pi, "cuda")
    tri, _ = grads_backward(PACKINGS[pi], torch.bfloat16, pi, "triton")
    mir, _ = grads_backward(PACKINGS[pi], torch.bfloat16, pi, "mirror")
    for name, a, b, m in zip(("dq", "dk", "dg", "dbeta"), got, tri, mir):
        assert not a.isnan().any() and torch.equal(a[pad], torch.zeros_like(a[pad])), name
        assert rel_err(a, b.double()) <= BUDGETS[torch.bfloat16]["grad"], (name, rel_err(a, b.double()))
        assert rel_err(a, m.double()) <= 1e-3, (name, rel_err(a, m.double()))


@pytest.mark.parametrize("packing", LONG, ids=[p.name for p in LONG])
def test_grads_long_sequences_match_triton_and_rerun_bit_identical(packing):
    """Hundreds of chunk slots (a CTA per slot and qk head), bf16 and fp16: against the Triton kernels, and a
    second run (bit-identical: no atomics, every sum in a fixed order)."""
    for dtype in (torch.bfloat16, torch.float16):
        got, _ = grads_backward(packing, dtype, 5, "cuda")
        tri, _ = grads_backward(packing, dtype, 5, "triton")
        again, _ = grads_backward(packing, dtype, 5, "cuda")
        for name, a, b, c in zip(("dq", "dk", "dg", "dbeta"), got, tri, again):
            assert rel_err(a, b.double()) <= BUDGETS[dtype]["grad"], (name, dtype)
            assert torch.equal(a, c), (name, dtype)


@pytest.mark.parametrize("pi", [i for i, p in enumerate(PACKINGS) if p.has_padding],
                         ids=[IDS[i] for i, p in enumerate(PACKINGS) if p.has_padding])
def test_grads_nan_in_padding_rows_changes_nothing(pi):
    """NaN in the padding rows of q, k, v and dO (which the kernel's TMA boxes load beside a partial chunk's
    rows, and zeroes in shared memory): dq, dk, dg, dbeta bit-identical to the clean run's, padding rows 0."""
    got, pad = grads_backward(PACKINGS[pi], torch.bfloat16, pi, "cuda", poison=True)
    clean, _ = grads_backward(PACKINGS[pi], torch.bfloat16, pi, "cuda")
    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), got, clean):
        assert torch.equal(a, b), name
        assert torch.equal(a[pad], torch.zeros_like(a[pad])), name
