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


class Recorder:
    """Patches JITFunction.run and Autotuner.run so that launches are recorded, not run."""

    def __init__(self):
        self.launches, self.phase, self._group, self._next_group = [], "", None, 0

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

        with mock.patch.object(jit.JITFunction, "run", run), \
                mock.patch.object(autotuner.Autotuner, "run", autotuned):
            yield self

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
            group=self._group or 0))
        if not self._group:
            self._next_group += 1
            self.launches[-1].group = self._next_group


SHAPES = {"anchor": (1, 32768, 16, 32, 128, 128), "32x1024": (32, 1024, 16, 32, 128, 128)}
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
    rec.phase = "fwd"
    start = len(rec.launches)
    _, _, kept = _op_body("chunk_gdr_fwd")(**common)
    if "fwd" not in modes:      # run for its `kept` only (what autograd hands the backward)
        del rec.launches[start:]
    if "bwd" in modes:
        rec.phase = "bwd"
        _op_body("chunk_gdr_bwd")(**common, do=torch.empty_like(v), dht=state if dht else None,
                                  kept=kept if kept.numel() else None)


def record_fla(rec, dims, dtype, modes):
    """FLA 0.6.0's chunk_gated_delta_rule (Triton path: FLA_DISABLE_BACKEND_DISPATCH=1) through autograd
    on meta tensors; cu_seqlens (host-read by FLA) on the CPU."""
    import torch
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    N, L = dims[:2]
    q, k, v, g, beta = _meta_inputs(dims, dtype, grad="bwd" in modes)
    cu = torch.arange(0, N + 1, dtype=torch.int32) * L if N > 1 else None
    rec.phase = "fwd"
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    if "bwd" in modes:
        rec.phase = "bwd"
        o.backward(torch.empty_like(o))


def fla_missing():
    try:
        import fla  # noqa: F401
    except ImportError as e:
        return f"fla-core is not installed ({e})"
    return ""


def record_cases(shapes, dtypes, modes, fla=True, log=print):
    """[(impl, shape name, dims, dtype, [Launch])] for every shape x dtype x impl."""
    import torch
    cases = []
    rec = Recorder()
    with fake_hopper(), rec.active():
        for name, dims in shapes:
            for dt in dtypes:
                dtype = getattr(torch, DTYPES[dt])
                for impl in ("ours", "fla") if fla else ("ours",):
                    rec.launches = []
                    (record_ours if impl == "ours" else record_fla)(rec, dims, dtype, modes)
                    log(f"recorded {impl} {name} {dt}: {len(rec.launches)} launches")
                    cases.append((impl, name, dims, dt, list(rec.launches)))
    return cases

