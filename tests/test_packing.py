"""Tests for gdn_packed.packing (CPU; the no-sync contract is checked on the meta device)."""

import importlib
import sys

import pytest
import torch

P = importlib.import_module("gdn_packed.packing")

IDX = [torch.int32, torch.int64]


def cu(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# cu_seqlens <-> lengths / masks / position ids
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", IDX)
def test_cu_seqlens_from_lengths(dtype):
    for lengths in ([3, 0, 4], (3, 0, 4), torch.tensor([3, 0, 4]), torch.tensor([3, 0, 4], dtype=torch.int32)):
        out = P.cu_seqlens_from_lengths(lengths, dtype=dtype)
        assert out.dtype == dtype
        assert out.tolist() == [0, 3, 3, 7]
    assert P.cu_seqlens_from_lengths([]).tolist() == [0]
    assert P.cu_seqlens_from_lengths(torch.zeros(0, dtype=torch.long)).tolist() == [0]
    assert P.cu_seqlens_from_lengths([5]).dtype == torch.int32


def test_cu_seqlens_from_lengths_errors():
    with pytest.raises(ValueError, match=r"lengths must be non-negative.*lengths\[1\] = -2"):
        P.cu_seqlens_from_lengths([3, -2])
    with pytest.raises(ValueError, match=r"lengths must be non-negative"):
        P.cu_seqlens_from_lengths(torch.tensor([1, -1]))
    with pytest.raises(TypeError, match=r"lengths must be an integer tensor"):
        P.cu_seqlens_from_lengths(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"lengths must contain ints"):
        P.cu_seqlens_from_lengths([1, 2.5])
    with pytest.raises(ValueError, match=r"lengths must be 1-D"):
        P.cu_seqlens_from_lengths(torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"dtype must be"):
        P.cu_seqlens_from_lengths([1], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"int32"):
        P.cu_seqlens_from_lengths([2**30, 2**30])
    assert P.cu_seqlens_from_lengths([2**30, 2**30], dtype=torch.int64)[-1] == 2**31


@pytest.mark.parametrize("dtype", IDX)
def test_lengths_from_cu_seqlens(dtype):
    out = P.lengths_from_cu_seqlens(cu([0, 3, 3, 7], dtype))
    assert out.dtype == dtype and out.tolist() == [3, 0, 4]
    assert P.lengths_from_cu_seqlens(cu([0], dtype)).tolist() == []


MASKS = {
    "right": [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]],
    "left": [[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]],
    "arbitrary": [[1, 0, 1, 0], [0, 0, 0, 0], [0, 1, 1, 0]],
    "empty_rows": [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]],
}


@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("as_bool", [True, False])
def test_cu_seqlens_from_attention_mask_and_unpad_indices(kind, as_bool):
    mask = torch.tensor(MASKS[kind])
    if as_bool:
        mask = mask.bool()
    lens = [int(r.sum()) for r in torch.tensor(MASKS[kind])]
    expected_cu = [0]
    for n in lens:
        expected_cu.append(expected_cu[-1] + n)
    c = P.cu_seqlens_from_attention_mask(mask)
    assert c.dtype == torch.int32 and c.tolist() == expected_cu
    assert P.cu_seqlens_from_attention_mask(mask, dtype=torch.int64).dtype == torch.int64
    idx, c2, max_len = P.unpad_indices(mask)
    flat = torch.tensor(MASKS[kind]).reshape(-1)
    assert idx.dtype == torch.int64
    assert idx.tolist() == [i for i in range(flat.numel()) if flat[i]]
    assert c2.tolist() == expected_cu and max_len == max(lens)
    # hints give the same answer, and a too-large total hint pads with B*L
    idx_h, _, ml = P.unpad_indices(mask, total=len(idx) + 2, max_seqlen=7)
    assert idx_h.tolist() == idx.tolist() + [flat.numel()] * 2 and ml == 7


