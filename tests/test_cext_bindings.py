"""gdn_packed._C's kernel entry points take keyword arguments from a declared list (csrc/bindings.cpp):
a misspelled keyword, a missing argument (pointers included: an absent optional tensor is passed as
None, never left out), a positional argument or a wrong type is a TypeError that names it, before any
kernel runs; the kernels' status maps to ValueError (invalid sizes) or RuntimeError (CUDA errors).
Under the old pybind kwargs bindings a misspelled cu_seqlens_padded silently became a null pointer."""
import os

import pytest
import torch

from gdn_packed import _cext

if not _cext.built():
    if os.environ.get("GDN_PACKED_REQUIRE_C", "") == "1":
        raise RuntimeError("GDN_PACKED_REQUIRE_C=1 but gdn_packed._C was not built: "
                           + _cext.cuda_unavailable_reason())
    pytest.skip("gdn_packed._C not built: " + _cext.cuda_unavailable_reason(), allow_module_level=True)

C = _cext.get_C()
DEVICE = "cuda" if _cext.cuda_available() and torch.cuda.is_available() else "cpu"
KEEP = []   # the tensors behind the pointers of the argument sets below


def _p(*shape, dtype=torch.float32, device="cpu", fill=0):
    t = torch.full(shape, fill, dtype=dtype, device=device)
    KEEP.append(t)
    return t.data_ptr()


def chunk_table_args(dev):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=dev)
    KEEP.append(cu)
    return dict(cu_seqlens=cu.data_ptr(), cu_seqlens_padded=None, index_int64=False, N=2, T=7, chunk_size=4,
                table=_p(3, 4, dtype=torch.int32, device=dev), cu_chunks=_p(3, dtype=torch.int32, device=dev))


def conv_args(dev, bwd):
    cu = torch.tensor([0, 3, 7], dtype=torch.int64, device=dev)
    KEEP.append(cu)
    T, D, W, N = 7, 8, 4, 2
    a = dict(x=_p(T, D, device=dev), weight=_p(D, W, device=dev), bias=None, initial_state=None,
             cu_seqlens=cu.data_ptr(), cu_seqlens_padded=None, N=N, T=T, D=D, W=W, dtype=0, silu=True,
             tile_rows=64 if bwd else 16)
    if bwd:
        a.update(dy=_p(T, D, device=dev), dfinal=None, dx=_p(T, D, device=dev), partial=_p(1, D, W + 1, device=dev),
                 dweight_bias=_p(D, W + 1, device=dev), dinitial_state=_p(N, D, W - 1, device=dev))
    else:
        a.update(y=_p(T, D, device=dev), final_state=_p(N, D, W - 1, device=dev))
    return a


def recurrent_args(dev):
    cu = torch.tensor([0, 3, 7], dtype=torch.int64, device=dev)
    KEEP.append(cu)
    T, N, H, HV, K, V = 7, 2, 1, 2, 16, 8
    return dict(q=_p(T, H, K, device=dev), k=_p(T, H, K, device=dev), v=_p(T, HV, V, device=dev),
                g=_p(T, HV, device=dev), beta=_p(T, HV, device=dev), cu_seqlens=cu.data_ptr(), cu_seqlens_padded=None,
                initial_state=None, final_state=_p(N, HV, K, V, device=dev), state_indices=None, pool_size=0,
                slot_roles=None, o=_p(T, HV, V, device=dev), N=N, T=T, H=H, HV=HV, K=K, V=V, dtype=0, scale=0.25,
                l2norm=False)


def _device(args):
    return dict(args, device=0, stream=0)


