"""What the launchers launch, recorded without a GPU: gdn_packed's op bodies (the registered
torch.ops.gdn_packed.chunk_gdr_fwd / _bwd redispatched past their fake kernels, backend="triton") and
FLA 0.6.0's chunk_gated_delta_rule through autograd, on meta tensors, inside hopper.fake_hopper(), while
JITFunction.run is patched to record each launch (kernel, signature and specialisation exactly as triton's
own binder computes them, constexprs, options, grid) instead of launching it. An autotuned kernel (FLA)
records every config it could pick; the model (report.py) chooses among them."""
import contextlib
import dataclasses
import math
import os
import re
from unittest import mock

from bench.sm90.hopper import SM90_TARGET, fake_hopper

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch (or, for an autotuned kernel, one candidate config of it)."""
    kernel: str
    phase: str
    fn: object
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    grid: tuple
    scalars: dict                   # name -> int/float value of the non-constexpr scalar arguments
    tensors: dict                   # name -> (shape, dtype name, element bytes) of the tensor arguments
    group: int = 0                  # launches with the same group id are configs of one autotuned launch
    seq_lens: tuple = ()            # the recorded call's sequence lengths (tokens), in cu_seqlens order
    lane: tuple = ()                # (fork, "main" / "side") inside a gdn_packed._runtime.fork block

    @property
    def programs(self):
        return math.prod(self.grid)

    @property
    def num_warps(self):
        return self.options.get("num_warps", 4)

    @property
    def num_stages(self):
        return self.options.get("num_stages", 3)

    def config_text(self):
        blocks = " ".join(f"{k}{v}" for k, v in sorted(self.constexprs_by_name().items())
                          if re.fullmatch(r"B[A-Z]+", k) and isinstance(v, int))
        return f"{blocks} w{self.num_warps} s{self.num_stages}".strip()

    def constexprs_by_name(self):
        names = self.fn.arg_names
        return {names[path[0]]: v for path, v in self.constexprs.items() if len(path) == 1}


@dataclasses.dataclass
class TorchOp:
    """One torch operator on device (meta) tensors that moves data: an elementwise op, a reduction, a copy
    or a fill (views and allocations move nothing and are not recorded). bytes: the tensors it reads
    and writes."""
    kernel: str                     # "torch " + the aten overload, e.g. "torch aten.sum.dim_IntList"
    phase: str
    bytes: int
    group: int = 0
    seq_lens: tuple = ()
    lane: tuple = ()
    programs = 1
    num_warps = 0
    num_stages = 0
    grid = (1, 1, 1)

    def config_text(self):
        return ""


_NO_DATA = ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "lift_fresh", "detach",
            "alias", "_local_scalar_dense", "set_", "resize_")
_WRITE_ONLY = ("fill_", "zero_", "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full",
               "full_like", "new_full", "fill", "arange", "scalar_tensor")


def _meta_tensors(x):
    import torch
    if isinstance(x, torch.Tensor):
        return [x] if x.device.type == "meta" else []
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _meta_tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _meta_tensors(y)]
    return []


class Recorder:
    """Patches JITFunction.run and Autotuner.run so that launches are recorded, not run; with torch_ops,
    torch operators on device (meta) tensors that move data are recorded too (TorchOp). Inside a
    gdn_packed._runtime.fork block (patched too) each record made there gets its lane: (fork number,
    "side") inside the block's side context, else (fork number, "main")."""

    def __init__(self, torch_ops=False):
        self.launches, self.phase, self._group, self._next_group = [], "", None, 0
        self.lengths, self.torch_ops, self._forks = (), torch_ops, 0

    @contextlib.contextmanager
    def fork(self, device=None):
        """gdn_packed._runtime.fork while recording: the lanes stamped on the records made in the block."""
        start, sides = len(self.launches), []
        self._forks += 1
        number = self._forks

        @contextlib.contextmanager
        def side():
            first = len(self.launches)
            try:
                yield
            finally:
                sides.append(range(first, len(self.launches)))
        try:
            yield side()
        finally:
            for i in range(start, len(self.launches)):
                if self.launches[i].lane:
                    raise RuntimeError("launches.Recorder: a fork inside a fork is not modelled")
                self.launches[i].lane = (number, "side" if any(i in r for r in sides) else "main")

    @contextlib.contextmanager
    def active(self):
        from triton.runtime import autotuner, jit
        rec = self

        def run(fn, *args, grid, warmup=False, **kwargs):
            rec._record(fn, args, grid, kwargs)

        def autotuned(tuner, *args, **kwargs):
            tuner.nargs = dict(zip(tuner.arg_names, args))
            configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
            rec._group, rec._next_group = rec._next_group + 1, rec._next_group + 1
            try:
                for config in configs:
                    tuner.fn.run(*args, **kwargs, **config.all_kwargs())
            finally:
                rec._group = None
                tuner.nargs = None

        from torch.utils._python_dispatch import TorchDispatchMode

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                rec._torch_op(func, args, kwargs or {}, out)
                return out

        from gdn_packed import _runtime
        with mock.patch.object(jit.JITFunction, "run", run), \
                mock.patch.object(autotuner.Autotuner, "run", autotuned), \
                mock.patch.object(_runtime, "fork", self.fork), \
                Ops() if self.torch_ops else contextlib.nullcontext():
            yield self

    def _torch_op(self, func, args, kwargs, out):
        name = func.overloadpacket.__name__
        returns = func._schema.returns
        if name in _NO_DATA or not _meta_tensors(out):
            return
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return                  # a view
        written = _meta_tensors(out)
        read = [] if name in _WRITE_ONLY else _meta_tensors((args, kwargs))
        nbytes = sum(t.numel() * t.element_size() for t in read + written)
        self._next_group += 1
        self.launches.append(TorchOp(kernel=f"torch aten.{func.__name__}", phase=self.phase, bytes=nbytes,
                                     group=self._next_group, seq_lens=tuple(self.lengths)))

    def _record(self, fn, args, grid, kwargs):
        import torch
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature
        backend = make_backend(GPUTarget(*SM90_TARGET))
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        if callable(grid):
            grid = grid(bound)
        grid = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        scalars, tensors = {}, {}
        for name, value in bound.items():
            if isinstance(value, torch.Tensor):
                tensors[name] = (tuple(value.shape), str(value.dtype)[6:], value.element_size())
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars[name] = value
        self.launches.append(Launch(
            kernel=fn.__name__, phase=self.phase, fn=fn, signature=signature, constexprs=constexprs,
            attrs=attrs, options=dataclasses.asdict(options), grid=grid, scalars=scalars, tensors=tensors,
            group=self._group or 0, seq_lens=tuple(self.lengths)))
        if not self._group:
            self._next_group += 1
            self.launches[-1].group = self._next_group


