"""What the kernels' host code asks of the run it is in (no gdn_packed imports: ops/, torch_ref/ and
segments.py all import this module).

    compute_dtype(dtype)   the dtype the torch backend computes in (float64 stays, else float32)
    host_schedule(device)  whether index tensors may be read back to plan loops (CPU tensors, outside
                           device_schedule())
    device_schedule()      a block in which CPU tensors run the schedule of CUDA tensors (tests)
"""
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# per thread (and asyncio task): a switch one thread holds never changes another's schedule
_device_schedule = ContextVar("gdn_packed_device_schedule", default=False)


def compute_dtype(dtype):
    """The dtype the torch backend computes in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def host_schedule(device) -> bool:
    """Whether the torch backend may read index tensors (cu_seqlens, chunk tables) back to the host
    to plan its loops: on CPU tensors that costs nothing (there is no device to wait for); on any
    other device, or inside `device_schedule()`, loops run to static bounds with no read-back."""
    return device.type == "cpu" and not _device_schedule.get()


@contextmanager
def device_schedule():
    """Within this block the torch backend runs CPU tensors with the schedule it uses on CUDA
    tensors (static loop bounds, no host read-back), so tests can check that schedule on a CPU.
    The switch belongs to the thread that enters the block; other threads keep their schedule."""
    token = _device_schedule.set(True)
    try:
        yield
    finally:
        _device_schedule.reset(token)