# entry point -> its full, valid argument set (device launches add device= and stream=)
ENTRY_POINTS = {
    "chunk_table": lambda: _device(chunk_table_args(DEVICE)),
    "chunk_table_host": lambda: chunk_table_args("cpu"),
    "conv1d_varlen_fwd": lambda: _device(conv_args(DEVICE, False)),
    "conv1d_varlen_fwd_host": lambda: conv_args("cpu", False),
    "conv1d_varlen_bwd": lambda: _device(conv_args(DEVICE, True)),
    "conv1d_varlen_bwd_host": lambda: conv_args("cpu", True),
    "recurrent_gdr_fwd": lambda: _device(recurrent_args(DEVICE)),
    "recurrent_gdr_fwd_host": lambda: recurrent_args("cpu"),
}
# the pointer that was silently null when misspelled (cu_seqlens_padded: "no padding"), and each
# entry point's other optional pointers
OPTIONAL_POINTERS = {"chunk_table": ["cu_seqlens_padded"],
                     "conv1d_varlen_fwd": ["cu_seqlens_padded", "bias", "initial_state"],
                     "conv1d_varlen_bwd": ["cu_seqlens_padded", "bias", "initial_state", "dfinal"],
                     "recurrent_gdr_fwd": ["cu_seqlens_padded", "initial_state", "final_state", "state_indices",
                                           "slot_roles"]}


def optional_pointers(entry):
    return OPTIONAL_POINTERS[entry.removesuffix("_host")]


def test_every_kernel_entry_point_is_covered():
    kernels = {n for n in dir(C) if n.startswith(("chunk_table", "conv1d_varlen", "recurrent_gdr"))}
    assert kernels == set(ENTRY_POINTS)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_docstring_declares_exactly_the_arguments(entry):
    names = list(ENTRY_POINTS[entry]())
    assert f"{entry}(*, {', '.join(names)})" in getattr(C, entry).__doc__.splitlines()


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e.endswith("_host")])
def test_host_mirror_runs_with_the_declared_arguments(entry):
    """The argument sets here are complete and valid, so the errors below come from the one change."""
    getattr(C, entry)(**ENTRY_POINTS[entry]())


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_misspelled_keyword_is_named(entry):
    for name in optional_pointers(entry) + ["N", "T"]:
        args = ENTRY_POINTS[entry]()
        wrong = name[:-1] if len(name) > 1 else name + "_"
        args[wrong] = args.pop(name)
        with pytest.raises(TypeError, match=f"^{entry}\\(\\) got unexpected keyword argument '{wrong}'$"):
            getattr(C, entry)(**args)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_missing_argument_is_named(entry):
    """Every declared argument, pointers first among them, is required: leaving one out never means
    'null'."""
    for name in ENTRY_POINTS[entry]():
        args = ENTRY_POINTS[entry]()
        del args[name]
        with pytest.raises(TypeError, match=f"^{entry}\\(\\) missing required keyword argument '{name}' "):
            getattr(C, entry)(**args)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_all_unknown_and_missing_names_are_listed(entry):
    args = ENTRY_POINTS[entry]()
    args["cu_seqlens_paddd"] = args.pop("cu_seqlens_padded")
    args["stram"] = 0
    with pytest.raises(TypeError, match="unexpected keyword arguments 'cu_seqlens_paddd', 'stram'$"):
        getattr(C, entry)(**args)
    del args["cu_seqlens_paddd"], args["stram"], args["cu_seqlens"]
    with pytest.raises(TypeError, match="missing required keyword arguments 'cu_seqlens', 'cu_seqlens_padded'"):
        getattr(C, entry)(**args)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_positional_arguments_are_refused(entry):
    with pytest.raises(TypeError, match=f"^{entry}\\(\\) takes keyword arguments only, got 1 positional$"):
        getattr(C, entry)(0, **ENTRY_POINTS[entry]())


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("name, value, want", [
    ("cu_seqlens", 1.5, "a pointer \\(int\\) or None, got float"),
    ("cu_seqlens", -8, "is not a pointer"),
    ("cu_seqlens", torch.zeros(2), "a pointer \\(int\\) or None, got Tensor"),
    ("N", None, "an int, got NoneType"),
    ("N", 2.0, "an int, got float"),
    ("T", True, "an int, got bool"),
], ids=["float-ptr", "negative-ptr", "tensor-ptr", "None-int", "float-int", "bool-int"])
def test_wrong_type_is_named(entry, name, value, want):
    args = ENTRY_POINTS[entry]()
    args[name] = value
    with pytest.raises(TypeError, match=f"^{entry}\\(\\): argument '{name}' .*{want}"):
        getattr(C, entry)(**args)


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e.endswith("_host")])
def test_invalid_values_raise_value_error(entry):
    args = ENTRY_POINTS[entry]()
    args["cu_seqlens"] = None          # a required pointer passed as None
    with pytest.raises(ValueError, match="cu_seqlens"):
        getattr(C, entry)(**args)


