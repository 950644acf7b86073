"""What the kernels' host code asks of the run it is in (no gdn_packed imports: ops/, torch_ref/ and
segments.py all import this module).

    compute_dtype(dtype)   the dtype the torch backend computes in (float64 stays, else float32)
    host_schedule(device)  whether index tensors may be read back to plan loops (CPU tensors, outside
                           device_schedule())
    device_schedule()      a block in which CPU tensors run the schedule of CUDA tensors (tests)
    fork(device)           a block whose launches run in two lanes that may overlap: the current stream
                           and, inside the context it yields, a side stream
"""
from contextlib import contextmanager, nullcontext
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


_side_streams = {}


def _side_stream(device):
    """One side stream per CUDA device, from torch's pool (no stream created during a graph capture once
    the device has run a fork outside one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


@contextmanager
def fork(device):
    """A block whose launches run in two lanes that the GPU may overlap:

        with fork(q.device) as side:
            launch_a()          # the current stream
            with side:
                launch_b()      # a side stream: it starts where the current stream stood at the fork
                                # (after everything enqueued before the block, not launch_a)

    At the block's end (also on an exception) the current stream waits for the side stream, so whatever
    follows sees both lanes' writes, and a tensor of the current stream that the side lane used and that
    is freed after the block is reused only after the side lane's work (the caching allocator reuses a
    block in its stream's order). So the side lane must not read what the current lane writes in the
    block, nor write what it reads, and what it uses must outlive the block. Under a CUDA-graph capture
    the fork and the join are captured as the graph's edges. Elsewhere than on a CUDA device both lanes
    are the current one, in program order."""
    if device.type != "cuda":
        yield nullcontext()
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    try:
        yield torch.cuda.stream(side)
    finally:
        main.wait_stream(side)