def test_unpad_indices_sorted_fallback():
    flags = torch.tensor([0, 1, 1, 0, 1], dtype=torch.bool)
    assert P._nonzero_1d_sorted(flags, 3, 99).tolist() == [1, 2, 4]
    assert P._nonzero_1d_sorted(flags, 7, 99).tolist() == [1, 2, 4, 99, 99, 99, 99]
    assert P._nonzero_1d_sorted(flags, 2, 99).tolist() == [1, 2]


def test_mask_errors():
    with pytest.raises(ValueError, match=r"mask must be 2-D"):
        P.cu_seqlens_from_attention_mask(torch.ones(3))
    with pytest.raises(TypeError, match=r"mask must be a torch.Tensor"):
        P.unpad_indices([[1, 0]])
    with pytest.raises(ValueError, match=r"total must be >= 0"):
        P.unpad_indices(torch.ones(1, 2), total=-1)


@pytest.mark.parametrize("dtype", IDX)
def test_cu_seqlens_from_position_ids(dtype):
    f = P.cu_seqlens_from_position_ids
    # three documents of lengths 3, 1, 2
    assert f(torch.tensor([[0, 1, 2, 0, 0, 1]]), dtype).tolist() == [0, 3, 4, 6]
    assert f(torch.tensor([0, 1, 2, 0, 0, 1]), dtype).dtype == dtype
    # a single document
    assert f(torch.arange(5)).tolist() == [0, 5]
    # all 1-token documents
    assert f(torch.zeros(1, 4, dtype=torch.long)).tolist() == [0, 1, 2, 3, 4]
    # transformers' rule: a new document wherever the position does not increase by 1 (a jump too)
    assert f(torch.tensor([[0, 1, 2, 7, 8, 0]])).tolist() == [0, 3, 5, 6]
    assert f(torch.tensor([[0, 1, 1, 2]])).tolist() == [0, 2, 4]
    # first token is a start even when its position is not 0 (continued document)
    assert f(torch.tensor([[3, 4, 0, 1]])).tolist() == [0, 2, 4]
    # a single token, and an empty tensor
    assert f(torch.tensor([[7]])).tolist() == [0, 1]
    assert f(torch.zeros(1, 0, dtype=torch.long)).tolist() == [0]
    # rows of a [B, T] tensor are concatenated, each row starts a document
    assert f(torch.tensor([[0, 1, 2], [5, 0, 1]])).tolist() == [0, 3, 4, 6]
    # num_seqs hint: exact, and too large (trailing zero-length sequences)
    assert f(torch.tensor([0, 1, 0]), num_seqs=2).tolist() == [0, 2, 3]
    assert f(torch.tensor([0, 1, 0]), num_seqs=4).tolist() == [0, 2, 3, 3, 3]


