"""triton.compile of recorded launches for sm_90 and what the compiler answers: registers and spills
(cuobjdump --dump-resource-usage), shared memory (metadata), the TTIR (ttir.py reads it) and the SASS
(sass.py reads it). Compiles run in forked worker processes (triton.compile holds the GIL) and are cached
per kernel and specialisation (in memory, and on disk between runs: cache_dir())."""
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import tempfile

from bench.sm90.hopper import SM90_TARGET
from bench.sm90.sass import NARROW_GLOBAL, program, sass_instructions, sass_loop
from bench.sm90.ttir import read_ttir


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
    narrow: int = 0                 # global loads / stores of 1 or 2 bytes (LDG/STG .U8/.S8/.U16/.S16):
    #                                 element-wise tile access, the compiler did not vectorise it
    error: str = ""
    chunks: int = 0                 # the chunks per sequence this was read at (seq_chunks)
    prog: list = dataclasses.field(default_factory=list, repr=False)     # sass.program of the SASS
    ttir_loops: list = dataclasses.field(default_factory=list)           # ttir.read_ttir's "loops"


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


_BUILDS, _READS, _PROGS = {}, {}, {}


def _build_key(launch):
    """What a compile depends on besides triton's version and the kernel's source. The options' extern
    libraries (libdevice) enter by file name: their absolute paths are the venv's, and with them in the key
    every clone's venv compiled everything again (tests/test_sm90_aot.py: ~100 s instead of ~20)."""
    options = {k: tuple((name, os.path.basename(path)) for name, path in v) if k == "extern_libs" else v
               for k, v in launch.options.items()}
    return (launch.fn.__module__, launch.kernel, repr(sorted(launch.signature.items())),
            repr(sorted(launch.constexprs.items())), repr(sorted(launch.attrs.items())),
            repr(sorted(options.items())))


CACHE_ENV = "GDN_PACKED_SM90_CACHE"


def cache_dir():
    """Where build() keeps its answers between runs: $GDN_PACKED_SM90_CACHE, else ~/.cache/gdn_packed/sm90
    ('' or 'off' turns the disk cache off)."""
    d = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "gdn_packed", "sm90"))
    return "" if d in ("", "off") else d


def _disk_path(launch):
    """The disk cache file of a launch: keyed by triton's version, the kernel's source with its
    dependencies (JITFunction.cache_key) and the specialisation, so an edited kernel is compiled again."""
    import triton
    text = repr((triton.__version__, launch.fn.cache_key, _build_key(launch)))
    return os.path.join(cache_dir(), hashlib.sha256(text.encode()).hexdigest()[:32] + ".json")


def build(launch):
    """triton.compile of one recorded launch for sm_90 (cached per kernel and specialisation, in memory
    and on disk, see cache_dir): {"shared", "ttir", "ttgir", "resources", "sass"} or {"error"}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    key = _build_key(launch)
    if key in _BUILDS:
        return _BUILDS[key]
    path = _disk_path(launch) if cache_dir() else ""
    if path and os.path.exists(path):
        with open(path) as f:
            _BUILDS[key] = json.load(f)
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
    if path and "error" not in out:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
            json.dump(out, f)
        os.replace(f.name, path)
    return out


def compile_launch(launch, seq_chunks):
    """Compiles one recorded launch for sm_90 and reads it (see Compiled). seq_chunks: the trip count
    assumed for a data-dependent loop that holds a dot (chunks per sequence at the report's shape); a
    kernel that splits every sequence into segments says so with a run-time scalar argument named
    `segments`, and its data-dependent chunk loop counts cdiv(seq_chunks, segments) trips (cdiv of that by
    `pieces`, a scalar of that name: the forward's pass A walking halves of the segments)."""
    seg = -(-seq_chunks // max(1, int(launch.scalars.get("segments", 1))))
    chunks, seq_chunks = seq_chunks, -(-seg // max(1, int(launch.scalars.get("pieces", 1))))
    key = (_build_key(launch), chunks, seq_chunks, repr(sorted(launch.scalars.items())))
    if key in _READS:
        return _READS[key]
    b = build(launch)
    out = _READS[key] = Compiled(chunks=chunks)
    if "error" in b:
        out.error = b["error"]
        return out
    out.smem = b["shared"]
    out.regs = int(re.search(r"REG:(\d+)", b["resources"]).group(1))
    out.spill = sum(int(x) for x in re.findall(r"(?:STACK|LOCAL):(\d+)", b["resources"]))
    ir = read_ttir(b["ttir"], launch.scalars, seq_chunks)
    out.flops, out.bytes_ld, out.bytes_st, out.seq_loop, out.seq_trips, out.dots = (
        ir["flops"], ir["ld"], ir["st"], ir["seq_loop"], ir["seq_trips"], ir["dots"])
    out.ttir_loops = ir["loops"]
    if "prog" not in _PROGS.get(key[0], {}):
        _PROGS[key[0]] = dict(prog=program(b["sass"]))
    out.prog = _PROGS[key[0]]["prog"]
    ins = sass_instructions(b["sass"])
    out.hgmma = sum(op.startswith("HGMMA") for _, op, _ in ins)
    out.hmma = sum(op.startswith("HMMA") for _, op, _ in ins)
    out.narrow = sum(bool(NARROW_GLOBAL.match(op)) for _, op, _ in ins)
    out.loop = sass_loop(ins)
    return out


def _cuobjdump(flag, path):
    return subprocess.run([os.path.join(_bindir(), "cuobjdump"), flag, path], capture_output=True, text=True,
                          check=True).stdout


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
    on_disk = [lc for k, lc in todo.items() if k not in _BUILDS and cache_dir() and os.path.exists(_disk_path(lc))]
    for lc in on_disk:
        build(lc)
    todo = {k: lc for k, lc in todo.items() if k not in _BUILDS}
    log(f"compiling {len(todo)} distinct kernels for sm_90" + (f" ({len(on_disk)} more from {cache_dir()})"
                                                               if on_disk else ""))
    _TODO[:] = list(todo.values())
    with multiprocessing.get_context("fork").Pool(max(1, workers)) as pool:
        for i, (key, out) in enumerate(zip(todo, pool.imap(_build_nth, range(len(_TODO)))), 1):
            _BUILDS[key] = out
            if i % 10 == 0 or i == len(todo):
                log(f"  {i}/{len(todo)}")
    _TODO.clear()
