"""The chunk table: CUDA arithmetic (run on the host through _C.chunk_table_host), the torch backend
and a plain-Python transcription of the contract must agree exactly, on sane and corrupt packings."""
import ast
import bisect
import inspect
import random

import pytest
import torch

from gdn_packed import _cext
from gdn_packed.ops import chunk_table as op_mod
from gdn_packed.ops.chunk_table import build_chunk_table

INT32_MAX = 2**31 - 1
SENTINEL = 0x5A5A5A5A


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
    C_mod = _cext.get_C()
    N = cu.numel() - 1
    table = torch.full((T // C + N, 4), SENTINEL, dtype=torch.int32)
    cc = torch.full((N + 1,), SENTINEL, dtype=torch.int32)
    cu = cu.contiguous()
    padded = padded.contiguous() if padded is not None else None
    C_mod.chunk_table_host(cu.data_ptr(), padded.data_ptr() if padded is not None else 0,
                           cu.dtype == torch.int64, N, T, C, table.data_ptr(), cc.data_ptr())
    return table, cc


needs_C = pytest.mark.skipif(not _cext.built(), reason="gdn_packed._C not built (no nvcc at install)")


# ---- packings ------------------------------------------------------------------------------------
def _lay(lengths, gaps=None, tail=0):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if gaps is None:
        return cu, None, cu[-1] + tail
    pad = [0]
    for n, g in zip(lengths, gaps):
        pad.append(pad[-1] + n + g)
    return cu, pad, pad[-1] + tail


def _random_packing(seed, n_max=12, padded=False):
    rng = random.Random(seed)
    n = rng.randint(0, n_max)
    lengths = [rng.choice([0, 1, 2, 63, 64, 65, 127, 128, 129, rng.randint(0, 300)]) for _ in range(n)]
    gaps = [rng.choice([0, 0, 1, 7, 64, 100]) for _ in range(n)] if padded else None
    return _lay(lengths, gaps, tail=rng.choice([0, 0, 3, 64, 200]))


SANE = {
    "empty_T0": ([0], None, 0),
    "empty_rows": ([0], None, 100),
    "zero_len": ([0, 0], None, 0),
    "zero_len_tail": ([0, 0], None, 10),
    "one_token": ([0, 1], None, 1),
    "odd_lengths": _lay([63, 64, 65, 127, 300]),
    "odd_lengths_tail": _lay([63, 64, 65, 127, 300], tail=81),
    "zeros_mixed": _lay([0, 5, 0, 0, 65, 0, 1, 0]),
    "padded_gaps": _lay([10, 65, 0, 300], gaps=[54, 63, 64, 28], tail=96),
    "padded_aligned": _lay([63, 64, 65, 127], gaps=[1, 0, 63, 1], tail=0),
    "padded_ones": _lay([1, 1, 1], gaps=[63, 63, 63], tail=5),
    "many_seqs": _lay([1 + (i * 37) % 150 for i in range(700)]),  # > one 512-thread scan tile
}
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
def test_torch_matches_python_reference(cu, pad, T, dtype, C):
    ref_t, ref_cc = ref_chunk_table(cu, pad, T, C)
    table, cc = chunk_table_torch(_t(cu, dtype), _t(pad, dtype), T, C)
    assert cc.tolist() == ref_cc
    assert table.tolist() == ref_t
    _check_invariants(table, cc, T, C, len(cu) - 1)


@needs_C
@pytest.mark.parametrize("C", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("cu,pad,T", _cases([SANE, CORRUPT]))
def test_cuda_body_on_host_matches(cu, pad, T, dtype, C):
    table, cc = host_chunk_table(_t(cu, dtype), _t(pad, dtype), T, C)
    ref_t, ref_cc = ref_chunk_table(cu, pad, T, C)
    assert cc.tolist() == ref_cc
    assert table.tolist() == ref_t
    t_table, t_cc = chunk_table_torch(_t(cu, dtype), _t(pad, dtype), T, C)
    assert torch.equal(table, t_table) and torch.equal(cc, t_cc)
    _check_invariants(table, cc, T, C, len(cu) - 1)


@needs_C
@pytest.mark.parametrize("cu,pad,T", _cases([HUGE64]))
def test_cuda_body_on_host_huge_int64(cu, pad, T):
    C = 64
    table, cc = host_chunk_table(_t(cu, torch.int64), _t(pad, torch.int64), T, C)
    ref_t, ref_cc = ref_chunk_table(cu, pad, T, C)
    assert cc.tolist() == ref_cc and table.tolist() == ref_t
    t_table, t_cc = chunk_table_torch(_t(cu, torch.int64), _t(pad, torch.int64), T, C)
    assert torch.equal(table, t_table) and torch.equal(cc, t_cc)
    _check_invariants(table, cc, T, C, len(cu) - 1)


@needs_C
def test_host_rejects_bad_sizes():
    C_mod = _cext.get_C()
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out = torch.empty(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="chunk_size"):
        C_mod.chunk_table_host(cu.data_ptr(), 0, False, 1, 4, 0, out.data_ptr(), out.data_ptr())
    with pytest.raises(ValueError, match="int32"):
        C_mod.chunk_table_host(cu.data_ptr(), 0, False, 1, 2**40, 1, out.data_ptr(), out.data_ptr())


@needs_C
@pytest.mark.skipif(_cext.cuda_available(), reason="a GPU is usable here")
def test_device_call_fails_cleanly_without_gpu():
    C_mod = _cext.get_C()
    with pytest.raises(RuntimeError, match="cuda"):
        C_mod.chunk_table(1 << 20, 0, False, 1, 64, 64, 1 << 21, 1 << 22, 0, 0)


# ---- the op --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("name", ["odd_lengths_tail", "padded_gaps", "empty_rows", "zeros_mixed"])
def test_op_matches_and_opcheck(name, dtype):
    cu, pad, T = SANE[name]
    table, cc = build_chunk_table(_t(cu, dtype), _t(pad, dtype), T, 64)
    ref_t, ref_cc = ref_chunk_table(cu, pad, T, 64)
    assert table.tolist() == ref_t and cc.tolist() == ref_cc
    torch.library.opcheck(torch.ops.gdn_packed.chunk_table.default, (_t(cu, dtype), _t(pad, dtype), T, 64))


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
    """At run time: no host read of any tensor while the op runs (CPU path; the CUDA path has the
    same Python code around one _C call). Statically: no .item()/.tolist()/.cpu() in the op source."""
    cu, pad, T = SANE["padded_gaps"]
    cu_t, pad_t = _t(cu, torch.int64), _t(pad, torch.int64)
    chunk_table_torch(cu_t, pad_t, T, 64)  # import outside the patch

    def boom(self, *a, **k):
        raise AssertionError("host sync inside the chunk_table op")

    for m in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, m, boom)
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
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and _cext.cuda_available()),
                         reason="needs a CUDA GPU and gdn_packed._C: " + (_cext.cuda_unavailable_reason()
                                                                          or "torch sees no GPU"))


@gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_cuda_kernel_matches(dtype):
    dev = torch.device("cuda")
    for group in (SANE, CORRUPT, HUGE64):
        for name, (cu, pad, T) in group.items():
            if dtype == torch.int32 and any(abs(x) > INT32_MAX + 1 for x in cu + (pad or [])):
                continue
            for C in (64, 16, 1):
                cu_d = _t(cu, dtype).to(dev)
                pad_d = None if pad is None else _t(pad, dtype).to(dev)
                table, cc = build_chunk_table(cu_d, pad_d, T, C)
                t_table, t_cc = chunk_table_torch(_t(cu, dtype), _t(pad, dtype), T, C)
                assert torch.equal(cc.cpu(), t_cc), (name, C)
                assert torch.equal(table.cpu(), t_table), (name, C)


@gpu
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
