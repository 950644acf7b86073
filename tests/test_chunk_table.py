"""The chunk table: one specification test over the backends that run here - torch, the csrc/
kernels' host mirror (the same __host__ __device__ bodies in a CPU loop through _C.chunk_table_host)
and, on a GPU, the CUDA kernels - against a plain-Python transcription of the contract, on the shared
packings (gdn_packed.testing.PACKINGS), the table's own edge cases and corrupt packings."""
import ast
import bisect
import inspect
import random

import pytest
import torch

from gdn_packed import _cext
from gdn_packed._runtime import device_schedule
from gdn_packed.cuda.launch import launch
from gdn_packed.ops import chunk_table as op_mod
from gdn_packed.ops.chunk_table import build_chunk_table
from gdn_packed.testing import PACKINGS, layout

from cuda_backends import backends, gpu_reason, host_reason

INT32_MAX = 2**31 - 1
SENTINEL = 0x5A5A5A5A
BACKENDS = backends()
needs_C = pytest.mark.skipif(bool(host_reason()), reason=host_reason())


def chunk_table_torch(*args):
    from gdn_packed.torch_ref.chunk_table import chunk_table_torch as f
    return f(*args)


# ---- plain-Python transcription of the contract ------------------------------------------------
def ref_chunk_table(cu, padded, T, C):
    N = len(cu) - 1
    NC = T // C + N
    base = cu if padded is None else padded
    lens = [max(cu[i + 1] - cu[i], 0) for i in range(N)]
    cc = [0]
    for n in lens:
        cc.append(cc[-1] + -(-n // C))
    cc = [min(x, NC) for x in cc]
    table = []
    for j in range(NC):
        if j >= cc[N]:
            table.append([-1, 0, 0, 0])
            continue
        i = bisect.bisect_right(cc, j) - 1  # the i with cc[i] <= j < cc[i+1]
        assert cc[i] <= j < cc[i + 1]
        idx = j - cc[i]
        start = base[i] + idx * C
        length = max(min(C, lens[i] - idx * C, T - start), 0) if 0 <= start < T else 0
        table.append([i, idx, max(min(start, INT32_MAX), -INT32_MAX), length])
    return table, cc


def host_chunk_table(cu, padded, T, C):
    """The csrc/ bodies on the host, into outputs filled with a sentinel (a slot nobody writes shows)."""
    N = cu.numel() - 1
    table = torch.full((T // C + N, 4), SENTINEL, dtype=torch.int32)
    cc = torch.full((N + 1,), SENTINEL, dtype=torch.int32)
    launch("chunk_table", cu.device, host=True, reads=dict(cu_seqlens=cu, cu_seqlens_padded=padded),
           writes=dict(table=table, cu_chunks=cc), index_int64=cu.dtype == torch.int64, N=N, T=T, chunk_size=C)
    return table, cc


def chunk_table(backend, cu, padded, T, C):
    """(table, cu_chunks) of one backend, on the CPU."""
    if backend == "torch":
        return chunk_table_torch(cu, padded, T, C)
    if backend == "host":
        return host_chunk_table(cu, padded, T, C)
    table, cc = build_chunk_table(cu.cuda(), None if padded is None else padded.cuda(), T, C)
    return table.cpu(), cc.cpu()


# ---- packings ------------------------------------------------------------------------------------
def _lists(cu, pad, rows):
    return cu.tolist(), None if pad is None else pad.tolist(), rows


def _lay(lengths, gaps=None, tail=0):
    return _lists(*layout(lengths, gaps=gaps, tail=tail, index_dtype=torch.int64))


def _random_packing(seed, n_max=12, padded=False):
    rng = random.Random(seed)
    n = rng.randint(0, n_max)
    lengths = [rng.choice([0, 1, 2, 63, 64, 65, 127, 128, 129, rng.randint(0, 300)]) for _ in range(n)]
    gaps = [rng.choice([0, 0, 1, 7, 64, 100]) for _ in range(n)] if padded else None
    return _lay(lengths, gaps, tail=rng.choice([0, 0, 3, 64, 200]))


# the shared packings, then the table's own edge cases
SANE = {p.name: _lists(*p.layout(torch.int64)) for p in PACKINGS}
SANE.update({
    "empty_T0": ([0], None, 0),
    "empty_rows": ([0], None, 100),
    "zero_len": ([0, 0], None, 0),
    "zero_len_tail": ([0, 0], None, 10),
    "odd_lengths": _lay([63, 64, 65, 127, 300]),
    "odd_lengths_tail": _lay([63, 64, 65, 127, 300], tail=81),
    "zeros_mixed": _lay([0, 5, 0, 0, 65, 0, 1, 0]),
    "padded_gaps": _lay([10, 65, 0, 300], gaps=[54, 63, 64, 28], tail=96),
    "padded_aligned": _lay([63, 64, 65, 127], gaps=[1, 0, 63, 1], tail=0),
    "padded_ones": _lay([1, 1, 1], gaps=[63, 63, 63], tail=5),
    "many_seqs": _lay([1 + (i * 37) % 150 for i in range(700)]),  # > one 512-thread scan tile
})
SANE.update({f"random{s}": _random_packing(s) for s in range(12)})
SANE.update({f"random_padded{s}": _random_packing(100 + s, padded=True) for s in range(12)})

CORRUPT = {
    "decreasing": ([0, 100, 50, 200], None, 200),
    "past_T": ([0, 100, 500], None, 200),
    "all_past_T": ([0, 1000, 2000], None, 100),
    "negative": ([0, -5, 10, 20], None, 30),
    "negative_start": ([-70, 10, 40], None, 50),
    "padded_past_T": ([0, 10, 20, 30], [0, 64, 5000, 6000], 128),
    "padded_negative": ([0, 70, 140], [-100, -20, 10], 160),
    "padded_decreasing": ([0, 64, 128, 192], [0, 500, 100, 50], 600),
    "last_offset_past_T": _lay([64, 64, 64])[0:1] + (None, 150),
    "more_chunks_than_slots": ([0, 1, 2, 3, 2000], None, 64),   # cu_chunks clamps at NC
    "int32_extremes": ([0, INT32_MAX, -2**31, INT32_MAX], None, 300),
}
HUGE64 = {  # only for int64; differences are still exact in int64 (no overflow in the torch path)
    "huge_len": ([0, 2**40, 2**40 + 5], None, 1000),
    "huge_padded": ([0, 64, 128], [2**40, -2**40, 5], 1000),
    "huge_start_clamped": ([0, 2**33], [2**31 + 7, 0], 2**20),
}

CHUNKS = [64, 16, 1]


def _cases(groups):
    out = []
    for group in groups:
        for name, (cu, pad, T) in group.items():
            out.append(pytest.param(cu, pad, T, id=name))
    return out


def _t(x, dtype):
    return None if x is None else torch.tensor(x, dtype=dtype)


def _check_invariants(table, cc, T, C, N):
    NC = T // C + N
    assert table.shape == (NC, 4) and table.dtype == torch.int32
    assert cc.shape == (N + 1,) and cc.dtype == torch.int32
    tl = table.tolist()
    for seq, idx, start, length in tl:
        assert 0 <= length <= C
        if length > 0:
            assert 0 <= start and start + length <= T, (seq, idx, start, length)


@pytest.mark.parametrize("C", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("cu,pad,T", _cases([SANE, CORRUPT]))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_python_reference(backend, cu, pad, T, dtype, C):
    table, cc = chunk_table(backend, _t(cu, dtype), _t(pad, dtype), T, C)
    ref_t, ref_cc = ref_chunk_table(cu, pad, T, C)
    assert cc.tolist() == ref_cc
    assert table.tolist() == ref_t
    _check_invariants(table, cc, T, C, len(cu) - 1)


@pytest.mark.parametrize("cu,pad,T", _cases([HUGE64]))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_python_reference_huge_int64(backend, cu, pad, T):
    table, cc = chunk_table(backend, _t(cu, torch.int64), _t(pad, torch.int64), T, 64)
    ref_t, ref_cc = ref_chunk_table(cu, pad, T, 64)
    assert cc.tolist() == ref_cc and table.tolist() == ref_t
    _check_invariants(table, cc, T, 64, len(cu) - 1)


@needs_C
@pytest.mark.parametrize("T, C, match", [(4, 0, "chunk_size must be positive"), (2**40, 1, "does not fit int32"),
                                         (-1, 64, "T must be >= 0")])
def test_host_rejects_bad_sizes(T, C, match):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out = torch.empty(8, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        _cext.get_C().chunk_table_host(cu_seqlens=cu.data_ptr(), cu_seqlens_padded=None, index_int64=False, N=1,
                                       T=T, chunk_size=C, table=out.data_ptr(), cu_chunks=out.data_ptr())


# ---- the op --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("name", ["odd_lengths_tail", "padded_gaps", "empty_rows", "zeros_mixed"])
def test_op_matches_and_opcheck(name, dtype):
    cu, pad, T = SANE[name]
    table, cc = build_chunk_table(_t(cu, dtype), _t(pad, dtype), T, 64)
    ref_t, ref_cc = ref_chunk_table(cu, pad, T, 64)
    assert table.tolist() == ref_t and cc.tolist() == ref_cc
    torch.library.opcheck(torch.ops.gdn_packed.chunk_table.default, (_t(cu, dtype), _t(pad, dtype), T, 64))
    trusted = torch.ops.gdn_packed.chunk_table(_t(cu, dtype), _t(pad, dtype), T, 64, trusted=True)
    assert trusted[0].tolist() == ref_t and trusted[1].tolist() == ref_cc
    torch.library.opcheck(torch.ops.gdn_packed.chunk_table.default, (_t(cu, dtype), _t(pad, dtype), T, 64),
                          {"trusted": True})


def test_op_checks_its_inputs_unless_trusted():
    """Called directly the op checks its inputs; trusted=True (a public op that checked them already)
    skips the metadata check, so chunk_gated_delta_rule checks cu_seqlens once per call."""
    with pytest.raises(TypeError, match="cu_seqlens"):
        torch.ops.gdn_packed.chunk_table(torch.tensor([0.0, 3.0]), None, 3, 64)
    calls = []
    import gdn_packed.ops.chunk_table as ct
    real_check = ct._check
    ct._check = lambda *a: calls.append(a) or real_check(*a)
    try:
        torch.ops.gdn_packed.chunk_table(_t([0, 3], torch.int32), None, 3, 64, trusted=True)
        assert calls == []
        torch.ops.gdn_packed.chunk_table(_t([0, 3], torch.int32), None, 3, 64)
        assert len(calls) == 1
    finally:
        ct._check = real_check


def test_op_compiles_without_graph_break():
    cu, pad, T = SANE["padded_gaps"]

    def f(cu_seqlens, padded):
        table, cc = build_chunk_table(cu_seqlens, padded, T, 64)
        return table[:, 3].sum() + cc[-1]

    cu_t, pad_t = _t(cu, torch.int32), _t(pad, torch.int32)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(cu_t, pad_t)
    assert int(got) == int(f(cu_t, pad_t))


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: build_chunk_table(torch.tensor([0.0, 1.0]), None, 4, 64), TypeError, "int32 or int64"),
    (lambda: build_chunk_table(torch.zeros(2, 2, dtype=torch.int32), None, 4, 64), ValueError, "shape"),
    (lambda: build_chunk_table(torch.zeros(0, dtype=torch.int32), None, 4, 64), ValueError, "at least 1"),
    (lambda: build_chunk_table(torch.tensor([0, 4]), torch.tensor([0, 4], dtype=torch.int32), 4, 64),
     TypeError, "cu_seqlens_padded"),
    (lambda: build_chunk_table(torch.tensor([0, 4]), torch.tensor([0, 4, 8]), 4, 64), ValueError,
     "cu_seqlens_padded"),
    (lambda: build_chunk_table(torch.tensor([0, 4]), None, 4, 0), ValueError, "chunk_size"),
    (lambda: build_chunk_table(torch.tensor([0, 4]), None, -1, 64), ValueError, "T must"),
    (lambda: build_chunk_table(torch.tensor([0, 4]), None, 2**40, 1), ValueError, "int32"),
])
def test_op_validates_arguments(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()


SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def test_op_never_syncs(monkeypatch):
    """At run time: no host read of any tensor while the op runs (CPU tensors on the device schedule,
    the CUDA path's Python around one _C call; on the host schedule CPU tensors get the value check,
    free there). Statically: no .item()/.tolist()/.cpu() in the op source."""
    cu, pad, T = SANE["padded_gaps"]
    cu_t, pad_t = _t(cu, torch.int64), _t(pad, torch.int64)
    chunk_table_torch(cu_t, pad_t, T, 64)  # import outside the patch

    def boom(self, *a, **k):
        raise AssertionError("host sync inside the chunk_table op")

    for m in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, m, boom)
    with device_schedule():
        table, cc = build_chunk_table(cu_t, pad_t, T, 64)
    monkeypatch.undo()
    assert cc.tolist() == ref_chunk_table(cu, pad, T, 64)[1]

    import gdn_packed.torch_ref.chunk_table as ref_mod
    for mod in (op_mod, ref_mod):
        tree = ast.parse(inspect.getsource(mod))
        calls = [n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr in ("item", "tolist", "cpu", "numpy")]
        assert not calls, f"{mod.__name__} calls {calls}"


# ---- GPU (runs only where a CUDA device and _C are usable) --------------------------------------
@pytest.mark.skipif(bool(gpu_reason()), reason=f"no GPU: {gpu_reason()}")
def test_cuda_kernel_graph_capture_and_side_stream():
    dev = torch.device("cuda")
    cu, pad, T = SANE["padded_gaps"]
    cu_t, pad_t = _t(cu, torch.int32).to(dev), _t(pad, torch.int32).to(dev)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        build_chunk_table(cu_t, pad_t, T, 64)  # warm-up on a side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        table, cc = build_chunk_table(cu_t, pad_t, T, 64)
    cu2, pad2, _ = _lay([1, 2, 3, 4], gaps=[60, 0, 5, 0])
    cu_t.copy_(torch.tensor(cu2, dtype=torch.int32))  # new packing, same N and T: replay rebuilds it
    pad_t.copy_(torch.tensor(pad2, dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    ref_t, ref_cc = chunk_table_torch(cu_t.cpu(), pad_t.cpu(), T, 64)
    assert torch.equal(table.cpu(), ref_t) and torch.equal(cc.cpu(), ref_cc)


# ---- the Triton kernels' rows of a run of slots without the table in the loop -------------------------
try:
    import triton
    import triton.language as tl

    from gdn_packed.triton.common import chunk_at, run_rows, segment_chunks
except ImportError:     # the test below says why it skips
    triton = None
else:
    @triton.jit
    def run_rows_kernel(table, cu_chunks, out, T_rows, S, C: tl.constexpr):
        n, s = tl.program_id(0), tl.program_id(1)
        lo, hi = segment_chunks(cu_chunks, n, s, S)
        first, end = run_rows(table, lo, hi, T_rows)
        for i in range(0, hi - lo):
            start, length = chunk_at(first, end, i, T_rows, C)
            j = (lo + i).to(tl.int64)
            tl.store(out + j * 2, start)
            tl.store(out + j * 2 + 1, length.to(tl.int64))


# many_seqs (the CUDA table's scan tiles: 700 sequences, ~20 s in the interpreter) and the T = 2^20 case (2^14+
# slots) left out; the int32 clamp cases run at T = 1000
RUN_ROWS_CASES = [p for p in _cases([SANE, CORRUPT, HUGE64]) if p.id != "many_seqs" and p.values[2] <= 2**16]


@pytest.mark.parametrize("cu,pad,T", RUN_ROWS_CASES)
def test_triton_run_rows_reproduce_the_table(cu, pad, T):
    """gdn_packed.triton.common.run_rows / chunk_at (pass A's rows of a segment's slots from two table rows,
    gdn_packed/triton/chunk_fwd.py) against the table itself, on every packing here, corrupt ones too, each
    sequence split into 1, 3 and 5 segments (empty segments among them): every slot's length exactly,
    its start where it has rows. A slot nobody visits keeps the sentinel; every visited slot is a real one."""
    from gdn_packed.ops._common import triton_usable
    if triton_usable(torch.device("cpu")):
        pytest.skip(triton_usable(torch.device("cpu")))
    C = 64      # the kernels' chunk
    table, cc = chunk_table_torch(_t(cu, torch.int64), _t(pad, torch.int64), T, C)
    N = len(cu) - 1
    for S in (1, 3, 5):
        out = torch.full((table.shape[0], 2), SENTINEL, dtype=torch.int64)
        if N:
            run_rows_kernel[(N, S)](table, cc, out, T, S, C=C)
        real = int(cc[N])
        assert (out[real:] == SENTINEL).all()
        got, want = out[:real], table[:real, 2:].to(torch.int64)
        assert torch.equal(got[:, 1], want[:, 1]), (S, (got[:, 1] != want[:, 1]).nonzero()[:5].tolist())
        rows = want[:, 1] > 0
        assert torch.equal(got[rows, 0], want[rows, 0]), S