def test_cu_seqlens_from_position_ids_errors():
    with pytest.raises(TypeError, match=r"position_ids must be an integer tensor"):
        P.cu_seqlens_from_position_ids(torch.zeros(3))
    with pytest.raises(ValueError, match=r"position_ids must be \[T\] or \[1, T\]"):
        P.cu_seqlens_from_position_ids(torch.zeros(1, 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"num_seqs must be >= 0"):
        P.cu_seqlens_from_position_ids(torch.zeros(3, dtype=torch.long), num_seqs=-1)


# ----------------------------------------------------------------------------------------------------
# pack / unpack
# ----------------------------------------------------------------------------------------------------
def _reference_pack(x, mask):
    rows = []
    for b in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if mask[b, j]:
                rows.append(x[b, j])
    if rows:
        return torch.stack(rows).unsqueeze(0)
    return x.new_zeros((1, 0, *x.shape[2:]))


@pytest.mark.parametrize("kind", list(MASKS))
def test_pack_unpack_round_trip(kind):
    mask = torch.tensor(MASKS[kind], dtype=torch.bool)
    b, l = mask.shape
    x = torch.randn(b, l, 2, 3)
    packed, c = P.pack(x, mask)
    assert packed.shape == (1, int(mask.sum()), 2, 3)
    torch.testing.assert_close(packed, _reference_pack(x, mask), rtol=0, atol=0)
    assert c.tolist() == P.cu_seqlens_from_attention_mask(mask).tolist()
    back = P.unpack(packed, c, b, l, attention_mask=mask)
    torch.testing.assert_close(back, x * mask[..., None, None], rtol=0, atol=0)
    # total hint: exact, and larger (zero rows appended)
    packed_h, _ = P.pack(x, mask, total=packed.shape[1])
    torch.testing.assert_close(packed_h, packed, rtol=0, atol=0)
    packed_big, _ = P.pack(x, mask, total=packed.shape[1] + 2)
    torch.testing.assert_close(packed_big[:, : packed.shape[1]], packed, rtol=0, atol=0)
    assert (packed_big[:, packed.shape[1]:] == 0).all()


def test_unpack_right_padding_without_mask_exact():
    c = cu([0, 2, 2, 5])
    packed = torch.arange(1.0, 6.0).view(1, 5)
    out = P.unpack(packed, c, 3, 4)
    assert out.tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [3, 4, 5, 0]]
    # sequence longer than seqlen: the overflow is dropped, other rows untouched
    out = P.unpack(packed, c, 3, 2)
    assert out.tolist() == [[1, 2], [0, 0], [3, 4]]
    # extra packed rows after cu_seqlens[-1] are padding
    out = P.unpack(torch.arange(1.0, 8.0).view(1, 7), c, 3, 4)
    assert out.tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [3, 4, 5, 0]]


@pytest.mark.parametrize("dtype", IDX)
def test_unpack_right_padding_round_trip(dtype):
    mask = torch.tensor(MASKS["right"], dtype=torch.bool)
    x = torch.randn(3, 4, 5)
    packed, c = P.pack(x, mask)
    back = P.unpack(packed, c.to(dtype), 3, 4)
    torch.testing.assert_close(back, x * mask[..., None], rtol=0, atol=0)


def test_pack_unpack_empty():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    x = torch.randn(2, 3, 4)
    packed, c = P.pack(x, mask)
    assert packed.shape == (1, 0, 4) and c.tolist() == [0, 0, 0]
    assert (P.unpack(packed, c, 2, 3) == 0).all()
    assert (P.unpack(packed, c, 2, 3, attention_mask=mask) == 0).all()
    packed, c = P.pack(torch.randn(0, 3, 4), torch.zeros(0, 3), total=0)
    assert packed.shape == (1, 0, 4) and c.tolist() == [0]


def test_pack_unpack_gradcheck():
    mask = torch.tensor([[0, 1, 1], [1, 0, 1]], dtype=torch.bool)
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: P.pack(t, mask)[0], (x,))
    assert torch.autograd.gradcheck(lambda t: P.pack(t, mask, total=6)[0], (x,))
    c = P.cu_seqlens_from_attention_mask(mask)
    p = torch.randn(1, 4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: P.unpack(t, c, 2, 3, attention_mask=mask), (p,))
    assert torch.autograd.gradcheck(lambda t: P.unpack(t, c, 2, 3), (p,))
    # gradient of a round trip is the mask
    packed, c = P.pack(x, mask)
    P.unpack(packed, c, 2, 3, attention_mask=mask).sum().backward()
    torch.testing.assert_close(x.grad, mask[..., None].expand(2, 3, 2).double())