SHAPES = {"anchor": (1, 32768, 16, 32, 128, 128), "4x8192": (4, 8192, 16, 32, 128, 128),
          "32x1024": (32, 1024, 16, 32, 128, 128)}
DEFAULT_SHAPES = ("anchor", "32x1024")


def parse_shape(text):
    """A SHAPES name or N,L,H,HV,K,V (N sequences of L tokens, H qk heads, HV v heads) -> (name, tuple)."""
    if text in SHAPES:
        return text, SHAPES[text]
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 6 or min(dims) < 1 or dims[3] % dims[2]:
        raise ValueError(f"shape {text!r}: use one of {', '.join(SHAPES)} or N,L,H,HV,K,V with positive "
                         "integers and HV a multiple of H")
    return "N{}xL{}-H{}x{}-K{}-V{}".format(*dims), dims


def _meta_inputs(dims, dtype, grad=False):
    import torch
    N, L, H, HV, K, V = dims
    T = N * L
    m = dict(device="meta", requires_grad=grad)
    return (torch.empty(1, T, H, K, dtype=dtype, **m), torch.empty(1, T, H, K, dtype=dtype, **m),
            torch.empty(1, T, HV, V, dtype=dtype, **m), torch.empty(1, T, HV, dtype=torch.float32, **m),
            torch.empty(1, T, HV, dtype=torch.float32, **m))


def _op_body(name):
    """The body of the registered op torch.ops.gdn_packed.<name> (what it runs on real tensors), callable on
    meta tensors: a redispatch past the op's fake (Meta) kernel to its CompositeExplicitAutograd kernel."""
    import torch
    import gdn_packed  # noqa: F401  (registers the ops)
    op = getattr(torch.ops.gdn_packed, name).default
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return lambda **kwargs: op.redispatch(keys, **kwargs)


