"""The `backend` parameter of the tests of the ops that have csrc/ kernels: "torch"; "host", the csrc/
kernels' host mirror (the same per-thread bodies over the whole grid in a CPU loop, on CPU tensors;
needs gdn_packed._C); "cuda", the CUDA kernels (need _C and a GPU). One that cannot run here is a
visible skip that says why."""
import pytest
import torch

from gdn_packed import _cext


def host_reason():
    return "" if _cext.built() else "gdn_packed._C not built: " + _cext.cuda_unavailable_reason()


def gpu_reason():
    return _cext.cuda_unavailable_reason() or ("" if torch.cuda.is_available() else "torch has no CUDA")


def backends():
    """The pytest parameters; a test module calls this while it is imported, so the GPU check's plugin
    (tools/gpu_tests.py) sees that the module consults the device and runs it on a GPU machine."""
    needs_C = pytest.mark.skipif(bool(host_reason()), reason=host_reason())
    needs_gpu = pytest.mark.skipif(bool(gpu_reason()), reason=f"no GPU: {gpu_reason()}")
    return ["torch", pytest.param("host", marks=needs_C), pytest.param("cuda", marks=needs_gpu)]