# the arguments of an entry point that are not pointers (entry points add device= and stream=)
SCALARS = {"index_int64", "N", "T", "chunk_size", "D", "W", "dtype", "silu", "tile_rows", "pool_size", "H", "HV",
           "K", "V", "scale", "l2norm", "device", "stream"}


def required_pointers(entry):
    return [n for n in ENTRY_POINTS[entry]() if n not in SCALARS and n not in optional_pointers(entry)]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_required_pointer_passed_as_none_is_a_value_error(entry):
    """None (a null pointer) for any pointer the kernel reads or writes is a ValueError naming it,
    raised before any launch (on 738aed4 a None q, k, v, g or beta crashed recurrent_gdr_fwd_host)."""
    names = required_pointers(entry)
    assert "cu_seqlens" in names or "x" in names
    for name in names:
        args = ENTRY_POINTS[entry]()
        args[name] = None
        with pytest.raises(ValueError, match=f"^{entry}\\(\\): argument '{name}' "):
            getattr(C, entry)(**args)


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e.endswith("_host")])
def test_null_pointers_of_empty_tensors_are_accepted(entry):
    """An empty tensor may have a null data pointer: with T = 0 (and no sequence) the row tensors
    may be None."""
    args = ENTRY_POINTS[entry]()
    cu = torch.zeros(1, dtype=torch.int64 if "conv" in entry or "recurrent" in entry else torch.int32)
    KEEP.append(cu)
    args.update(cu_seqlens=cu.data_ptr(), N=0, T=0)
    for name in ("x", "y", "dy", "dx", "partial", "q", "k", "v", "g", "beta", "o", "final_state", "table",
                 "dinitial_state"):
        if name in args and name not in optional_pointers(entry):
            args[name] = None
    getattr(C, entry)(**args)


@pytest.mark.skipif(_cext.cuda_available(), reason="a GPU is usable here")
@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if not e.endswith("_host")])
def test_cuda_errors_raise_runtime_error(entry):
    """Without a usable GPU a device launch fails cleanly with the CUDA error named."""
    with pytest.raises(RuntimeError, match="cudaError"):
        getattr(C, entry)(**ENTRY_POINTS[entry]())


# ---- the Python side: gdn_packed.cuda.launch ---------------------------------------------------------
def test_launcher_names_a_tensor_on_the_wrong_device():
    from gdn_packed.cuda.launch import launch
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_chunks must be on cpu"):
        launch("chunk_table", cu.device, host=True, reads=dict(cu_seqlens=cu, cu_seqlens_padded=None),
               writes=dict(table=torch.empty(1, 4, dtype=torch.int32),
                           cu_chunks=torch.empty(2, dtype=torch.int32, device="meta")),
               index_int64=False, N=1, T=4, chunk_size=64)


def test_launcher_names_a_non_contiguous_output():
    from gdn_packed.cuda.launch import launch
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="table is written in place .* must be contiguous"):
        launch("chunk_table", cu.device, host=True, reads=dict(cu_seqlens=cu, cu_seqlens_padded=None),
               writes=dict(table=torch.empty(1, 8, dtype=torch.int32)[:, ::2], cu_chunks=torch.empty(2, dtype=torch.int32)),
               index_int64=False, N=1, T=4, chunk_size=64)


def test_launcher_makes_inputs_contiguous():
    """A strided cu_seqlens view is copied (and the copy kept through the call), not read as strided."""
    from gdn_packed.cuda import chunk_table_cuda
    from gdn_packed.torch_ref.chunk_table import chunk_table_torch
    cu = torch.tensor([[0, 99], [70, 99], [75, 99]], dtype=torch.int64)[:, 0]
    assert not cu.is_contiguous()
    table, cc = chunk_table_cuda(cu, None, 80, 64, host=True)
    ref_t, ref_cc = chunk_table_torch(cu, None, 80, 64)
    assert torch.equal(table, ref_t) and torch.equal(cc, ref_cc)


