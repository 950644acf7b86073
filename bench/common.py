"""What every op module of the benchmark shares: the prepared case, skip/fail signals, inputs."""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
NEEDS_GPU = "needs a GPU (the interpreter is not a benchmark)"


class Skip(Exception):
    """The provider cannot run this case here; the message says why."""


@dataclass
class Case:
    """A prepared measurement: `fn` is what is timed (inputs already built)."""
    fn: Callable[[], Any]
    note: str = ""


@dataclass
class Provider:
    """A named implementation of an op. `why_not(device)` is '' when it can run there, else why not.
    `build(scenario, layout, mode, device, dtype)` returns a Case or raises Skip.
    `gate(device, dtype, grads)` returns (ok, {tensor: rel_err}, detail)."""
    name: str
    why_not: Callable[[torch.device], str]
    build: Callable[..., Case]
    gate: Callable[..., tuple]
    note: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)


def import_reason(modname: str, attr: Optional[str] = None) -> str:
    """'' when `modname` (and `attr` in it) imports, else '<module> not available: <error>'."""
    try:
        mod = __import__(modname, fromlist=["_"])
        if attr is not None:
            getattr(mod, attr)
        return ""
    except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, or a broken install
        what = f"{modname}.{attr}" if attr else modname
        msg = str(e).splitlines()[0] if str(e) else ""
        return f"{what} not available: {type(e).__name__} {msg}".strip()


def randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def grad_fn(forward, inputs):
    """(fwd-with-grad closure, bwd-only closure, fwdbwd closure) for a forward returning a tensor:
    the backward is against a fixed random upstream gradient."""
    out = forward()
    dout = torch.randn_like(out)

    def bwd():
        return torch.autograd.grad(out, inputs, dout, retain_graph=True)

    def fwdbwd():
        return torch.autograd.grad(forward(), inputs, dout)
    return bwd, fwdbwd
