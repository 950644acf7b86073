"""The sm_90a CUDA chunked forward (csrc/chunk_gdr_fwd_sm90.cu, backend="cuda"), the backward's reverse
dS pass (csrc/chunk_gdr_bwd_sm90.cu) and its chunk-parallel gradients (csrc/chunk_gdr_grads_sm90.cu) in
`python -m bench kernels`.

It is compiled here with nvcc for sm_90a (the CuTe headers of the pinned nvidia-cutlass; cached on disk
beside the Triton compiles, keyed by the csrc sources), and its SASS goes through the same simulator at
the same constants as the Triton kernels (sass.simulate, model.CONSTANTS). What differs is the CTA: one
per (V-block, value head, sequence), three warpgroups each running its own loop (bench/NOTES.md, "The
sm_90a CUDA chunked forward"), so the loops are simulated one by one and combined per CTA of n chunks:

    state   the state warpgroup's chunk loop, one warp's path: s cycles a chunk       -> n s
    ring    the prep warpgroup's loop (p a chunk it preps: every other chunk) behind the k / q / v
            ring of S stages: chunk j + S is loaded into chunk j's stage once both CTAs' state
            warpgroups have released it (at the start of step j + 1, once O's TMA store has read
            it), lands ldg later and is prepped before step j + S can start           -> n (ldg + p) / (S - 1)
    producer the producer warp's loop (table row, g / beta, TMA loads): r a chunk     -> n r
    issue   one warp of each warpgroup per SM sub-partition (a scheduler each):
            i_state + i_prep / 2 + i_producer instructions a chunk                     -> n (...)
    mma     the SM's tensor pipe: m_state + m_prep / 2 cycles a chunk                  -> n (...)
    D(n) =  max(n s, n (ldg + p) / (S - 1), n r, issue, mma) + ldg + p (the pipeline's fill: the first
            chunk's TMA loads and its prep before the state's first step)

the CTAs to the 132 SMs (1 CTA per SM) in launch order (model._schedule), bytes and FLOPs as for the
Triton kernels (tiles per CTA: the K-half of k and q it multicasts to both CTAs of its cluster, its v
half and o per chunk, its half of h0 / ht; on GVA pairs, chunk_gdr_fwd_sm90_pair_kernel, phase
"fwd_pair", the same CTA in a cluster of 4 loading one of the four k / q blocks a stage for the pair's
four CTAs in place of its K-halves; the footprint at HBM's rate, re-reads at L2's), and shared
memory as for them (smem_cycles: each role's warps times its loop's wavefronts, with the bank conflicts
banks.py resolves, and its warpgroup MMAs' operand reads, plus what the TMA loads, the TMA store of O
and the bulk copies to the peer move through shared memory, per busy SM); latency combined with max(bytes,
smem) as for them (model.bounded, at 1 CTA per SM: near their sum when they are close; the producer
warp's TMA ring may hide more than a Triton kernel's own loads do, which only a GPU can say). Without the
shared-memory term this model put the forward at 0.57-0.74 of its H200 times (bench/NOTES.md, "The
shared-memory term of the sm_90a kernels"). A sequence's
last chunk, the only one that can be partial (its dead rows zeroed, its rows stored one by one), runs
outside the chunk loops, so the loops simulated are the common chunk's. The op's other launches (the
chunk table) are recorded from the op body with backend="cuda" and the kernel launch itself stubbed
(launches.Recorder).

The state-only kernel (chunk_gdr_fwd_sm90_state_kernel, phase "fwd_state": the forward's kernel="state",
forced only) runs after Triton prep,
whose launch is recorded and modelled as the Triton kernels are: the same CTA without a prep loop (D(n) of
its state and producer loops; the ring the loads alone), each chunk's Ts or M (multicast), gate rows and
chunk decay read in place of g, beta, and no prep FLOPs.

The split kernel (chunk_gdr_fwd_sm90_split_kernel, phase "fwd_split", and on GVA pairs
chunk_gdr_fwd_sm90_split_pair_kernel, "fwd_split_pair": the forward where the fused kernel's
CTAs would leave half the SMs idle, gdn_packed.cuda.chunk.forward_kernel) runs the state-only kernel's
state CTA beside a prep CTA of two prep warpgroups, two of each a (value head, sequence) in a cluster of
4 (the pair form: a cluster of 8, the pair's four state CTAs sharing each k / q load). Per chunk step its
state CTA is bound as the state-only kernel's, but for the ring: 4 prep warpgroups
take the chunks in turn, each reloading its stage once it has prepped (ldg + p per 4 chunks); its prep
CTA issues p_instr / 2 + r_instr / 2 a sub-partition and p_mma / 2 on the tensor pipe; its shared memory is
the prep loop's over 2 (every other chunk), and for every other chunk its whole k / q tiles loaded and two
copies of Ts, M and gates read, against the state CTA's (which receives that copy in place of Triton prep's loads). One CTA per
SM, so the slower of the two kinds bounds each term; the bytes: the state CTAs' tiles and the prep CTAs'
q, k and g, beta (and the kept prep outputs), no Ts / M through memory.

The dS pass (cta_cycles without a prep loop, bwd_estimate): one CTA per (V-block, value head, sequence),
two roles, the dS warpgroup's chunk loop (its "state" loop: s cycles a chunk, the three dependent wgmma groups of
dstate_step) and the producer's (r): D(n) = max(n s, n ldg / (S - 1) (the ring: a stage reloaded once
both CTAs' dS steps released it), n r, issue, mma) + ldg; tiles per CTA and chunk: its K-halves of k
and q and Ts or M (multicast: counted once), its dO columns, the gate rows, the stores of dSn^T, dX'^T
and dv; shared memory as the forward's (smem_cycles).

The chunk-parallel gradients (phase "grads", grads_estimate): one CTA per (chunk slot, qk head), not
persistent; its two sides' value-head loops (dq, dk: _grads_roles, told apart by the dk side's nested K-half
loop; each simulated with its V-block loop twice) and the producer's; per CTA the slower side's path (its
start, G value heads of its loop, its end: the code outside the loop simulated too, _grads_regions), the
tensor pipe's sum over both sides, the issue of one warp of each side a sub-partition; every tile read once;
shared memory as the others', over the sides' whole paths.

The backward of backend="cuda" is recorded as the Triton backward on the prep outputs the forward kept (the
recompute, finalize) with its dS pass (pass A, combine, pass) and its P / dq / A / dk kernels replaced by
the two kernels' launches (gdn_packed/triton/chunk.py's `dstate` and `grads` hooks)."""
import bisect
import collections
import dataclasses
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import tempfile

