"""Static sm_90 (H200) report of the Triton kernels the launchers run, without a GPU.

    python -m bench kernels [--shape NAME|N,L,H,HV,K,V ...] [--dtype bf16,fp32] [--modes fwd,bwd]
                            [--no-fla] [--json FILE] [--csv FILE] [--txt FILE]

How (nothing about a kernel is hard-coded here):
1. Record. The public launchers are called on meta tensors (gdn_packed's op bodies - the registered
   torch.ops.gdn_packed.chunk_gdr_fwd / _bwd redispatched past their fake kernels - with
   backend="triton", and FLA 0.6.0's chunk_gated_delta_rule through autograd) inside `fake_hopper()`,
   which answers triton's driver and torch.cuda's device queries as one H200 would, while
   JITFunction.run is patched to record each launch (kernel, signature and specialisation exactly as
   triton's own binder computes them, constexprs, options, grid) instead of launching it. An autotuned
   kernel (FLA) records every config it could pick; bench/sm90_model.py chooses among them.
2. Compile each recorded launch for sm_90 with triton.compile(ASTSource(...), GPUTarget("cuda", 90, 32))
   and read: registers and spills (cuobjdump --dump-resource-usage), shared memory (metadata), the
   dots and their operand types / input precision (TTGIR), per-program FLOPs and tile bytes (TTIR,
   loop trip counts evaluated from constants and the recorded scalar arguments), and, for the loop
   that holds warpgroup MMAs, its per-iteration SASS: HGMMA, instructions, wgmma waits, barriers.
3. Model (bench/sm90_model.py): CTAs per SM, waves on 132 SMs, HBM bytes, estimated time.
"""
import contextlib
import dataclasses
import math
import os
import re
import subprocess
import tempfile
import types
from unittest import mock

SM90_TARGET = ("cuda", 90, 32)      # NVIDIA warps are 32 threads
NUM_SMS = 132
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


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


class _FakeUtils:
    @staticmethod
    def get_device_properties(_device=0):
        return dict(multiprocessor_count=NUM_SMS, max_shared_mem=232448, max_num_regs=65536, warpSize=32,
                    sm_clock_rate=1980000, mem_clock_rate=3201000, mem_bus_width=6144)


class _FakeDriver:
    """What triton.runtime.driver.active answers on one H200; nothing here can launch."""
    utils = _FakeUtils()

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget(*SM90_TARGET)

    def get_current_device(self):
        return 0

    def get_current_stream(self, _device=None):
        return 0

    def get_device_interface(self):
        import torch
        return torch.cuda

    def is_active(self):
        return True


@contextlib.contextmanager
def fake_hopper():
    """Triton's driver and torch.cuda's device queries answer as one H200 (sm_90, 132 SMs)."""
    import torch
    from triton.runtime import driver
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=NUM_SMS,
                                  shared_memory_per_block=49152, shared_memory_per_block_optin=232448,
                                  total_memory=141 * 2**30, warp_size=32)
    old = driver._active
    driver.set_active(_FakeDriver())
    patches = [mock.patch.object(torch.cuda, name, value) for name, value in dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        get_device_capability=lambda *_: (9, 0), get_device_name=lambda *_: props.name,
        get_device_properties=lambda *_: props, device=lambda *_: contextlib.nullcontext(),
        current_stream=lambda *_: types.SimpleNamespace(cuda_stream=0)).items()]
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield
    finally:
        driver._active = old


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


# ---------------------------------------------------------------- compile and read the compiler's answer

@dataclasses.dataclass
class Compiled:
    """What the sm_90 compile of one launch says (per program unless named otherwise)."""
    regs: int = 0
    smem: int = 0
    spill: int = 0
    flops: float = 0.0              # per program, tile shapes x loop trips (masked lanes included)
    bytes_ld: float = 0.0           # per program, tile loads x loop trips
    bytes_st: float = 0.0
    seq_loop: bool = False          # a loop with a run-time trip count holds a dot (the chunk loop)
    seq_trips: int = 0              # its trip count (the most, if several)
    dots: list = dataclasses.field(default_factory=list)   # (a type, b type, input precision) per tt.dot
    loop: dict = dataclasses.field(default_factory=dict)   # per-iteration SASS counts of the HGMMA loop
    hgmma: int = 0                  # whole-kernel SASS counts
    hmma: int = 0
    error: str = ""