def test_pack_unpack_errors():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"x must be \[B, L, \.\.\.\] matching attention_mask"):
        P.pack(torch.randn(3, 3), mask)
    with pytest.raises(ValueError, match=r"attention_mask must be 2-D"):
        P.pack(torch.randn(2, 3), torch.ones(6))
    with pytest.raises(ValueError, match=r"total \(5\) is less than the 6 real tokens"):   # (rows < cu_seqlens[-1])
        P.pack(torch.randn(2, 3), mask, total=5)
    assert P.pack(torch.randn(2, 3), mask, total=7)[0].shape == (1, 7)
    with pytest.raises(ValueError, match=r"packed must be \[1, T, \.\.\.\]"):
        P.unpack(torch.randn(2, 3), cu([0, 1, 3]), 2, 3)
    with pytest.raises(ValueError, match=r"cu_seqlens must have batch_size \+ 1 = 3 elements"):
        P.unpack(torch.randn(1, 3), cu([0, 3]), 2, 3)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch_size, seqlen\)"):
        P.unpack(torch.randn(1, 3), cu([0, 1, 3]), 2, 3, attention_mask=torch.ones(2, 4))
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64, got torch.float32"):
        P.unpack(torch.randn(1, 3), torch.tensor([0.0, 1.0, 3.0]), 2, 3)
    with pytest.raises(ValueError, match=r"seqlen must be >= 0"):
        P.unpack(torch.randn(1, 3), cu([0, 1, 3]), 2, -3)


# ----------------------------------------------------------------------------------------------------
# padded storage layout
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", IDX)
def test_pad_cu_seqlens_exact(dtype):
    c = cu([0, 3, 3, 8, 12], dtype)  # lengths 3, 0, 5, 4
    assert P.pad_cu_seqlens(c).tolist() == c.tolist()
    out = P.pad_cu_seqlens(c, multiple=4)
    assert out.dtype == dtype and out.tolist() == [0, 4, 4, 12, 16]
    assert P.pad_cu_seqlens(c, multiple=4, extra=1, tail=5).tolist() == [0, 5, 6, 15, 20]
    assert P.pad_cu_seqlens(c, extra=2).tolist() == [0, 5, 7, 14, 20]
    assert P.pad_cu_seqlens(cu([0], dtype), multiple=8).tolist() == [0]
    assert P.total_rows(out) == 16 and P.total_rows(out, tail=3) == 19
    for m, e, t in [(1, 0, 0), (4, 0, 0), (4, 1, 5), (3, 2, 1)]:
        bound = P.padded_rows_upper_bound(12, 4, m, e, t)
        assert bound >= P.total_rows(P.pad_cu_seqlens(c, m, e), t)
    assert P.padded_rows_upper_bound(12, 4, 4, 1, 5) == 12 + 4 * 4 + 5


def test_pad_cu_seqlens_errors():
    c = cu([0, 3])
    with pytest.raises(ValueError, match=r"multiple must be >= 1"):
        P.pad_cu_seqlens(c, multiple=0)
    with pytest.raises(ValueError, match=r"extra must be >= 0"):
        P.pad_cu_seqlens(c, extra=-1)
    with pytest.raises(ValueError, match=r"tail must be >= 0"):
        P.pad_cu_seqlens(c, tail=-1)
    with pytest.raises(TypeError, match=r"multiple must be an int"):
        P.pad_cu_seqlens(c, multiple=2.0)
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64, got torch.float32"):
        P.pad_cu_seqlens(torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match=r"tail must be >= 0"):
        P.total_rows(c, tail=-2)
    with pytest.raises(ValueError, match=r"more than int32 holds"):         # 2^31 - 2 rounded up to 8
        P.pad_cu_seqlens(cu([0, 2**31 - 2]), multiple=8)
    assert P.pad_cu_seqlens(cu([0, 2**31 - 2], torch.int64), multiple=8).tolist() == [0, 2**31]