from bench.sm90 import banks
from bench.sm90 import model as M
from bench.sm90 import sass
from bench.sm90.hopper import CLOCK_HZ, HBM_BPS, NUM_SMS, SM_BPS, TC_FLOPS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
SOURCE = os.path.join(CSRC, "chunk_gdr_fwd_sm90.cu")
KERNEL = "chunk_gdr_fwd_sm90_kernel"
PAIR_KERNEL = "chunk_gdr_fwd_sm90_pair_kernel"       # the same on GVA pairs, a cluster of 4 sharing k / q
STATE_KERNEL = "chunk_gdr_fwd_sm90_state_kernel"     # the two-kernel forward's, after Triton prep
SPLIT_KERNEL = "chunk_gdr_fwd_sm90_split_kernel"     # state CTAs fed by prep CTAs, a cluster of 4
SPLIT_PAIR_KERNEL = "chunk_gdr_fwd_sm90_split_pair_kernel"   # the same on GVA pairs, a cluster of 8
SPLIT = ("fwd_split", "fwd_split_pair")               # the split kernels' phases
BWD_SOURCE = os.path.join(CSRC, "chunk_gdr_bwd_sm90.cu")      # the backward's reverse dS pass
BWD_KERNEL = "chunk_gdr_bwd_sm90_kernel"
BWD_PAIR_KERNEL = "chunk_gdr_bwd_sm90_pair_kernel"    # the same on GVA pairs, a cluster of 4 sharing k / q
BWD_THREADS = 256
GRADS_SOURCE = os.path.join(CSRC, "chunk_gdr_grads_sm90.cu")  # the backward's chunk-parallel gradients
GRADS_KERNEL = "chunk_gdr_grads_sm90_kernel"
# per phase: the file, its kernel, the roles of its loops (_role_loops; the dS warpgroup's loop is "state")
KERNELS = {"fwd": (SOURCE, KERNEL, {"state", "prep", "producer"}),
           "fwd_pair": (SOURCE, PAIR_KERNEL, {"state", "prep", "producer"}),
           "fwd_state": (SOURCE, STATE_KERNEL, {"state", "producer"}),
           "fwd_split": (SOURCE, SPLIT_KERNEL, {"state", "prep", "producer", "prep_producer"}),
           "fwd_split_pair": (SOURCE, SPLIT_PAIR_KERNEL, {"state", "prep", "producer", "prep_producer"}),
           "bwd": (BWD_SOURCE, BWD_KERNEL, {"state", "producer"}),
           "bwd_pair": (BWD_SOURCE, BWD_PAIR_KERNEL, {"state", "producer"}),
           "grads": (GRADS_SOURCE, GRADS_KERNEL, {"dq", "dk", "producer"})}
THREADS, V_BLOCK, HEAD_DIM, STAGES = 384, 64, 128, 3     # STAGES: the k / q / v ring (kStages)
PREP_PIPES = 4                     # the split kernel's prep warpgroups a head (2 prep CTAs x kPrepWgs)
CLUSTER = {"fwd": 2, "fwd_pair": 4, "fwd_state": 2, "fwd_split": 4, "fwd_split_pair": 8, "bwd": 2, "bwd_pair": 4,
           "grads": 1}                                  # CTAs a cluster
BLOCK = 64 * 64 * 2                # kBlock: one [64 rows, 64 columns] 16-bit block of shared memory
# per chunk and CTA, the bytes the TMA / bulk copies move through its shared memory: a stage of the ring
# (the kernels' expect-tx counts, kStageBytes: k, q, v; kBwdStageBytes: k, q, Ts, M, dO, the gate rows),
# the stores (O; dX'^T, dv: the dS pass stores dSn^T from registers) and the forward's Ts / M / gates bulk
# copy to the peer (kPrepBytes: every other chunk sent, every other one received; tests/test_cuda_chunk_model.py
# finds both counts in the SASS);
# the state-only kernel's stage as the forward's, O, and its prep buffer as loaded (kPrepInBytes: Ts, M and
# the first 4 gate rows); the split kernel's state CTA as the state-only one's with the prep CTA's copy
# (kPrepBytes) in place of those loads, its prep CTA (per chunk it preps) both K-halves of k and q in, two
# copies out
STAGE_BYTES = {"fwd": 5 * BLOCK, "bwd": 7 * BLOCK + 1280}
PEER_BYTES = 2 * BLOCK + 1040
PREP_IN_BYTES = 2 * BLOCK + 1024
TMA_BYTES = {"fwd": STAGE_BYTES["fwd"] + BLOCK + PEER_BYTES, "fwd_pair": STAGE_BYTES["fwd"] + BLOCK + PEER_BYTES,
             "fwd_state": STAGE_BYTES["fwd"] + BLOCK + PREP_IN_BYTES,
             "fwd_split": STAGE_BYTES["fwd"] + BLOCK + PEER_BYTES, "fwd_split_pair": STAGE_BYTES["fwd"] + BLOCK + PEER_BYTES,
             "bwd": STAGE_BYTES["bwd"] + 2 * BLOCK, "bwd_pair": STAGE_BYTES["bwd"] + 2 * BLOCK}
SPLIT_PREP_BYTES = 4 * BLOCK + 2 * PEER_BYTES
ROLE_WARPS = {"state": 4, "prep": 4, "producer": 1, "prep_producer": 1}     # the warps that run each role's loop
# the chunk-parallel gradients: per (chunk slot, qk head) its q, k, row factors (kGradsTileBytes), per value head
# and V-block a stage (kGradsStageBytes: dO, v, U^T, dX'^T, S^T, dSn^T and the gate rows)
GRADS_TILE_BYTES = 4 * BLOCK + 2 * 64 * 4
GRADS_STAGE_BYTES = 8 * BLOCK + 5 * 64 * 4
V_BLOCKS = 2                       # kVBlocks: the V-blocks of a value head (the gradients' inner loops' trips)
GRADS_REGIONS = ("dq_pre", "dq_tail", "dk_pre", "dk_tail")   # the gradient sides' code outside their loops
DTYPES = ("bf16", "fp16")          # the kernel's inputs (fp32: refused, no row)


def takes(dims, dtype):
    """Whether backend="cuda" takes the shape (N, L, H, HV, K, V) and dtype (else it refuses: no row)."""
    return dims[4] == dims[5] == HEAD_DIM and dtype in DTYPES