# ---- the launchers (gdn_packed/cuda/*.py) check shapes and dtypes before any launch --------------------
def _recurrent_call(T=7, N=2, H=1, HV=2, K=16, V=8):
    """A complete, valid set of recurrent_fwd_cuda arguments (host mirror, CPU tensors)."""
    z = torch.zeros
    return dict(q=z(T, H, K), k=z(T, H, K), v=z(T, HV, V), g=z(T, HV), beta=z(T, HV),
                cu_seqlens=torch.tensor([0, 3, T]), cu_seqlens_padded=None, initial_state=z(N, HV, K, V),
                state_indices=None, scale=0.25, use_qk_l2norm=False, o=z(T, HV, V), final_state=z(N, HV, K, V))


def _conv_call(bwd, T=7, N=2, D=8, W=4):
    """A complete, valid set of conv1d_fwd_cuda / conv1d_bwd_cuda arguments (host mirror)."""
    z = torch.zeros
    a = dict(x=z(T, D), weight=z(D, W), bias=z(D), initial_state=z(N, D, W - 1),
             cu_seqlens=torch.tensor([0, 3, T]), cu_seqlens_padded=None, silu=True)
    if bwd:
        a.update(dy=z(T, D), dfinal=z(N, D, W - 1), dx=z(T, D), dweight=z(D, W), dbias=z(D),
                 dinitial_state=z(N, D, W - 1))
    else:
        a.update(y=z(T, D), final_state=z(N, D, W - 1))
    return a


def _launcher(name):
    from gdn_packed import cuda
    return getattr(cuda, name)


# (launcher, argument, bad value, error, message): one wrong argument in an otherwise valid call
BAD_LAUNCHES = [
    ("recurrent_fwd_cuda", "o", torch.zeros(6, 2, 8), ValueError, "o must have shape \\(7, 2, 8\\)"),
    ("recurrent_fwd_cuda", "o", torch.zeros(7, 2, 8, dtype=torch.bfloat16), TypeError, "o must have dtype"),
    ("recurrent_fwd_cuda", "v", torch.zeros(7, 2, 8, dtype=torch.bfloat16), TypeError, "v must have dtype"),
    ("recurrent_fwd_cuda", "q", torch.zeros(7, 1, 16, dtype=torch.float64), TypeError, "q must have dtype"),
    ("recurrent_fwd_cuda", "k", torch.zeros(7, 1, 8), ValueError, "k must have shape"),
    ("recurrent_fwd_cuda", "v", torch.zeros(5, 2, 8), ValueError, "v must have shape"),
    ("recurrent_fwd_cuda", "q", torch.zeros(7, 3, 16), ValueError, "multiple"),
    ("recurrent_fwd_cuda", "g", torch.zeros(7, 1), ValueError, "g must have shape"),
    ("recurrent_fwd_cuda", "beta", torch.zeros(6, 2), ValueError, "beta must have shape"),
    ("recurrent_fwd_cuda", "initial_state", torch.zeros(1, 2, 16, 8), ValueError, "initial_state must have shape"),
    ("recurrent_fwd_cuda", "initial_state", torch.zeros(2, 2, 16, 8, dtype=torch.float16), TypeError,
     "initial_state must have dtype"),
    ("recurrent_fwd_cuda", "final_state", torch.zeros(2, 2, 8, 8), ValueError, "final_state must have shape"),
    ("recurrent_fwd_cuda", "cu_seqlens", torch.tensor([[0, 3, 7]]), ValueError, "cu_seqlens must be 1-D"),
    ("recurrent_fwd_cuda", "cu_seqlens", torch.tensor([0.0, 3, 7]), TypeError, "cu_seqlens must be int32"),
    ("recurrent_fwd_cuda", "cu_seqlens_padded", torch.tensor([0, 7]), ValueError, "cu_seqlens_padded must have"),
    ("recurrent_fwd_cuda", "state_indices", torch.tensor([0, 1, 1]), ValueError, "state_indices must have shape"),
    ("conv1d_fwd_cuda", "y", torch.zeros(6, 8), ValueError, "y must have shape \\(7, 8\\)"),
    ("conv1d_fwd_cuda", "y", torch.zeros(7, 8, dtype=torch.bfloat16), TypeError, "y must have dtype"),
    ("conv1d_fwd_cuda", "x", torch.zeros(7, 8, dtype=torch.float64), TypeError, "x must have dtype"),
    ("conv1d_fwd_cuda", "x", torch.zeros(1, 7, 8), ValueError, "x must be 2-D"),
    ("conv1d_fwd_cuda", "final_state", torch.zeros(2, 8, 2), ValueError, "final_state must have shape"),
    ("conv1d_fwd_cuda", "weight", torch.zeros(4, 4), ValueError, "weight must have shape"),
    ("conv1d_fwd_cuda", "weight", torch.zeros(8, 9), ValueError, "weight"),
    ("conv1d_fwd_cuda", "bias", torch.zeros(7), ValueError, "bias must have shape"),
    ("conv1d_fwd_cuda", "initial_state", torch.zeros(3, 8, 3), ValueError, "initial_state must have shape"),
    ("conv1d_bwd_cuda", "dx", torch.zeros(6, 8), ValueError, "dx must have shape"),
    ("conv1d_bwd_cuda", "dy", torch.zeros(5, 8), ValueError, "dy must have shape"),
    ("conv1d_bwd_cuda", "dfinal", torch.zeros(2, 8, 4), ValueError, "dfinal must have shape"),
    ("conv1d_bwd_cuda", "dweight", torch.zeros(8, 3), ValueError, "dweight must have shape"),
    ("conv1d_bwd_cuda", "dbias", torch.zeros(9), ValueError, "dbias must have shape"),
    ("conv1d_bwd_cuda", "dinitial_state", torch.zeros(1, 8, 3), ValueError, "dinitial_state must have shape"),
]