@pytest.mark.parametrize("dtype", IDX)
def test_row_maps_exact(dtype):
    c = cu([0, 3, 3, 7], dtype)  # lengths 3, 0, 4
    pd = P.pad_cu_seqlens(c, multiple=4, extra=1)  # slots 5, 1, 5 -> [0, 5, 6, 11]
    assert pd.tolist() == [0, 5, 6, 11]
    rows = 13
    seq = P.token_seq_ids(c, pd, rows)
    pos = P.position_ids_from_cu_seqlens(c, pd, rows)
    real = P.padding_row_mask(c, pd, rows)
    assert seq.dtype == dtype and pos.dtype == dtype and real.dtype == torch.bool
    assert seq.tolist() == [0, 0, 0, -1, -1, -1, 2, 2, 2, 2, -1, -1, -1]
    assert pos.tolist() == [0, 1, 2, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0]
    assert real.tolist() == [s >= 0 for s in seq.tolist()]
    # packed layout (no padded offsets); default rows = cu_seqlens[-1]
    assert P.token_seq_ids(c).tolist() == [0, 0, 0, 2, 2, 2, 2]
    assert P.position_ids_from_cu_seqlens(c).tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert P.position_ids_from_cu_seqlens(c, dtype=torch.int64).dtype == torch.int64
    assert P.token_seq_ids(c, total_rows=9).tolist() == [0, 0, 0, 2, 2, 2, 2, -1, -1]
    assert P.padding_row_mask(c, total_rows=9).tolist() == [True] * 7 + [False] * 2
    # fewer rows than the layout: truncated, no error
    assert P.token_seq_ids(c, pd, 4).tolist() == [0, 0, 0, -1]
    # no sequences at all
    assert P.token_seq_ids(cu([0], dtype), total_rows=3).tolist() == [-1, -1, -1]
    assert P.position_ids_from_cu_seqlens(cu([0], dtype), total_rows=2).tolist() == [0, 0]


def test_row_maps_leading_padding_offset():
    c = cu([0, 2, 3])
    pd = cu([2, 4, 6])  # two padding rows before the first sequence
    assert P.token_seq_ids(c, pd, 7).tolist() == [-1, -1, 0, 0, 1, -1, -1]
    assert P.position_ids_from_cu_seqlens(c, pd, 7).tolist() == [0, 0, 0, 1, 0, 0, 0]
    P.validate_cu_seqlens(c, pd, 7)
    x = torch.arange(1.0, 4.0).view(1, 3)
    y = P.to_padded_layout(x, c, pd, 7)
    assert y.tolist() == [[0, 0, 1, 2, 3, 0, 0]]
    assert P.from_padded_layout(y, c, pd).tolist() == [[1, 2, 3]]


def test_row_maps_match_loop_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(0, 6, (1,), generator=g))
        lens = torch.randint(0, 6, (n,), generator=g)
        c = P.cu_seqlens_from_lengths(lens, dtype=torch.int64)
        m = int(torch.randint(1, 5, (1,), generator=g))
        e = int(torch.randint(0, 3, (1,), generator=g))
        tail = int(torch.randint(0, 3, (1,), generator=g))
        pd = P.pad_cu_seqlens(c, m, e)
        rows = P.total_rows(pd, tail)
        exp_seq, exp_pos = [-1] * rows, [0] * rows
        for i in range(n):
            for j in range(int(lens[i])):
                exp_seq[int(pd[i]) + j] = i
                exp_pos[int(pd[i]) + j] = j
        assert P.token_seq_ids(c, pd, rows).tolist() == exp_seq
        assert P.position_ids_from_cu_seqlens(c, pd, rows).tolist() == exp_pos
        x = torch.randn(1, int(c[-1]), 3)
        y = P.to_padded_layout(x, c, pd, rows)
        real = P.padding_row_mask(c, pd, rows)
        assert (y[0, ~real] == 0).all()
        torch.testing.assert_close(y[0, real], x[0], rtol=0, atol=0)
        torch.testing.assert_close(P.from_padded_layout(y, c, pd), x, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", IDX)
def test_padded_layout_exact_and_round_trip(dtype):
    c = cu([0, 3, 3, 7], dtype)
    pd = P.pad_cu_seqlens(c, multiple=4, extra=1)
    x = torch.arange(1.0, 8.0).view(1, 7, 1)
    y = P.to_padded_layout(x, c, pd, 13)
    assert y.shape == (1, 13, 1)
    assert y.view(-1).tolist() == [1, 2, 3, 0, 0, 0, 4, 5, 6, 7, 0, 0, 0]
    torch.testing.assert_close(P.from_padded_layout(y, c, pd), x, rtol=0, atol=0)
    torch.testing.assert_close(P.from_padded_layout(y, c, pd, total=7), x, rtol=0, atol=0)
    # a larger total hint appends zero rows; too few storage rows drop (to) / zero (from) tokens
    assert P.from_padded_layout(y, c, pd, total=9).view(-1).tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 0]
    assert P.to_padded_layout(x, c, pd, 8).view(-1).tolist() == [1, 2, 3, 0, 0, 0, 4, 5]
    assert P.from_padded_layout(y[:, :8], c, pd).view(-1).tolist() == [1, 2, 3, 4, 5, 0, 0]
    # identity layout
    torch.testing.assert_close(P.to_padded_layout(x, c, c, 7), x, rtol=0, atol=0)
    # empty storage
    assert P.from_padded_layout(y[:, :0], c, pd).view(-1).tolist() == [0] * 7