def find_tool(name):
    """nvcc / cuobjdump: next to $CUDACXX, on PATH, in /usr/local/cuda/bin; cuobjdump also the copy
    triton ships (a CUDA toolkit may have nvcc and ptxas only)."""
    where = [os.path.join(os.path.dirname(os.environ.get("CUDACXX") or "/nonexistent"), name), shutil.which(name),
             f"/usr/local/cuda/bin/{name}"]
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.submodule_search_locations:
        where.append(os.path.join(list(spec.submodule_search_locations)[0], "backends", "nvidia", "bin", name))
    for c in where:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def cutlass_include():
    """The CuTe / CUTLASS headers of the nvidia-cutlass wheel (a build requirement), or None."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    return d if os.path.isdir(os.path.join(d, "cute")) else None


def nvcc_command(src, obj):
    """The sm_90a compile of `src` as the build makes it (CMakeLists.txt: -lineinfo too, which can change
    the code: without it nvcc split one of prep's 8-byte loads into two, +6 wavefronts a warp, in the
    state-only kernel's first build), with ptxas's report."""
    return [find_tool("nvcc"), "-c", src, "-o", obj, "-std=c++17", "-O3", "-I", CSRC, "-I", cutlass_include(),
            "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas", "-v", "-DGDN_CUDA_ARCHS=\"80,90a\"",
            "-gencode=arch=compute_90a,code=sm_90a"]


def missing():
    """'' when the kernel can be compiled here (its SASS read where cuobjdump is found), else why not."""
    if find_tool("nvcc") is None:
        return "no nvcc (CUDA toolkit: $CUDACXX, PATH or /usr/local/cuda/bin)"
    if cutlass_include() is None:
        return "the CuTe headers of nvidia-cutlass==4.2.0.0 (a build requirement) are not installed"
    return ""


_BUILD = {}


def _line_table(text):
    """{function: [[address, "file:line"], ...]} from nvdisasm -g output: each function's instructions' csrc
    lines (the innermost one of an inlined call), an entry where the line changes."""
    out, name, cur = {}, None, None
    for line in text.split("\n"):
        m = re.match(r"\s*\.section\s+\.text\.([^,\s]+)", line)
        if m:
            name, cur = m.group(1), None
            out[name] = []
            continue
        m = re.search(r'File "([^"]+)", line (\d+)', line)
        if m and "inlined at" not in line:
            cur = f"{os.path.basename(m.group(1))}:{m.group(2)}"
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+\S", line)
        if m and name is not None and (not out[name] or out[name][-1][1] != cur):
            out[name].append([int(m.group(1), 16), cur])
    return out


def _object_lines(obj, tmp):
    """The line table (_line_table) of an object's sm_90a cubin (extracted with cuobjdump -xelf into tmp), or
    {} without cuobjdump / nvdisasm or with other than one such cubin. Kept with the object's SASS, so that
    the line attribution reads the very code the model does: two compiles of the same source and command
    have differed (2026-12-05: 338 or 341 LDS in the fused kernel, from one run to the next; cause unknown)."""
    dump, dis = find_tool("cuobjdump"), find_tool("nvdisasm")
    if not dump or not dis:
        return {}
    subprocess.run([dump, "-xelf", "all", obj], cwd=tmp, capture_output=True, check=True)
    cubins = glob.glob(os.path.join(tmp, "*sm_90a*.cubin"))
    if len(cubins) != 1:
        return {}
    return _line_table(subprocess.run([dis, "-g", "-c", cubins[0]], capture_output=True, text=True, check=True).stdout)


def nvcc_cached(tag, source, cmd, key_files):
    """{"ptxas": ptxas -v text, "sass": cuobjdump -sass text ('' without cuobjdump), "lines": its sm_90a
    code's line table (_object_lines; {} without nvdisasm)} of `source` compiled by cmd(source, obj) (an
    nvcc command line), or {"error"}: cached in memory and on disk beside the
    Triton compiles (bench.sm90.toolchain.cache_dir) as <tag>_<hash>.json, keyed by nvcc's version, the
    command and the contents of key_files (the source and what it includes), so tests/test_build.py and
    the report share one compile. Used for csrc/chunk_gdr_*_sm90.cu here and csrc/chunk_table.cu
    (cuda_table.py)."""
    from bench.sm90.toolchain import cache_dir
    if (tag, source) in _BUILD:
        return _BUILD[tag, source]
    nvcc = find_tool("nvcc")
    if nvcc is None:
        return dict(error="no nvcc (CUDA toolkit: $CUDACXX, PATH or /usr/local/cuda/bin)")
    h = hashlib.sha256(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    h.update(" ".join(cmd(source, "k.o")).encode())
    h.update(b"lines")                    # (the entries' fields: ptxas, sass, lines)
    for p in sorted(key_files):
        with open(p, "rb") as f:
            h.update(os.path.basename(p).encode() + f.read())
    path = os.path.join(cache_dir(), f"{tag}_{h.hexdigest()[:32]}.json") if cache_dir() else ""
    if path and os.path.exists(path):
        with open(path) as f:
            _BUILD[tag, source] = json.load(f)
        return _BUILD[tag, source]
    with tempfile.TemporaryDirectory(prefix=f"gdn_{tag}_") as tmp:
        obj = os.path.join(tmp, "k.o")
        p = subprocess.run(cmd(source, obj), capture_output=True, text=True)
        if p.returncode:
            return dict(error=f"nvcc failed: {(p.stderr or p.stdout).strip().splitlines()[-1][:300]}")
        dump = find_tool("cuobjdump")
        out = dict(ptxas=p.stdout + p.stderr, sass=subprocess.run([dump, "-sass", obj], capture_output=True, text=True,
                                                                  check=True).stdout if dump else "")
        out["lines"] = _object_lines(obj, tmp)
    _BUILD[tag, source] = out
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
            json.dump(out, f)
        os.replace(f.name, path)
    return out


def build(source=SOURCE):
    """nvcc_cached of an sm_90a chunked kernel's file (the forward's by default; csrc/*_sm90.cu) as the
    build compiles it (nvcc_command), keyed by every csrc source and header, or {"error"}."""
    why = missing()
    if why:
        return dict(error=why)
    keys = glob.glob(os.path.join(CSRC, "*.cu*")) + glob.glob(os.path.join(CSRC, "*.h"))
    return nvcc_cached("cuda_chunk", source, nvcc_command, keys)


@dataclasses.dataclass
class Facts:
    """The compile of one instantiation: launch registers, spills, shared memory, and per loop (state,
    prep, producer) one iteration's simulated cycles, instructions, MMA cycles, HGMMA and waits."""
    regs: int = 0
    spill: int = 0
    smem: int = 0
    loops: dict = dataclasses.field(default_factory=dict)
    error: str = ""


def _instantiates(name, dtype, kernel):
    """Whether a (mangled) function name is the dtype's instantiation (bf16: __nv_bfloat16, fp16: __half) of
    `kernel`."""
    return kernel in name and ("13__nv_bfloat16" if dtype == "bf16" else "6__half") in name


def _function_body(text, separator, dtype, kernel):
    """The part of a disassembly (`text`, split at the regular expression `separator` before every
    function) that is the dtype's instantiation of `kernel` (_instantiates), or ''."""
    for body in re.split(separator, text)[1:]:
        if _instantiates(body.split("\n", 1)[0], dtype, kernel):
            return body
    return ""


def _kernel_sass(text, dtype, kernel=KERNEL):
    """The SASS (cuobjdump -sass) of the dtype's instantiation of `kernel`."""
    return _function_body(text, r"\n\s*Function : ", dtype, kernel)


def _role_loops(prog):
    """{role: (first, last)} of the kernel's loops (backward branches before its last EXIT): state holds
    a 64x128 HGMMA, prep only 64x64 ones, the producer the TMA loads (UTMALDG), some multicast to the
    cluster; the split kernel's prep CTA's producer (prep_producer) loads its k and q itself (none
    multicast)."""
    last_exit = max(x.addr for x in prog if x.op == "EXIT")
    index = {x.addr: i for i, x in enumerate(prog)}
    roles = {}
    for j, x in enumerate(prog):
        if x.target is None or not x.target < x.addr < last_exit or x.target not in index:
            continue
        ops = [y.op for y in prog[index[x.target]:j + 1]]
        role = ("state" if any(o.startswith("HGMMA.64x128") for o in ops) else
                "prep" if any(o.startswith("HGMMA") for o in ops) else
                "producer" if any(o.startswith("UTMALDG") and "MULTICAST" in o for o in ops) else
                "prep_producer" if any(o.startswith("UTMALDG") for o in ops) else None)
        if role and (role not in roles or j - index[x.target] > roles[role][1] - roles[role][0]):
            roles[role] = (index[x.target], j)
    return roles


def _grads_roles(prog):
    """{role: (first, last)} of the chunk-parallel gradient kernel's loops: of the two outermost loops holding
    HGMMA (each side's value-head loop, its V-block loop inside), dk the one with more such loops inside
    (its V-block loop holds its K-half loop of U dSn^T), dq the other; producer the loop holding its TMA
    loads."""
    last_exit = max(x.addr for x in prog if x.op == "EXIT")
    index = {x.addr: i for i, x in enumerate(prog)}
    spans = [(index[x.target], j) for j, x in enumerate(prog)
             if x.target is not None and x.target < x.addr < last_exit and x.target in index]
    hgmma = lambda a, b: sum(prog[i].op.startswith("HGMMA") for i in range(a, b + 1))   # noqa: E731
    mma = [sp for sp in spans if hgmma(*sp)]
    outer = [sp for sp in mma if not any(o != sp and o[0] <= sp[0] and sp[1] <= o[1] for o in mma)]
    roles = {}
    if len(outer) == 2:
        dq, dk = sorted(outer, key=lambda o: sum(o[0] <= sp[0] and sp[1] <= o[1] for sp in mma))
        roles.update(dq=dq, dk=dk)
    tma = [sp for sp in spans if any(prog[i].op.startswith("UTMALDG") for i in range(sp[0], sp[1] + 1))]
    if tma:
        roles["producer"] = max(tma, key=lambda sp: sp[1] - sp[0])
    return roles


def _grads_regions(prog, roles):
    """{region: [(first, last), ...]} of the gradient kernel's code outside its sides' value-head loops, one
    warp's straight path each: a side's start (its Gram: the code from its entry to its loop) and its end
    (the final products and the dq / dk store: from its loop's exit to the kernel's EXIT, through the
    unguarded jump that takes the dk side to the shared store). The dk side's code comes first; its entry
    follows the guarded branch that sends the other warpgroup to the dq side's entry."""
    index = {x.addr: i for i, x in enumerate(prog)}

    def target(x):
        return index.get(int(x.rest.split()[0].rstrip(";"), 16)) if x.op == "BRA" else None

    def to_exit(i):
        while prog[i].op != "EXIT":
            i += 1
        return i
    (ak, bk), (aq, bq) = roles["dk"], roles["dq"]
    j = bk + 1                                       # the dk side's jump to the store; the dq side's code next
    while not (prog[j].op == "BRA" and not prog[j].guarded):
        j += 1
    forks = [i for i in range(ak) if prog[i].op == "BRA" and prog[i].guarded and target(prog[i]) == j + 1]
    if not forks:
        return {}
    return dict(dk_pre=[(forks[-1] + 1, ak - 1)], dq_pre=[(j + 1, aq - 1)],
                dk_tail=[(bk + 1, j), (target(prog[j]), to_exit(target(prog[j])))], dq_tail=[(bq + 1, to_exit(bq + 1))])


def _simulate_path(prog, ranges, const, wavefronts=None):
    """The straight path through `ranges` ([(first, last)] of prog, in order) simulated once, as
    _simulate_loop's dict."""
    order = [i for a, b in ranges for i in range(a, b + 1)]
    sub = [prog[i] for i in order]
    wf = {k: wavefronts[i] for k, i in enumerate(order) if i in (wavefronts or {})}
    r = sass.simulate(sub, lambda _k, _l: 1, const.lat, wavefronts=wf)
    per = {k: r[k] for k in ("cycles", "instr", "mma_cycles", "smem", "smem_mma")}
    per["stalls"] = dict(r["stalls"])
    return dict(per, **_mma_counts(sub))


def _mma_counts(sub):
    """The warpgroup MMAs of a stretch of SASS: hgmma (count), shapes (by shape), waits."""
    return dict(hgmma=sum(x.op.startswith("HGMMA") for x in sub),
                shapes=dict(collections.Counter(re.match(r"HGMMA\.(\d+x\d+x\d+)", x.op).group(1)
                                                for x in sub if x.op.startswith("HGMMA"))),
                waits=sum(x.op.startswith("WARPGROUP.DEPBAR") for x in sub))


def _simulate_loop(prog, span, const, wavefronts=None, inner=1):
    """One iteration of a loop simulated alone (inner loops `inner` times): cycles, instr, mma_cycles, smem (one
    warp's shared-memory wavefronts, `wavefronts` {index in prog: wavefronts} where banks.py resolved the
    addresses), smem_mma (its warpgroup MMAs' operand reads), stalls, hgmma, shapes (HGMMA by shape),
    waits. A bulk copy to the cluster peer's shared memory (UBLKCP: prep's
    Ts / M / gates) completes on the peer's mbarrier, which this warp never waits for: it is issued like
    any instruction, not queued as a load that this warp's next mbarrier wait would wait for
    (sass.simulate's TMA rule)."""
    sub = [dataclasses.replace(x, op="PEER." + x.op) if x.op.startswith("UBLKCP") else x
           for x in prog[span[0]:span[1] + 1]]

    wf = {i - span[0]: w for i, w in (wavefronts or {}).items() if span[0] <= i <= span[1]}

    def run(n):
        return sass.simulate(sub, lambda k, _l: n if k == 0 else inner, const.lat, wavefronts=wf)
    r4, r8 = run(4), run(8)
    per = {k: (r8[k] - r4[k]) / 4 for k in ("cycles", "instr", "mma_cycles", "smem", "smem_mma")}
    per["stalls"] = {k: (r8["stalls"].get(k, 0.0) - r4["stalls"].get(k, 0.0)) / 4 for k in r8["stalls"]}
    return dict(per, **_mma_counts(sub))


def facts(dtype, const, phase="fwd"):
    """Facts of the dtype's instantiation of the phase's kernel (KERNELS) at the model's constants."""
    source, kernel, want = KERNELS[phase]
    out = build(source)
    if "error" in out:
        return Facts(error=out["error"])
    body = _kernel_sass(out["sass"], dtype, kernel)
    if not body:
        return Facts(error=f"no {kernel} for {dtype} in the SASS" if out["sass"] else "no cuobjdump: SASS not read")
    recs = [r for r in parse_ptxas(out["ptxas"])
            if kernel in r["name"] and ("bfloat16" in r["name"]) == (dtype == "bf16")]
    prog = sass.program(body)
    roles = _grads_roles(prog) if phase == "grads" else _role_loops(prog)
    if set(roles) != want:
        return Facts(error=f"the kernel's loops not found in its SASS: {sorted(roles)}")
    regs, spill = (recs[0]["registers"], recs[0]["spill"] + recs[0]["stack"]) if recs else (0, 0)
    wf = banks.conflict_wavefronts(prog)
    inner = V_BLOCKS if phase == "grads" else 1      # (a value head's V-blocks, a V-block's two K-halves)
    loops = {r: _simulate_loop(prog, span, const, wf, inner) for r, span in roles.items()}
    if phase == "grads":
        regions = _grads_regions(prog, roles)
        if set(regions) != set(GRADS_REGIONS):
            return Facts(error=f"the sides' starts and ends not found in the SASS: {sorted(regions)}")
        loops.update({r: _simulate_path(prog, rs, const, wf) for r, rs in regions.items()})
    return Facts(regs=regs, spill=spill, smem=_smem_bytes(phase), loops=loops)


def smem_by_line(phase="fwd", dtype="bf16"):
    """Where a role's shared-memory wavefronts come from: {role: [(source line, instructions, wavefronts)]},
    most first, for one warp's path through each of the phase's loops (_role_loops), the wavefronts as
    _simulate_loop counts them (bank conflicts resolved by banks.py), each instruction attributed to its
    csrc line (the innermost one of an inlined call; an instruction of a CUDA or CuTe header's inlined
    function, e.g. smem_u32's address conversion, to the csrc line of the instruction before it) by the line
    table kept with the compile the model reads (build: nvdisasm -g of its object's cubin; the build passes
    -lineinfo). {"error": why} without nvcc / cuobjdump / nvdisasm."""
    source, kernel, want = KERNELS[phase]
    out = build(source)
    if "error" in out:
        return dict(error=out["error"])
    if not out.get("sass") or not out.get("lines"):
        return dict(error="no " + ", ".join(t for t in ("cuobjdump", "nvdisasm") if not find_tool(t)) or
                    "no line table in the compile")
    prog = sass.program(_kernel_sass(out["sass"], dtype, kernel))
    names = [n for n in out["lines"] if _instantiates(n, dtype, kernel)]
    table = out["lines"][names[0]] if len(names) == 1 else []
    addrs = [a for a, _ in table]
    where = {x.addr: table[bisect.bisect_right(addrs, x.addr) - 1][1] for x in prog
             if addrs and x.addr >= addrs[0]}
    ours, last = set(os.listdir(CSRC)), None     # a header's inlined line (CUDA's, CuTe's): the csrc line before it
    for x in prog:
        line = where.get(x.addr)
        if line and line.split(":")[0] in ours:
            last = line
        elif x.addr in where and last:
            where[x.addr] = last
    roles = _role_loops(prog)
    if set(roles) != want or not where:
        return dict(error=f"the kernel's loops or line table not found: {sorted(roles)}")
    wf = banks.conflict_wavefronts(prog)
    out = {}
    for role, (first, last) in roles.items():
        n, w = collections.Counter(), collections.Counter()
        for i in range(first, last + 1):
            x = wf.get(i, sass.smem_wavefronts(prog[i].op))
            if x:
                n[where.get(prog[i].addr)] += 1
                w[where.get(prog[i].addr)] += x
        out[role] = [(line, n[line], w[line]) for line, _ in w.most_common()]
    return out


def format_smem_by_line(phase="fwd", dtype="bf16", top=12):
    """smem_by_line as text: per role its wavefronts a warp and the `top` source lines."""
    got = smem_by_line(phase, dtype)
    if "error" in got:
        return f"shared memory by source line ({phase}, {dtype}): {got['error']}"
    text = [f"shared memory by source line: {KERNELS[phase][1]} ({dtype}), one warp's wavefronts per iteration "
            "of each role's loop (bank conflicts resolved; a chunk's total: smem_cycles)"]
    for role, rows in got.items():
        text.append(f"  {role}: {sum(w for _, _, w in rows):g} wavefronts")
        text += [f"    {line or '?':40s} {n:4d} instr {w:6g}" for line, n, w in rows[:top]]
    return "\n".join(text)


def parse_ptxas(text):
    """[{name, arch, registers, smem, spill, stack}] from `-Xptxas -v` output."""
    recs, cur_arch, rec = [], None, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            cur_arch = m.group(2)
            rec = dict(name=m.group(1), arch=cur_arch, registers=None, smem=0, spill=0, stack=0)
            recs.append(rec)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m and (rec is None or m.group(1) != rec["name"]):  # a non-inlined device function
            rec = dict(name=m.group(1), arch=cur_arch, registers=None, smem=0, spill=0, stack=0)
            recs.append(rec)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and rec is not None:
            rec["stack"] = int(m.group(1))
            rec["spill"] = int(m.group(2)) + int(m.group(3))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and rec is not None:
            rec["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            rec["smem"] = int(s.group(1)) if s else 0
    return recs



def _smem_bytes(phase="fwd"):
    """The phase's kernel's dynamic shared memory (gdn_packed._C says, where it is built), else 0."""
    try:
        from gdn_packed import _cext
        kernel = "fwd" if phase.startswith("fwd") else phase.split("_")[0]   # (one size for each file's kernels)
        return int(getattr(_cext.get_C(), f"chunk_gdr_{kernel}_sm90_smem_bytes", 0) or 0)
    except Exception:  # noqa: BLE001 (the report still runs without the extension)
        return 0


NO_PREP = dict(cycles=0.0, instr=0.0, mma_cycles=0.0, hgmma=0, waits=0)   # the loops of a kernel without prep


def cta_cycles(f, n, const, phase="fwd"):
    """D(n): one CTA's cycles over n chunks (module docstring), and the term that bounds it. Without a prep
    loop (the state-only kernel, the dS kernel) the ring is the producer's loads alone: a stage is
    reloaded once both CTAs' state (dS) steps released it and must land ldg later, STAGES - 1 steps on
    (the state-only kernel: STAGES - 2, since it stores a chunk's O in the next step and releases the stage
    after that store has read it)."""
    s, p, pr = f.loops["state"], f.loops.get("prep", NO_PREP), f.loops["producer"]
    if phase in SPLIT:           # (module docstring; the prep CTA's producer loads every other chunk)
        pp = f.loops["prep_producer"]
        terms = dict(state=n * s["cycles"], ring=n * (const.lat.ldg + p["cycles"]) / PREP_PIPES,
                     producer=n * max(pr["cycles"], pp["cycles"] / 2),
                     issue=n * max(s["instr"] + pr["instr"], (p["instr"] + pp["instr"]) / 2),
                     mma=n * max(s["mma_cycles"], p["mma_cycles"] / 2))
        bound = max(terms, key=terms.get)
        return terms[bound], bound
    slack = STAGES - 2 if phase == "fwd_state" else STAGES - 1
    terms = dict(state=n * s["cycles"], ring=n * (const.lat.ldg + p["cycles"]) / slack,
                 producer=n * pr["cycles"],
                 issue=n * (s["instr"] + p["instr"] / 2 + pr["instr"]),
                 mma=n * (s["mma_cycles"] + p["mma_cycles"] / 2))
    bound = max(terms, key=terms.get)
    return terms[bound], bound


def smem_cycles(f, phase="fwd"):
    """A CTA's shared-memory cycles a chunk (128 bytes a cycle), counted as for the Triton kernels: every
    warp of a role issues its loop's path (the simulator's, both sides of a branch), so each role's
    wavefronts times its warps (ROLE_WARPS; prep's loop runs every other chunk), its warpgroup MMAs' operand
    reads once, and the bytes the TMA loads, stores and bulk copies move (TMA_BYTES)."""
    share = {"state": 1.0, "prep": 0.5, "producer": 1.0}
    part = lambda r: ROLE_WARPS[r] * f.loops[r]["smem"] + f.loops[r]["smem_mma"]   # noqa: E731
    if phase in SPLIT:           # the slower of its state CTA and its prep CTA (every other chunk)
        state = part("state") + part("producer") + TMA_BYTES[phase] / sass.SMEM_BYTES_PER_CYCLE
        return max(state, 0.5 * (part("prep") + part("prep_producer") + SPLIT_PREP_BYTES / sass.SMEM_BYTES_PER_CYCLE))
    return sum(share[r] * part(r) for r in f.loops) + TMA_BYTES[phase] / sass.SMEM_BYTES_PER_CYCLE


def estimate(f, dims, dtype, const, kept=False, phase="fwd"):
    """The model's numbers of the launch at dims = (N, L, H, HV, K, V), as model.estimate's dict; kept:
    with the prep outputs it writes for the backward (their bytes; its loop's SASS holds that code either
    way, which the simulator charges as it charges both sides of any branch). phase "fwd_state": the
    state-only kernel, which reads Triton prep's outputs in place of g, beta and runs no prep; "fwd_split":
    the split kernel, a prep CTA beside each state CTA (module docstring); "fwd_split_pair": on GVA pairs,
    each state CTA loading one of the four k / q blocks a stage for the pair's four; "fwd_pair": the fused
    kernel so, on GVA pairs."""
    N, L, H, HV, K, V = dims
    esize, C = 2, M.CHUNK
    split, pair = phase in SPLIT, phase in ("fwd_split_pair", "fwd_pair")
    pairs = 2 * HV * N                 # state CTAs (the fused and state-only kernels: every CTA)
    ctas = 2 * pairs if split else pairs
    n = -(-L // C)
    d, bound = cta_cycles(f, n, const, phase)
    fill = const.lat.ldg + f.loops.get("prep", NO_PREP)["cycles"]      # chunk 0 loaded (and prepped) before step 0
    t_lat = M._schedule([d + fill] * ctas, NUM_SMS) / CLOCK_HZ
    # tiles per CTA: the K-half of k and of q it multicasts to the cluster (one read from L2 for both CTAs),
    # its v half and o half (64 x 64) per chunk; g, beta of the chunks it preps (the state-only kernel: Ts or
    # M, multicast, the gate rows and the chunk decay); its half of h0 and of the final state (fp32)
    # (the split kernel: beside each state CTA a prep CTA loading both K-halves of k and q and g, beta of
    # every other chunk)
    state_only = phase == "fwd_state"
    prep_in = C * C * esize + 4 * C * 4 + 4
    per_chunk = (C * ((K // 2 if pair else K) + 2 * V_BLOCK) * esize
                 + (prep_in if state_only else C * K * esize + C * 4 if split else C * 4))
    # kept: a chunk slot's Ts, M, gate rows, row factors, chunk decay, by the CTA that prepped it
    keep = (2 * C * C * esize + 7 * C * 4 + 4) if kept and not state_only else 0
    tiles = pairs * (n * (per_chunk + keep / 2) + 2 * K * V_BLOCK * 4)
    footprint = (N * L * (2 * H * K + 2 * HV * V) * esize + 2 * N * HV * K * V * 4 + N * n * HV * keep
                 + (N * n * HV * (2 * C * C * esize + 4 * C * 4 + 4) if state_only else N * L * HV * 8))
    hbm = min(tiles, footprint)
    busy = min(ctas, NUM_SMS)
    t_mem = max(hbm / HBM_BPS + (tiles - hbm) / const.l2_bps, tiles / (busy * SM_BPS))
    C = M.CHUNK
    flops = pairs * n * (2 * V_BLOCK * (3 * C * K + 2 * C * C)      # state: S^T [K; Q]^T, X'^T Ts^T, U^T M^T, U^T K
                         + (0 if state_only else (4 * C * C * K + 8 * C ** 3) / 2))   # prep, every other chunk:
    t_tc = flops / TC_FLOPS["bf16"]                                                 # 2 Grams, 2 doublings
    # (the split kernel: every CTA charged its slower kind's cycles, exact while its CTAs fit one wave,
    # where forward_kernel runs it)
    t_smem = ctas * n * smem_cycles(f, phase) / busy / CLOCK_HZ
    t, top = M.bounded({"latency": t_lat, "bytes": t_mem, "smem": t_smem, "FLOPs": t_tc}, 1, const)  # 1 CTA per SM
    return dict(ctas=ctas, t_lat=t_lat, t_mem=t_mem, t_tc=t_tc, t_smem=t_smem, hbm_bytes=tiles, flops=flops,
                bound=top, lat_bound=bound, est_s=t + const.launch_s)


def bwd_estimate(f, dims, dtype, const, phase="bwd"):
    """The dS pass's numbers at dims = (N, L, H, HV, K, V), as estimate's. Tiles per CTA and chunk: the
    K-halves of k and q it multicasts (16 KB; "bwd_pair", on GVA pairs: one of the four, 8 KB), Ts or M (8
    KB, multicast), its 64 columns of dO (8 KB), the gate rows (1.3 KB); stores dSn^T (16 KB), dX'^T (8 KB),
    dv (8 KB); its halves of dht and dh0 (fp32)."""
    N, L, H, HV, K, V = dims
    share = CLUSTER[phase]                          # the CTAs among which each k / q load is multicast
    e, C = 2, M.CHUNK
    ctas = 2 * HV * N
    n = -(-L // C)
    d, bound = cta_cycles(f, n, const)
    t_lat = M._schedule([d + const.lat.ldg] * ctas, NUM_SMS) / CLOCK_HZ
    per_chunk = ((2 * C * K // share + C * C + C * V_BLOCK) * e + 5 * C * 4 + 4
                 + (V_BLOCK * K + V_BLOCK * C + C * V_BLOCK) * e)
    tiles = ctas * (n * per_chunk + 2 * K * V_BLOCK * 4)
    NC = N * n
    footprint = (N * L * (2 * H * K + 2 * HV * V) * e + NC * HV * (2 * C * C * e + 5 * C * 4 + 4)
                 + NC * HV * V * (K + C) * e + 2 * N * HV * K * V * 4)
    hbm = min(tiles, footprint)
    busy = min(ctas, NUM_SMS)
    t_mem = max(hbm / HBM_BPS + (tiles - hbm) / const.l2_bps, tiles / (busy * SM_BPS))
    flops = ctas * n * 2 * V_BLOCK * (4 * C * K + 2 * C * C)    # dS^T K^T, dO^T M, dU^T Ts, the update (3 x K)
    t_tc = flops / TC_FLOPS["bf16"]
    t_smem = ctas * n * smem_cycles(f, phase) / busy / CLOCK_HZ
    t, top = M.bounded({"latency": t_lat, "bytes": t_mem, "smem": t_smem, "FLOPs": t_tc}, 1, const)  # 1 CTA per SM
    return dict(ctas=ctas, t_lat=t_lat, t_mem=t_mem, t_tc=t_tc, t_smem=t_smem, hbm_bytes=tiles, flops=flops,
                bound=top, lat_bound=bound, est_s=t + const.launch_s)


def grads_estimate(f, dims, dtype, const):
    """The chunk-parallel gradient kernel's numbers at dims = (N, L, H, HV, K, V), as estimate's. One CTA per
    live (chunk slot, qk head), 1 per SM, not persistent (each CTA's fill exposed). Per CTA, with G = HV / H
    value heads: each side's path, its start (the Gram), G value-head iterations of its loop (each its
    V-block loop twice) and its end (the final products, the store), all simulated from the SASS
    (_grads_regions); the producer's G x 2 stage loads; the tensor pipe's sum over both sides; the issue of
    one warp of each warpgroup per sub-partition: the largest, plus ldg (the first loads). Bytes: every tile
    read once (q, k and row factors per CTA, per value head and V-block a stage, dq / dk and the shares out).
    Shared memory: what the TMA loads move, and both sides' wavefronts (4 warps each) and operand reads over
    their paths (the fp32 tiles, Grams, P, Bh, stored and read back, among them)."""
    N, L, H, HV, K, V = dims
    e, C = 2, M.CHUNK
    G = HV // H
    n = -(-L // C)
    ctas = N * n * H
    lp, pr = f.loops, f.loops["producer"]

    def path(side, key):                             # a side's start, G loop iterations, end
        return lp[side + "_pre"][key] + G * lp[side][key] + lp[side + "_tail"][key]
    terms = dict(dq=path("dq", "cycles"), dk=path("dk", "cycles"), producer=G * V_BLOCKS * pr["cycles"],
                 mma=path("dq", "mma_cycles") + path("dk", "mma_cycles"),
                 issue=path("dq", "instr") + path("dk", "instr") + G * V_BLOCKS * pr["instr"])
    bound = max(terms, key=terms.get)
    t_lat = M._schedule([terms[bound] + const.lat.ldg] * ctas, NUM_SMS) / CLOCK_HZ
    per_cta = GRADS_TILE_BYTES + G * V_BLOCKS * GRADS_STAGE_BYTES + 2 * C * K * e + 3 * G * C * 4
    tiles = ctas * per_cta                           # every tile read once: the footprint
    busy = min(ctas, NUM_SMS)
    t_mem = max(tiles / HBM_BPS, tiles / (busy * SM_BPS))
    per_vb = 2 * C * (C * V_BLOCK + K * V_BLOCK) + 2 * C * (2 * C * V_BLOCK + 2 * K * V_BLOCK + C * K)
    flops = ctas * (G * V_BLOCKS * per_vb + 2 * 2 * C * C * K + 3 * 2 * 2 * C * C * K)
    t_tc = flops / TC_FLOPS["bf16"]
    warps = ROLE_WARPS["state"]                      # (4 warps a side)
    smem = ((GRADS_TILE_BYTES + G * V_BLOCKS * GRADS_STAGE_BYTES) / sass.SMEM_BYTES_PER_CYCLE
            + sum(warps * path(sd, "smem") + path(sd, "smem_mma") for sd in ("dq", "dk"))
            + G * V_BLOCKS * pr["smem"])
    t_smem = ctas * smem / busy / CLOCK_HZ
    t, top = M.bounded({"latency": t_lat, "bytes": t_mem, "smem": t_smem, "FLOPs": t_tc}, 1, const)  # 1 CTA per SM
    return dict(ctas=ctas, t_lat=t_lat, t_mem=t_mem, t_tc=t_tc, t_smem=t_smem, hbm_bytes=tiles, flops=flops,
                bound=top, lat_bound=bound, step=terms[bound], est_s=t + const.launch_s)


@dataclasses.dataclass
class CudaLaunch:
    """A launch of one of the sm_90a kernels in a recorded case (report.py asks it for its row: row());
    kept: the forward writes prep's outputs for the backward (kept_shape)."""
    kernel: str = KERNEL
    phase: str = "fwd"
    group: int = 0
    kept: bool = False
    lane: tuple = ()

    def config_text(self):
        return ""


def record(rec, dims, dtype, meta_inputs, op_body, modes=("fwd",)):
    """The op bodies' launches with backend="cuda" (l2norm off, no h0, as launches.record_ours, whose
    meta_inputs and op_body it takes) on meta tensors into `rec` (an active launches.Recorder), as under
    autograd: fwd: chunk_gdr_fwd's torch operators and, where the forward runs the state-only kernel,
    Triton prep's launch, then a CudaLaunch for the forward kernel (gdn_packed.cuda.chunk.forward_kernel's
    choice), whose launch is stubbed (kept when the fused kernel keeps its prep outputs: kept_shape). bwd:
    chunk_gdr_bwd on the forward's kept (the Triton backward on those prep outputs, or running prep where
    the forward keeps none) with its reverse dS pass and its chunk-parallel gradients on the sm_90a kernels
    (gdn_packed.cuda.chunk.chunk_bwd_dstate_cuda, chunk_bwd_grads_cuda, stubbed), a CudaLaunch each: what
    the backward of backend="cuda" launches."""
    import torch

    from gdn_packed.cuda import chunk as cuda_chunk
    from gdn_packed.ops import _dispatch
    N, L, H, HV, K, V = dims
    q, k, v, g, beta = meta_inputs(dims, getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype]))
    cu = torch.empty(N + 1, dtype=torch.int32, device="meta")
    common = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, cu_seqlens=cu, cu_seqlens_padded=None,
                  scale=K ** -0.5, use_qk_l2norm=False, backend="cuda")
    rec.lengths = (L,) * N
    real_launch, real_dstate, real_grads = cuda_chunk.launch, cuda_chunk.chunk_bwd_dstate_cuda, cuda_chunk.chunk_bwd_grads_cuda

    def fwd_launch(entry, device, *, reads, writes, **scalars):     # the forward kernels: modelled, not run
        phase = ("fwd_state" if reads["prep_ts"] is not None else
                 ("fwd_split" if scalars["split"] else "fwd") + ("_pair" if scalars["pairs"] else ""))
        rec.launches.append(CudaLaunch(KERNELS[phase][1], phase, kept=writes["kept_ts"] is not None))
    cuda_chunk.launch = fwd_launch
    def dstate(q, k, do, *a, **kw):          # (its kernel: on GVA pairs, as chunk_bwd_dstate_cuda picks)
        phase = "bwd_pair" if cuda_chunk.gva_pairs(q.shape[1], do.shape[1]) else "bwd"
        rec.launches.append(CudaLaunch(KERNELS[phase][1], phase))
    cuda_chunk.chunk_bwd_dstate_cuda = dstate
    cuda_chunk.chunk_bwd_grads_cuda = lambda *a, **kw: rec.launches.append(CudaLaunch(GRADS_KERNEL, "grads"))
    _dispatch.kernel.cache_clear()
    try:
        rec.phase = "fwd"
        start = len(rec.launches)
        _, _, kept = op_body("chunk_gdr_fwd")(**common)
        if "fwd" not in modes:      # run for its `kept` only (what autograd hands the backward)
            del rec.launches[start:]
        if "bwd" in modes:
            rec.phase = "bwd"
            op_body("chunk_gdr_bwd")(**common, do=torch.empty_like(v), dht=None, kept=kept if kept.numel() else None)
    finally:
        cuda_chunk.launch, cuda_chunk.chunk_bwd_dstate_cuda = real_launch, real_dstate
        cuda_chunk.chunk_bwd_grads_cuda = real_grads
        _dispatch.kernel.cache_clear()


def row(name, dims, dtype, const, launch=None):
    """The report row of the kernel of `launch` (a CudaLaunch; default the forward's; report.py's
    columns), or one with the error."""
    phase = launch.phase if launch is not None else "fwd"
    fwd, grads = phase.startswith("fwd"), phase == "grads"
    f = facts(dtype, const, phase)
    base = dict(impl="cuda", shape=name, dtype=dtype, mode="fwd" if fwd else "bwd", kernel=KERNELS[phase][1],
                config=f"VB64 cluster{CLUSTER[phase]} s3 p4" if fwd else "VB64 s2 G-loop" if grads
                else f"VB64 cluster{CLUSTER[phase]} s3", candidates=1,
                warps=(BWD_THREADS if phase.startswith("bwd") else THREADS) // 32, stages=2 if grads else STAGES,
                loop_hmma="", loop_f2fp="", step_stalls={}, dots="bf16+f16" if dtype == "bf16" else "f16",
                error=f.error)
    if f.error or not takes(dims, dtype):
        return dict(base, grid="", ctas="", regs="", smem_kb="", spill_b=0, ctas_per_sm="", waves="", loop_hgmma="",
                    loop_instr="", loop_waits="", loop_bars="", step_cycles="", hbm_gb=0.0, gflop=0.0, lat_us="",
                    bytes_us="", flops_us="", smem_us="", bound="error", est_us="",
                    error=f.error or f"the kernel takes K = V = {HEAD_DIM}, bf16 / fp16 only")
    n = -(-dims[1] // M.CHUNK)
    us = lambda t: round(t * 1e6, 1)  # noqa: E731
    if grads:                  # a row of the CTA's two sides: its loops are per value head, its step per CTA
        est = grads_estimate(f, dims, dtype, const)
        dq, dk = f.loops["dq"], f.loops["dk"]
        loop = dict(loop_hgmma=dq["hgmma"] + dk["hgmma"], loop_instr=round(dq["instr"] + dk["instr"]),
                    loop_waits=dq["waits"] + dk["waits"], step_cycles=round(est["step"]),
                    step_stalls={k: round(v) for k, v in dk["stalls"].items()}, grid=f"{dims[0] * n}x{dims[2]}")
    else:
        est = (estimate(f, dims, dtype, const, launch.kept, phase) if fwd
               else bwd_estimate(f, dims, dtype, const, phase))
        s, p = f.loops["state"], f.loops.get("prep", dict(hgmma=0, instr=0, waits=0))
        per = 2 if phase in ("fwd_split_pair", "bwd_pair") else 1
        loop = dict(loop_hgmma=s["hgmma"] + p["hgmma"] / 2, loop_instr=round(s["instr"] + p["instr"] / 2),
                    loop_waits=s["waits"] + p["waits"] / 2,
                    step_cycles=round(cta_cycles(f, n, const, phase)[0] / n),   # a chunk step
                    step_stalls={k: round(v) for k, v in s["stalls"].items()},
                    grid=f"{CLUSTER[phase]}x{dims[3] // per}x{dims[0]}")
    return dict(base, **loop, ctas=est["ctas"], regs=f.regs, smem_kb=round(f.smem / 1024, 1),
                spill_b=f.spill, ctas_per_sm=1, waves=math.ceil(est["ctas"] / NUM_SMS), loop_bars="",
                hbm_gb=float(f"{est['hbm_bytes'] / 1e9:.4g}"), gflop=round(est["flops"] / 1e9, 2),
                lat_us=us(est["t_lat"]), bytes_us=us(est["t_mem"]), flops_us=us(est["t_tc"]), smem_us=us(est["t_smem"]),
                bound=est["bound"], lat_role=est["lat_bound"], est_us=us(est["est_s"]))