def record_ours(rec, dims, dtype, modes, l2norm=False, h0=False, dht=False, gates=False):
    """gdn_packed's op bodies (torch.ops.gdn_packed.chunk_gdr_fwd / _bwd) with backend="triton" on meta
    tensors: what the dispatcher launches; the backward gets the forward's `kept`, as under autograd."""
    import torch
    N, L, H, HV, K, V = dims
    q, k, v, g, beta = _meta_inputs(dims, dtype)
    if gates:       # raw a, b in the input dtype, as the layers pass them
        g, beta = g.to(dtype), beta.to(dtype)
    cu = torch.empty(N + 1, dtype=torch.int32, device="meta")
    state = torch.empty(N, HV, K, V, dtype=torch.float32, device="meta")
    common = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state if h0 else None, cu_seqlens=cu,
                  cu_seqlens_padded=None, scale=K ** -0.5, use_qk_l2norm=l2norm, backend="triton")
    if gates:
        common.update(A_log=torch.empty(HV, device="meta"), dt_bias=torch.empty(HV, device="meta"))
    rec.phase, rec.lengths = "fwd", (L,) * N
    start = len(rec.launches)
    _, _, kept = _op_body("chunk_gdr_fwd")(**common)
    if "fwd" not in modes:      # run for its `kept` only (what autograd hands the backward)
        del rec.launches[start:]
    if "bwd" in modes:
        rec.phase = "bwd"
        _op_body("chunk_gdr_bwd")(**common, do=torch.empty_like(v), dht=state if dht else None,
                                  kept=kept if kept.numel() else None)


def record_fla(rec, dims, dtype, modes, lengths=None, h0=False, dht=False):
    """FLA 0.6.0's chunk_gated_delta_rule (Triton path: FLA_DISABLE_BACKEND_DISPATCH=1) through autograd
    on meta tensors; cu_seqlens (host-read by FLA) on the CPU, for N > 1 or where `lengths` (the sequence
    lengths, replacing dims' N x L) are given; h0: an initial state; dht: a final-state gradient."""
    import torch
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    N, L = dims[:2]
    varlen = lengths is not None or N > 1
    lengths = tuple(lengths) if lengths is not None else (L,) * N
    dims = (1, sum(lengths)) + tuple(dims[2:])
    q, k, v, g, beta = _meta_inputs(dims, dtype, grad="bwd" in modes)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32) if varlen else None
    state = torch.empty(len(lengths), *dims[3:], dtype=torch.float32, device="meta")
    rec.phase, rec.lengths = "fwd", lengths
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state if h0 else None, output_final_state=True,
                                   cu_seqlens=cu)
    if "bwd" in modes:
        rec.phase = "bwd"
        outs = [o, ht] if dht else [o]
        # under Triton >= 3.4, < 3.7.1 (the H200 image's 3.6.0) FLA refuses its gated dq/dk kernel on Hopper
        # (fla #640: wrong numbers from that compiler); a recording computes nothing, so the guard is lifted
        # for it alone: the launches are the ones FLA makes under a Triton it accepts
        from fla.ops.common import chunk_o
        guard = chunk_o.TRITON_ABOVE_3_7_1
        chunk_o.TRITON_ABOVE_3_7_1 = True
        try:
            torch.autograd.backward(outs, [torch.empty_like(x) for x in outs])
        finally:
            chunk_o.TRITON_ABOVE_3_7_1 = guard


def fla_missing():
    try:
        import fla  # noqa: F401
    except ImportError as e:
        return f"fla-core is not installed ({e})"
    return ""


def record_cases(shapes, dtypes, modes, fla=True, ext=True, log=print):
    """[(impl, shape name, dims, dtype, [Launch])] for every shape x dtype x impl (impl "cuda": the sm_90a
    CUDA forward, bench/sm90/cuda_chunk.py). ext: as with gdn_packed._C built (the chunk table from
    csrc/, bench/sm90/cuda_table.py); else a Triton-only install (the chunk table's torch operators)."""
    import torch

    from bench.sm90 import cuda_chunk, cuda_table
    cases = []
    rec = Recorder(torch_ops=True)
    with fake_hopper(), rec.active(), cuda_table.built(rec) if ext else contextlib.nullcontext():
        for name, dims in shapes:
            for dt in dtypes:
                dtype = getattr(torch, DTYPES[dt])
                for impl in ("ours", "fla") if fla else ("ours",):
                    rec.launches = []
                    (record_ours if impl == "ours" else record_fla)(rec, dims, dtype, modes)
                    log(f"recorded {impl} {name} {dt}: {len(rec.launches)} launches")
                    cases.append((impl, name, dims, dt, list(rec.launches)))
                if cuda_chunk.takes(dims, dt):     # backend="cuda": its forward, its backward's dS pass
                    rec.launches = []
                    cuda_chunk.record(rec, dims, dt, _meta_inputs, _op_body, modes)
                    cases.append(("cuda", name, dims, dt, list(rec.launches)))
    return cases

