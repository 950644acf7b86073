"""Access to the optional CUDA extension `gdn_packed._C` (csrc/, built by setup.py through CMake).

`_C` links the CUDA runtime statically and does not link libtorch; ops pass it raw pointers and
`torch.cuda.current_stream().cuda_stream`. Nothing here raises at import: when `_C` is missing or
no GPU is usable, `cuda_available()` is False and `cuda_unavailable_reason()` says why.
"""
from __future__ import annotations

import functools

try:
    from gdn_packed import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - ImportError, or an OSError from a broken .so
    _C = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

__all__ = ["_C", "get_C", "built", "cuda_available", "cuda_unavailable_reason", "cuda_status"]


def get_C():
    """The `gdn_packed._C` module, or None when it was not built / does not load."""
    return _C


def built() -> bool:
    """True when `gdn_packed._C` imported (it may still have no GPU to run on)."""
    return _C is not None


@functools.lru_cache(maxsize=None)
def cuda_status() -> dict:
    """dict(built, runtime_version, compiled_version, driver_version, device_count, error, archs).
    Queries the driver on first call (not at import)."""
    if _C is None:
        return {"built": False, "runtime_version": 0, "compiled_version": 0, "driver_version": 0,
                "device_count": 0, "error": _IMPORT_ERROR, "archs": ""}
    try:
        status = dict(_C.cuda_status())
    except Exception as e:  # noqa: BLE001
        status = {"runtime_version": 0, "compiled_version": 0, "driver_version": 0, "device_count": 0,
                  "error": f"{type(e).__name__}: {e}", "archs": getattr(_C, "cuda_archs", "")}
    status["built"] = True
    return status


def cuda_unavailable_reason() -> str:
    """'' when the csrc/ kernels can run here; otherwise why they cannot (no `_C` built, no driver,
    no GPU), with what to do about it."""
    s = cuda_status()
    if not s["built"]:
        return ("gdn_packed._C is not built (" + (s["error"] or "import failed") + "). It is compiled "
                "from csrc/ at install time only when nvcc is found and GDN_PACKED_NO_CUDA is unset; "
                "reinstall with `pip install -v --no-build-isolation -e .` on a machine with the CUDA "
                "toolkit")
    if s["error"]:
        return (f"gdn_packed._C is built (archs {s['archs']}, CUDA runtime {s['runtime_version']}) but "
                f"no CUDA device is usable: {s['error']}" +
                (" (no NVIDIA driver on this machine, or one older than the runtime)"
                 if "InsufficientDriver" in s["error"] or "NoDevice" in s["error"] else ""))
    if s["device_count"] <= 0:
        return "gdn_packed._C is built but the CUDA driver reports no GPU (device_count() == 0)"
    return ""


def cuda_available() -> bool:
    """True when `gdn_packed._C` is built and at least one CUDA device is usable."""
    return cuda_unavailable_reason() == ""
