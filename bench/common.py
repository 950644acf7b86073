"""What every module of the benchmark shares: the prepared case, skip/fail signals, inputs, and the
command-line error every subcommand raises (UsageError)."""
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
NEEDS_GPU = "needs a GPU (the interpreter is not a benchmark)"


class UsageError(Exception):
    """A bad command line: bench.cli.main prints it as one line and exits with status 2."""


class Skip(Exception):
    """The provider cannot run this case here; the message says why."""


@dataclass
class Case:
    """A prepared measurement: `fn` is what is timed (inputs already built)."""
    fn: Callable[[], Any]
    note: str = ""


@dataclass(frozen=True)
class Family:
    """How the bench drives the providers of one kind of op (bench/gdr.py, kernels.py, layers.py):
    the scenario ops it serves, `build(provider, scenario, layout, mode, device, dtype)` -> Case (or
    raise Skip) and `gate(provider, device, dtype, grads)` -> (ok, {tensor: rel_err}, detail)."""
    ops: Tuple[str, ...]
    build: Callable[..., Case]
    gate: Callable[..., tuple]


def runs_anywhere(device) -> str:
    return ""


@dataclass(frozen=True)
class Provider:
    """A named implementation of an op family, declared once (bench/providers.py).
    `call`: the implementation in its family's calling convention (the family module's docstring says
    which). `why_not(device)`: '' when it can run there, else why not. `varlen`: False for a call
    without cu_seqlens, which the family then runs on packed input one sequence at a time (what a
    caller of it has to do; the rows' notes say so). `max_token_heads`: real tokens x v-heads above
    which a case is skipped (0: no limit)."""
    name: str
    family: Family
    call: Callable[..., Any]
    why_not: Callable[[torch.device], str] = runs_anywhere
    note: str = ""
    varlen: bool = True
    max_token_heads: int = 0

    def build(self, s, layout, mode, device, dtype) -> Case:
        return self.family.build(self, s, layout, mode, device, dtype)

    def gate(self, device, dtype, grads) -> tuple:
        return self.family.gate(self, device, dtype, grads)

    def note_for(self, layout) -> str:
        """The note of this provider's rows in a layout (packed / padded / dense)."""
        if self.varlen or layout == "dense":
            return self.note
        how = {"packed": "no cu_seqlens: one call per sequence",
               "padded": "one batched call over the padded rows"}[layout]
        return "; ".join(x for x in (self.note, how) if x)


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


# fla-core's own refusal to run (its gated backward on Hopper with Triton 3.4-3.7.0, seen on an H200 with
# Triton 3.6.0 on 2026-12-04): such a row is skipped with FLA's message, not failed
FLA_REFUSES = "produces incorrect results"