def test_padded_layout_gradcheck():
    c = cu([0, 2, 2, 3])
    pd = P.pad_cu_seqlens(c, multiple=2, extra=1)  # [0, 3, 4, 7]
    x = torch.randn(1, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: P.to_padded_layout(t, c, pd, 8), (x,))
    y = torch.randn(1, 8, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: P.from_padded_layout(t, c, pd), (y,))
    P.from_padded_layout(y, c, pd).sum().backward()
    real = P.padding_row_mask(c, pd, 8)
    assert (y.grad[0, ~real] == 0).all() and (y.grad[0, real] == 1).all()


def test_padded_layout_errors():
    c = cu([0, 2, 5])
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must have the same shape as cu_seqlens"):
        P.to_padded_layout(torch.randn(1, 5), c, cu([0, 8]), 8)
    with pytest.raises(TypeError, match=r"cu_seqlens_padded must have the same dtype as cu_seqlens"):
        P.from_padded_layout(torch.randn(1, 8), c, cu([0, 4, 8], torch.int64))
    with pytest.raises(ValueError, match=r"packed must be \[1, T, \.\.\.\]"):
        P.to_padded_layout(torch.randn(5), c, c, 5)
    with pytest.raises(ValueError, match=r"x must be \[1, R, \.\.\.\]"):
        P.from_padded_layout(torch.randn(2, 5), c, c)
    with pytest.raises(ValueError, match=r"total_rows must be >= 0"):
        P.to_padded_layout(torch.randn(1, 5), c, c, -1)
    with pytest.raises(TypeError, match=r"total_rows must be an int"):
        P.token_seq_ids(c, c, 5.0)