def _bindir():
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def toolchain_missing():
    """'' when triton's CUDA backend and its ptxas/cuobjdump are here, else why not."""
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except ImportError as e:
        return f"triton is not installed ({e})"
    if "nvidia" not in backends:
        return "triton has no CUDA (nvidia) backend here"
    for tool in ("ptxas", "cuobjdump"):
        if not os.path.exists(os.path.join(_bindir(), tool)):
            return f"triton's {tool} is missing from {_bindir()}"
    return ""


_BUILDS, _READS = {}, {}


def _build_key(launch):
    return (launch.fn.__module__, launch.kernel, repr(sorted(launch.signature.items())),
            repr(sorted(launch.constexprs.items())), repr(sorted(launch.attrs.items())),
            repr(sorted(launch.options.items())))


def build(launch):
    """triton.compile of one recorded launch for sm_90 (cached per kernel and specialisation):
    {"shared", "ttir", "ttgir", "resources", "sass"} or {"error"}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    key = _build_key(launch)
    if key in _BUILDS:
        return _BUILDS[key]
    try:
        k = triton.compile(ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs),
                           target=GPUTarget(*SM90_TARGET), options=launch.options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            out = dict(shared=k.metadata.shared, ttir=k.asm["ttir"], ttgir=k.asm["ttgir"],
                       resources=_cuobjdump("--dump-resource-usage", f.name), sass=_cuobjdump("--dump-sass", f.name))
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile is a row of the report)
        lines = str(e).strip().splitlines()
        out = dict(error=f"{type(e).__name__}: {lines[-1][:300] if lines else ''}")
    _BUILDS[key] = out
    return out


def compile_launch(launch, seq_chunks):
    """Compiles one recorded launch for sm_90 and reads it (see Compiled). seq_chunks: the trip count
    assumed for a data-dependent loop that holds a dot (chunks per sequence at the report's shape); a
    kernel that splits every sequence into segments says so with a run-time scalar argument named
    `segments`, and its data-dependent chunk loop counts cdiv(seq_chunks, segments) trips."""
    seq_chunks = -(-seq_chunks // max(1, int(launch.scalars.get("segments", 1))))
    key = (_build_key(launch), seq_chunks, repr(sorted(launch.scalars.items())))
    if key in _READS:
        return _READS[key]
    b = build(launch)
    out = _READS[key] = Compiled()
    if "error" in b:
        out.error = b["error"]
        return out
    out.smem = b["shared"]
    out.regs = int(re.search(r"REG:(\d+)", b["resources"]).group(1))
    out.spill = sum(int(x) for x in re.findall(r"(?:STACK|LOCAL):(\d+)", b["resources"]))
    ir = read_ttir(b["ttir"], launch.scalars, seq_chunks)
    out.flops, out.bytes_ld, out.bytes_st, out.seq_loop, out.seq_trips, out.dots = (
        ir["flops"], ir["ld"], ir["st"], ir["seq_loop"], ir["seq_trips"], ir["dots"])
    ins = sass_instructions(b["sass"])
    out.hgmma = sum(op.startswith("HGMMA") for _, op, _ in ins)
    out.hmma = sum(op.startswith("HMMA") for _, op, _ in ins)
    out.loop = sass_loop(ins)
    return out


def _cuobjdump(flag, path):
    return subprocess.run([os.path.join(_bindir(), "cuobjdump"), flag, path], capture_output=True, text=True,
                          check=True).stdout


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def sass_instructions(sass):
    """[(address, opcode with modifiers, operands)] of cuobjdump's SASS text."""
    return [(int(a, 16), op, rest.strip()) for a, op, rest in _SASS.findall(sass or "")]


def sass_loop(ins):
    """Per-iteration counts of the widest loop (a backward branch) whose body holds a tensor-core MMA
    (HGMMA: warpgroup MMA; HMMA: a warp's mma.sync, what Triton emits with fewer than 4 warps), inner
    loops counted once: HGMMA, HMMA, instructions (NOPs left out), wgmma waits, CTA barriers, conversions
    to bf16/fp16 (F2FP), and mma_cycles, the tensor-pipe issue cycles of those MMAs (HGMMA 64xNxk: N/2;
    HMMA m16n8k16: 8, m16n8k8: 4). {} when no loop holds one. A backward branch placed after the
    kernel's last EXIT is not a loop: it returns from an out-of-line slow path (ptxas moves an mbarrier
    try-wait's retry, e.g. of a TMA load, to the end of the kernel) to the instruction after the wait."""
    best = None
    last_exit = max((a for a, op, _ in ins if op == "EXIT"), default=math.inf)
    for a, op, rest in ins:
        m = re.match(r"(0x[0-9a-f]+)", rest)
        if op == "BRA" and m and int(m.group(1), 16) < a < last_exit:
            lo = int(m.group(1), 16)
            body = [o for x, o, _ in ins if lo <= x <= a]
            if any(o.startswith(("HGMMA", "HMMA")) for o in body) and (best is None or a - lo > best[0]):
                best = (a - lo, body)
    if best is None:
        return {}
    body = best[1]
    cycles = 0.0
    for o in body:
        m = re.match(r"HGMMA\.64x(\d+)x", o)
        cycles += int(m.group(1)) / 2 if m else 8 if o.startswith("HMMA.16816") else 4 if o.startswith("HMMA") else 0
    return dict(mma_cycles=cycles, hgmma=sum(o.startswith("HGMMA") for o in body),
                hmma=sum(o.startswith("HMMA") for o in body), instr=sum(not o.startswith("NOP") for o in body),
                waits=sum(o.startswith("WARPGROUP.DEPBAR") for o in body),
                bars=sum(o.startswith("BAR.") for o in body), f2fp=sum(o.startswith("F2FP") for o in body))


_ESIZE = {"i1": 1, "i8": 1, "bf16": 2, "f16": 2, "i16": 2, "f32": 4, "i32": 4, "f64": 8, "i64": 8,
          "f8E4M3FN": 1, "f8E5M2": 1}
_INT_OPS = {"addi": lambda a, b: a + b, "subi": lambda a, b: a - b, "muli": lambda a, b: a * b,
            "divsi": lambda a, b: int(a / b), "divui": lambda a, b: a // b, "floordivsi": lambda a, b: a // b,
            "ceildivsi": lambda a, b: -(-a // b), "remsi": lambda a, b: int(math.fmod(a, b)),
            "remui": lambda a, b: a % b, "minsi": min, "maxsi": max, "minui": min, "maxui": max}
_TYPE = r"(?:tensor<([0-9x]+)x(?:!tt\.ptr<)?(\w+)>?>|!tt\.ptr<(?:tensor<([0-9x]+)x)?(\w+)>?>)"


def _tile_bytes(type_text):
    """Bytes of one tile of an IR type: tensor<64x32x!tt.ptr<bf16>>, !tt.ptr<i32>, tensor<64x32xbf16>."""
    m = re.search(_TYPE, type_text)
    if not m:
        return 0
    shape, elem = (m.group(1), m.group(2)) if m.group(2) else (m.group(3), m.group(4))
    n = math.prod(int(x) for x in shape.split("x")) if shape else 1
    return n * _ESIZE.get(elem, 4)


def _ir_tree(text):
    """Nested blocks of the TTIR function body: {"head": line, "items": [line | block]}."""
    root = {"head": "", "items": []}
    stack = [root]
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("}"):
            if len(stack) > 1:
                stack.pop()
            if not s.endswith("{"):
                continue
            s = "} else {"
        if s.endswith("{"):
            node = {"head": s, "items": []}
            stack[-1]["items"].append(node)
            stack.append(node)
        elif s:
            stack[-1]["items"].append(s)
    return root


def _int_values(text, scalars):
    """SSA integer values computable from constants and the launch's scalar arguments."""
    vals = {f"%{k}": v for k, v in scalars.items() if isinstance(v, int)}
    for s in text.splitlines():
        s = s.strip()
        m = re.match(r"(%[\w.-]+) = arith\.constant (-?\d+) : i\d+", s)
        if m:
            vals[m.group(1)] = int(m.group(2))
            continue
        m = re.match(r"(%[\w.-]+) = arith\.(\w+) (%[\w.#-]+)(?:, (%[\w.#-]+))?", s)
        if not m:
            continue
        name, op, a, b = m.groups()
        if op in _INT_OPS and b and a in vals and b in vals and vals[b] != 0:
            vals[name] = _INT_OPS[op](vals[a], vals[b])
        elif op in ("extsi", "extui", "trunci", "index_cast") and a in vals:
            vals[name] = vals[a]
    return vals


def read_ttir(text, scalars, seq_chunks):
    """Per-program FLOPs (tt.dot: 2 M N K), loaded/stored tile bytes, the dots' operand types and input
    precision, and whether a loop whose trip count is not a compile-time constant holds a dot (the
    sequential chunk loop) and its trip count. Trip counts come from constants and the scalar arguments;
    a loop whose bounds are loaded from memory runs seq_chunks times if it holds a dot (the chunk loop)
    and 0 times if not (padding rows: the report's shapes have none); both branches of an if are counted."""
    vals, consts = _int_values(text, scalars), _int_values(text, {})
    acc = dict(flops=0.0, ld=0.0, st=0.0, seq_loop=False, seq_trips=0, dots=[])

    def has_dot(node):
        return any(has_dot(x) if isinstance(x, dict) else " tt.dot " in x for x in node["items"])

    def walk(node, mult):
        for x in node["items"]:
            if isinstance(x, dict):
                m = re.search(r"scf\.for %[\w.-]+ = (%[\w.#-]+) to (%[\w.#-]+) step (%[\w.#-]+)", x["head"])
                trips = 1
                if m:
                    lb, ub, st = (vals.get(v) for v in m.groups())
                    if None in (lb, ub, st):
                        trips = seq_chunks if has_dot(x) else 0
                    else:
                        trips = max(0, -(-(ub - lb) // st))
                    if has_dot(x) and any(v not in consts for v in m.groups()):
                        acc["seq_loop"], acc["seq_trips"] = True, max(acc["seq_trips"], trips)
                walk(x, mult * trips)
            elif " tt.dot " in x:
                m = re.search(r": tensor<((?:\d+x)+)(\w+)> \* tensor<((?:\d+x)+)(\w+)>", x)
                da, a, db, b = m.groups()       # [batch x] M x K and [batch x] K x N
                *bt, M, K = map(int, da.rstrip("x").split("x"))
                N = int(db.rstrip("x").split("x")[-1])
                acc["flops"] += mult * 2 * math.prod(bt) * M * N * K
                p = re.search(r"inputPrecision = (\w+)", x)
                acc["dots"].append((a, b, p.group(1) if p else "ieee"))
            elif " tt.load " in x or " tt.descriptor_load " in x:
                acc["ld"] += mult * _tile_bytes(x.rsplit(" -> " if "descriptor" in x else " : ", 1)[-1])
            elif x.startswith("tt.store ") or x.startswith("tt.descriptor_store "):
                acc["st"] += mult * _tile_bytes(x.rsplit(" : ", 1)[-1].split(", ")[-1])
            elif " tt.atomic_rmw " in x:
                b = _tile_bytes(x.rsplit(" : ", 1)[-1])
                acc["ld"] += mult * b
                acc["st"] += mult * b

    walk(_ir_tree(text), 1)
    return acc


# ---------------------------------------------------------------- what the launchers launch

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


# ---------------------------------------------------------------- the report

def dot_precision(c):
    """The dots' input types and, for fp32 operands, the input precision: 'bf16', 'tf32', 'tf32x3'..."""
    kinds = sorted({a if a != "f32" else p for a, _, p in c.dots})
    return "+".join(kinds) or "-"


def record_cases(shapes, dtypes, modes, fla=True, log=print):
    """[(impl, shape name, dims, dtype, [Launch])] for every shape x dtype x impl."""
    import torch
    cases = []
    rec = Recorder()
    with fake_hopper(), rec.active():
        for name, dims in shapes:
            for dt in dtypes:
                dtype = getattr(torch, _DTYPES[dt])
                for impl in ("ours", "fla") if fla else ("ours",):
                    rec.launches = []
                    (record_ours if impl == "ours" else record_fla)(rec, dims, dtype, modes)
                    log(f"recorded {impl} {name} {dt}: {len(rec.launches)} launches")
                    cases.append((impl, name, dims, dt, list(rec.launches)))
    return cases


_TODO = []


def _build_nth(i):
    return build(_TODO[i])


def compile_all(launches, log=print, workers=2):
    """Compiles every distinct launch in forked worker processes (triton.compile holds the GIL);
    the results land in build()'s cache."""
    import multiprocessing
    todo = {}
    for lc in launches:
        todo.setdefault(_build_key(lc), lc)
    todo = {k: lc for k, lc in todo.items() if k not in _BUILDS}
    log(f"compiling {len(todo)} distinct kernels for sm_90")
    _TODO[:] = list(todo.values())
    with multiprocessing.get_context("fork").Pool(max(1, workers)) as pool:
        for i, (key, out) in enumerate(zip(todo, pool.imap(_build_nth, range(len(_TODO)))), 1):
            _BUILDS[key] = out
            if i % 10 == 0 or i == len(todo):
                log(f"  {i}/{len(todo)}")
    _TODO.clear()


def _rows_of(case, kappa):
    """Model rows of one case: per launch group, the candidate the model finds fastest."""
    from bench import sm90_model as M
    impl, name, dims, dt, launches = case
    N, L = dims[:2]
    seq_chunks = -(-L // 64)
    groups = {}
    for lc in launches:
        groups.setdefault((lc.phase, lc.group), []).append(lc)
    rows = []
    for (phase, _), cands in groups.items():
        best = None
        for lc in cands:
            c = compile_launch(lc, seq_chunks)
            est = M.estimate(lc.programs, lc.num_warps, c, kappa) if not c.error else dict(est_s=math.inf)
            if best is None or est["est_s"] < best[2]["est_s"]:
                best = (lc, c, est)
        lc, c, est = best
        loop = c.loop if c.seq_loop else {}
        rows.append(dict(
            impl=impl, shape=name, dtype=dt, mode=phase, kernel=lc.kernel, config=lc.config_text(),
            candidates=len(cands), grid="x".join(map(str, lc.grid)), ctas=lc.programs, warps=lc.num_warps,
            stages=lc.num_stages, regs=c.regs, smem_kb=round(c.smem / 1024, 1), spill_b=c.spill,
            ctas_per_sm=est.get("ctas_per_sm", 0), waves=est.get("waves", 0),
            loop_hgmma=loop.get("hgmma", ""), loop_hmma=loop.get("hmma", ""), loop_instr=loop.get("instr", ""), loop_waits=loop.get("waits", ""),
            loop_bars=loop.get("bars", ""), loop_f2fp=loop.get("f2fp", ""), dots=dot_precision(c),
            hbm_gb=float(f"{est.get('hbm_bytes', 0) / 1e9:.4g}"), gflop=round(est.get("flops", 0) / 1e9, 2),
            bound=est.get("bound", ""), est_us=round(est["est_s"] * 1e6, 1) if c.error == "" else "",
            error=c.error))
    return rows


def report(cases):
    """(rows, totals, kappa): kappa calibrated on FLA's bf16 forward at the anchor shape when recorded."""
    from bench import sm90_model as M
    anchor = [cs for cs in cases if cs[0] == "fla" and cs[2] == SHAPES["anchor"] and cs[3] == "bf16"]
    kappa, calibrated = M.KAPPA_DEFAULT, False
    if anchor:
        def fwd_total(kap):
            return sum(r["est_us"] for r in _rows_of(anchor[0], kap) if r["mode"] == "fwd" and r["est_us"] != "") / 1e6
        kappa, calibrated = M.calibrate(fwd_total), True
    rows = [r for cs in cases for r in _rows_of(cs, kappa)]
    totals = {}
    for r in rows:
        t = totals.setdefault((r["impl"], r["shape"], r["dtype"], r["mode"]),
                              dict(impl=r["impl"], shape=r["shape"], dtype=r["dtype"], mode=r["mode"], kernels=0,
                                   est_us=0.0, hbm_gb=0.0, gflop=0.0, spill_kernels=0))
        t["kernels"] += 1
        t["est_us"] = round(t["est_us"] + (r["est_us"] or 0.0), 1)
        t["hbm_gb"] = round(t["hbm_gb"] + r["hbm_gb"], 3)
        t["gflop"] = round(t["gflop"] + r["gflop"], 1)
        t["spill_kernels"] += r["spill_b"] > 0
    for t in totals.values():
        fla = totals.get(("fla", t["shape"], t["dtype"], t["mode"]))
        t["vs_fla"] = round(t["est_us"] / fla["est_us"], 2) if fla and fla["est_us"] else ""
    clamped = calibrated and kappa in (0.0, M.KAPPA_MAX)
    return rows, list(totals.values()), dict(kappa=round(kappa, 3), calibrated=calibrated and not clamped,
                                             calibration_clamped=clamped)


def run_report(shapes, dtypes, modes, fla=True, log=print):
    """(rows, totals, meta) of the whole report. An autotuned (FLA) kernel's configs are all compiled
    and modelled at the first shape only; the other shapes keep the config chosen there (FLA's
    autotune keys hold the head counts and dims, not the token count), which saves ~2/3 of the compiles."""
    cases = record_cases(shapes, dtypes, modes, fla=fla, log=log)
    first = [cs for cs in cases if cs[1] == shapes[0][0]]
    compile_all([lc for *_, launches in first for lc in launches], log=log)
    rows, _, _ = report(first)
    chosen = {(r["impl"], r["dtype"], r["mode"], r["kernel"]): r["config"] for r in rows if r["candidates"] > 1}

    def keep(case):
        impl, name, dims, dt, launches = case
        if name == shapes[0][0]:
            return case
        return (impl, name, dims, dt, [lc for lc in launches if chosen.get(
            (impl, dt, lc.phase, lc.kernel), lc.config_text()) == lc.config_text()])

    cases = [keep(cs) for cs in cases]
    compile_all([lc for *_, launches in cases for lc in launches], log=log)
    return report(cases)


COLUMNS = [("impl", 4), ("mode", 3), ("kernel", 44), ("config", 22), ("ctas", 6), ("warps", 2), ("regs", 3),
           ("smem_kb", 6), ("spill_b", 5), ("ctas_per_sm", 2), ("waves", 3), ("loop_hgmma", 3),
           ("loop_instr", 4), ("loop_waits", 3), ("loop_bars", 3), ("dots", 9), ("hbm_gb", 7), ("gflop", 7),
           ("bound", 4), ("est_us", 8)]
HEAD = dict(impl="impl", mode="dir", kernel="kernel", config="config", ctas="CTAs", warps="w", regs="reg",
            smem_kb="smemKB", spill_b="spill", ctas_per_sm="/SM", waves="wav", loop_hgmma="HGM",
            loop_instr="inst", loop_waits="wt", loop_bars="bar", dots="dots", hbm_gb="HBM GB", gflop="GFLOP",
            bound="bnd", est_us="est us")


def _calibration_text(meta):
    if meta.get("calibration_clamped"):
        return "NOT calibrated: no kappa in the model's range gives FLA's 1.89 ms; clamped"
    if meta["calibrated"]:
        return "calibrated: FLA 0.6.0 bf16 forward at the anchor = 1.89 ms on an H200"
    return "default, not calibrated: FLA not recorded at the anchor shape"


def format_table(rows, totals, meta):
    """The text report: one table per (shape, dtype), then the totals."""
    out = [f"static sm_90 report (no GPU): triton {meta.get('triton', '?')}, model kappa = {meta['kappa']} "
           f"cycles/instruction ({_calibration_text(meta)}).",
           "est us is a MODEL ESTIMATE (bench/NOTES.md, 'sm_90 report'), not a measurement. HGM/inst/wt/bar: per "
           "iteration of the sequential chunk loop (SASS; HGM 'Nh': N HMMA, no HGMMA).", ""]
    keys = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rows))
    for shape, dt in keys:
        out.append(f"== {shape} {dt}")
        out.append(" ".join(f"{HEAD[c]:>{w}}" if c not in ("kernel", "config", "impl", "dots", "bound", "mode")
                            else f"{HEAD[c]:<{w}}" for c, w in COLUMNS))
        for r in rows:
            if (r["shape"], r["dtype"]) != (shape, dt):
                continue
            cells = []
            for c, w in COLUMNS:
                v = r[c]
                if c == "loop_hgmma" and r["loop_hmma"]:
                    v = f"{r['loop_hmma']}h"
                if c == "config" and r["candidates"] > 1:
                    v = f"{v} ({r['candidates']})"
                left = c in ("kernel", "config", "impl", "dots", "bound", "mode")
                cells.append(f"{str(v)[:w] if left else str(v):<{w}}" if left else f"{str(v):>{w}}")
            out.append(" ".join(cells) + (f"  ERROR {r['error']}" if r["error"] else ""))
        out.append("")
    out.append("== totals (sum over the kernels of one direction; vs_fla = est time / FLA's est time)")
    out.append(f"{'impl':<5}{'shape':<24}{'dtype':<6}{'dir':<5}{'kernels':>8}{'est us':>10}{'HBM GB':>9}"
               f"{'GFLOP':>9}{'spilling':>9}{'vs_fla':>8}")
    for t in totals:
        out.append(f"{t['impl']:<5}{t['shape']:<24}{t['dtype']:<6}{t['mode']:<5}{t['kernels']:>8}{t['est_us']:>10}"
                   f"{t['hbm_gb']:>9}{t['gflop']:>9}{t['spill_kernels']:>9}{str(t['vs_fla']):>8}")
    out.append("config (n): an autotuned kernel; the model picked this of its n configs.")
    return "\n".join(out)


def write_outputs(rows, totals, meta, json_path=None, csv_path=None, txt_path=None, text=""):
    import csv
    import json
    for path in (json_path, csv_path, txt_path):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(meta=meta, rows=rows, totals=totals), f, indent=1)
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["impl"])
            w.writeheader()
            w.writerows(rows)
    if txt_path:
        with open(txt_path, "w") as f:
            f.write(text + "\n")
