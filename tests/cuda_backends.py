"""The `backend` parameter of the tests of the ops that have csrc/ kernels: "torch"; "host", the csrc/
kernels' host mirror (the same per-thread bodies over the whole grid in a CPU loop, on CPU tensors;
needs gdn_packed._C); "cuda", the CUDA kernels (need _C and a GPU). One that cannot run here is a
visible skip that says why."""
import pytest
import torch

from gdn_packed import _cext

HOST_REASON = "" if _cext.built() else "gdn_packed._C not built: " + _cext.cuda_unavailable_reason()
GPU_REASON = _cext.cuda_unavailable_reason() or ("" if torch.cuda.is_available() else "torch has no CUDA")
needs_C = pytest.mark.skipif(bool(HOST_REASON), reason=HOST_REASON)
needs_gpu = pytest.mark.skipif(bool(GPU_REASON), reason=f"no GPU: {GPU_REASON}")
BACKENDS = ["torch", pytest.param("host", marks=needs_C), pytest.param("cuda", marks=needs_gpu)]