# ----------------------------------------------------------------------------------------------------
# validate_cu_seqlens
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", IDX)
def test_validate_accepts_valid(dtype):
    c = cu([0, 3, 3, 7], dtype)
    P.validate_cu_seqlens(c)
    P.validate_cu_seqlens(c, total_rows=7)
    P.validate_cu_seqlens(c, P.pad_cu_seqlens(c, 4), total_rows=12)
    P.validate_cu_seqlens(c, c.clone(), total_rows=7)
    P.validate_cu_seqlens(cu([0], dtype), total_rows=0)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((torch.tensor([0.0, 1.0]),), {}, TypeError, r"^cu_seqlens must be int32 or int64, got torch.float32$"),
        (([0, 1],), {}, TypeError, r"cu_seqlens must be a torch.Tensor"),
        ((torch.zeros(2, 2, dtype=torch.int32),), {}, ValueError, r"cu_seqlens must be 1-D"),
        ((torch.zeros(0, dtype=torch.int32),), {}, ValueError, r"cu_seqlens must have at least 1 element"),
        ((cu([1, 3]),), {}, ValueError, r"cu_seqlens\[0\] must be 0, got 1"),
        ((cu([0, 5, 3]),), {}, ValueError, r"cu_seqlens must be non-decreasing.*cu_seqlens\[2\] = 3"),
        ((cu([0, 3, 5]), cu([0, 4])), {}, ValueError,
         r"cu_seqlens_padded must have the same shape as cu_seqlens"),
        ((cu([0, 3, 5]), cu([0, 4, 8], torch.int64)), {}, TypeError,
         r"cu_seqlens_padded must have the same dtype as cu_seqlens"),
        ((cu([0, 3, 5]), cu([0, 4, 8]).to("meta")), {}, ValueError,
         r"cu_seqlens_padded must be on the same device as cu_seqlens"),
        ((cu([0, 3, 5]), torch.tensor([0.0, 4.0, 8.0])), {}, TypeError,
         r"cu_seqlens_padded must be int32 or int64, got torch.float32"),
        ((cu([0, 3, 5]), cu([-1, 4, 8])), {}, ValueError, r"cu_seqlens_padded\[0\] must be >= 0"),
        ((cu([0, 3, 5]), cu([0, 8, 4])), {}, ValueError,
         r"cu_seqlens_padded must be non-decreasing.*cu_seqlens_padded\[2\] = 4"),
        ((cu([0, 64, 128, 192, 262]), cu([0, 64, 128, 192, 256])), {}, ValueError,
         r"cu_seqlens_padded: sequence 3 has length 70 but its padded slot holds 64"),
        ((cu([0, 3, 5]),), {"total_rows": 4}, ValueError, r"cu_seqlens\[-1\] = 5 exceeds total_rows = 4"),
        ((cu([0, 3, 5]), cu([0, 4, 8])), {"total_rows": 7}, ValueError,
         r"cu_seqlens_padded\[-1\] = 8 exceeds total_rows = 7"),
        ((cu([0, 3, 5]),), {"total_rows": -1}, ValueError, r"total_rows must be >= 0"),
    ],
)
def test_validate_errors_name_argument(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        P.validate_cu_seqlens(*args, **kwargs)


def test_validate_custom_name():
    with pytest.raises(ValueError, match=r"^cu_seqlens_q\[0\] must be 0"):
        P.validate_cu_seqlens(cu([2, 3]), name="cu_seqlens_q")
    with pytest.raises(ValueError, match=r"^cu_seqlens_q_padded: sequence 0 has length 3"):
        P.validate_cu_seqlens(cu([0, 3]), cu([0, 2]), name="cu_seqlens_q")


def test_metadata_errors_on_hot_path():
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64, got torch.float32"):
        P.token_seq_ids(torch.tensor([0.0, 2.0]), total_rows=2)
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D"):
        P.lengths_from_cu_seqlens(torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must have the same shape as cu_seqlens"):
        P.padding_row_mask(cu([0, 2]), cu([0, 2, 4]), 4)


# ----------------------------------------------------------------------------------------------------
# no host sync: the hot-path functions run on the meta device, where any read-back raises
# ----------------------------------------------------------------------------------------------------
def test_no_host_sync_on_meta():
    meta = torch.device("meta")
    c = cu([0, 3, 3, 7]).to(meta)
    pd = cu([0, 5, 6, 11]).to(meta)
    mask = torch.ones(3, 4, dtype=torch.bool, device=meta)
    x = torch.empty(1, 7, 2, device=meta)
    with pytest.raises(Exception):  # sanity: a sync really fails on meta
        int(c[-1])
    assert P.cu_seqlens_from_lengths(torch.empty(3, dtype=torch.long, device=meta)).shape == (4,)
    assert P.lengths_from_cu_seqlens(c).shape == (3,)
    assert P.cu_seqlens_from_attention_mask(mask).shape == (4,)
    idx, c2, ml = P.unpad_indices(mask, total=7, max_seqlen=4)
    assert idx.shape == (7,) and c2.shape == (4,) and ml == 4
    assert P.cu_seqlens_from_position_ids(torch.empty(1, 7, dtype=torch.long, device=meta),
                                          num_seqs=3).shape == (4,)
    assert P.pack(torch.empty(3, 4, 2, device=meta), mask, total=7)[0].shape == (1, 7, 2)
    assert P.unpack(x, c, 3, 4).shape == (3, 4, 2)
    assert P.unpack(x, c, 3, 4, attention_mask=mask).shape == (3, 4, 2)
    assert P.pad_cu_seqlens(c, 4, 1).shape == (4,)
    assert P.to_padded_layout(x, c, pd, 13).shape == (1, 13, 2)
    assert P.from_padded_layout(torch.empty(1, 13, 2, device=meta), c, pd, total=7).shape == (1, 7, 2)
    assert P.padding_row_mask(c, pd, 13).shape == (13,)
    assert P.token_seq_ids(c, pd, 13).shape == (13,)
    assert P.position_ids_from_cu_seqlens(c, None, 7).shape == (7,)


# ----------------------------------------------------------------------------------------------------
# gdn_packed.segments: one owner, metadata checked once per public call
# ----------------------------------------------------------------------------------------------------
def test_packing_reexports_the_segment_logic():
    S = importlib.import_module("gdn_packed.segments")
    assert P.validate_cu_seqlens is S.validate_cu_seqlens
    assert P.padding_row_mask is S.padding_row_mask
    assert "validate_cu_seqlens" in P.__all__ and "padding_row_mask" in P.__all__


def _count_meta_checks(monkeypatch):
    importlib.import_module("gdn_packed")
    S = importlib.import_module("gdn_packed.segments")
    calls = []
    real = S.check_cu_seqlens_meta

    def counted(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs.get("name", "cu_seqlens"))
        return real(*args, **kwargs)

    for mod in [m for name, m in sys.modules.items() if name.startswith("gdn_packed") and m is not None]:
        for attr, value in list(vars(mod).items()):
            if value is real:       # every name bound to the check, `from ... import` ones included
                monkeypatch.setattr(mod, attr, counted)
    return calls


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded-storage"])
def test_public_ops_check_cu_seqlens_once(monkeypatch, padded):
    """Each public op checks cu_seqlens' metadata once per call, forward and backward together; the
    custom ops below it (chunk_gdr_fwd/bwd and the chunk table inside them) trust that check."""
    import gdn_packed as G

    torch.manual_seed(0)
    c = cu([0, 3, 3, 70])
    pd = P.pad_cu_seqlens(c, 8) if padded else None
    R = 80 if padded else 70          # rows: the last padded offset (pad_cu_seqlens: [0, 8, 8, 80])
    H, HV, K, V = 1, 2, 8, 8
    q, k = (torch.randn(1, R, H, K, requires_grad=True) for _ in range(2))
    v = torch.randn(1, R, HV, V, requires_grad=True)
    g = (-torch.rand(1, R, HV)).requires_grad_()
    beta = torch.rand(1, R, HV, requires_grad=True)
    calls = _count_meta_checks(monkeypatch)
    o, _ = G.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=c, cu_seqlens_padded=pd, backend="torch")
    o.sum().backward()
    assert calls == ["cu_seqlens"]
    calls.clear()
    A_log, dt_bias = torch.zeros(HV, requires_grad=True), torch.zeros(HV, requires_grad=True)
    o, _ = G.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=c, cu_seqlens_padded=pd, A_log=A_log,
                                    dt_bias=dt_bias, backend="torch")
    o.sum().backward()
    assert calls == ["cu_seqlens"]
    calls.clear()
    x = torch.randn(1, R, 4, requires_grad=True)
    y, _ = G.causal_conv1d_varlen(x, torch.randn(4, 3), cu_seqlens=c, cu_seqlens_padded=pd, backend="torch")
    y.sum().backward()
    assert calls == ["cu_seqlens"]
    calls.clear()
    G.fused_recurrent_gated_delta_rule(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(),
                                       cu_seqlens=c, cu_seqlens_padded=pd, backend="torch")
    assert calls == ["cu_seqlens"]
    calls.clear()
    z = torch.randn(1, R, HV, V, requires_grad=True)
    G.gated_rmsnorm(z, z, torch.ones(V), cu_seqlens=c, cu_seqlens_padded=pd, backend="torch").sum().backward()
    assert calls == ["cu_seqlens"]