def _bad_launch_id(case):
    name, arg, bad, _, _ = case
    return f"{name}-{arg}-{'x'.join(map(str, bad.shape))}-{str(bad.dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", BAD_LAUNCHES, ids=[_bad_launch_id(c) for c in BAD_LAUNCHES])
def test_launcher_checks_shapes_and_dtypes(case):
    """A wrong shape or dtype is an error naming the argument, before the kernel runs: on 738aed4 an
    output smaller than its input was written past its end (heap corruption) and float32 q with
    bf16 v returned garbage."""
    name, arg, bad, error, message = case
    call = _recurrent_call() if name.startswith("recurrent") else _conv_call(name == "conv1d_bwd_cuda")
    if arg == "state_indices":
        call.update(initial_state=torch.zeros(4, 2, 16, 8), final_state=None)
    call[arg] = bad
    fn = _launcher(name)
    with pytest.raises(error, match=message):
        fn(*call.values(), host=True)


@pytest.mark.parametrize("name", ["recurrent_fwd_cuda", "conv1d_fwd_cuda", "conv1d_bwd_cuda"])
def test_launcher_takes_the_valid_call(name):
    """The argument sets of test_launcher_checks_shapes_and_dtypes are valid: the errors above come
    from the one change."""
    call = _recurrent_call() if name.startswith("recurrent") else _conv_call(name == "conv1d_bwd_cuda")
    _launcher(name)(*call.values(), host=True)


@pytest.mark.parametrize("cu, pad, error, message", [
    (torch.tensor([0.0, 4.0]), None, TypeError, "cu_seqlens must be int32"),
    (torch.tensor([0, 4]), torch.tensor([0, 4, 8]), ValueError, "cu_seqlens_padded must have the same shape"),
    (torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4]), TypeError,
     "cu_seqlens_padded must have the same dtype"),
], ids=["float-cu", "padded-shape", "padded-dtype"])
def test_chunk_table_launcher_checks_offsets(cu, pad, error, message):
    from gdn_packed.cuda import chunk_table_cuda
    with pytest.raises(error, match=message):
        chunk_table_cuda(cu, pad, 8, 4, host=True)
