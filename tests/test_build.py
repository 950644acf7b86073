"""The build path: csrc/ compiles for sm_80 and sm_90a without register spills or stack frames, the
sm_90a chunked kernels' SASS (the forward, the backward's dS pass) has the tensor-core products of their
tile program in their chunk loops (the sm_90 report's compile, cached by its sources: bench/sm90/cuda_chunk.py), gdn_packed._C imports
when it was built, the CUDA backend reports itself unavailable (with a reason) on a machine without a
GPU, and the package installs without nvcc."""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from bench.sm90 import cuda_chunk, sass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
ARCHS = ("sm_80", "sm_90a")
# every kernel family of csrc/ must show up in the ptxas report (so none escapes the spill check)
KERNEL_FAMILIES = ("chunk_count_scan_kernel", "chunk_table_fill_kernel", "conv1d_fwd_kernel", "conv1d_bwd_kernel",
                   "conv1d_final_state_kernel", "conv1d_bwd_state_kernel", "conv1d_wgrad_reduce_kernel",
                   "recurrent_gdr_fwd_kernel", "chunk_gdr_fwd_sm90_kernel", "chunk_gdr_fwd_sm90_pair_kernel",
                   "chunk_gdr_fwd_sm90_state_kernel",
                   "chunk_gdr_fwd_sm90_split_kernel", "chunk_gdr_fwd_sm90_split_pair_kernel", "chunk_gdr_bwd_sm90_kernel",
                   "chunk_gdr_bwd_sm90_pair_kernel", "chunk_gdr_grads_sm90_kernel")
# kernels built for sm_90a only (wgmma / TMA / setmaxnreg), with the CuTe headers of nvidia-cutlass, by file
SM90_ONLY = {"chunk_gdr_fwd_sm90.cu": ("chunk_gdr_fwd_sm90_kernel", "chunk_gdr_fwd_sm90_pair_kernel",
                                      "chunk_gdr_fwd_sm90_state_kernel",
                                      "chunk_gdr_fwd_sm90_split_kernel", "chunk_gdr_fwd_sm90_split_pair_kernel"),
             "chunk_gdr_bwd_sm90.cu": ("chunk_gdr_bwd_sm90_kernel", "chunk_gdr_bwd_sm90_pair_kernel"),
             "chunk_gdr_grads_sm90.cu": ("chunk_gdr_grads_sm90_kernel",)}
# the forwards' setmaxnreg (decreases, increases in the SASS) and the registers of each kind of CTA's
# three warpgroups (each kind's sum within the launch pool, 3 x 168): the fused kernel's producer down, prep
# and state up; the state-only kernel's producer and idle prep warpgroup down, its state up to the most
# there is; the split kernel's state CTA as the state-only kernel's, its prep CTA's producer down and both
# prep warpgroups up (one setmaxnreg each, the same instruction); its pair form (GVA pairs) the same
SPLIT = ([32, 32, 32], [232, 256])
SETMAXNREG = {"chunk_gdr_fwd_sm90_kernel": ([32], [232, 240]), "chunk_gdr_fwd_sm90_pair_kernel": ([32], [232, 240]),
              "chunk_gdr_fwd_sm90_state_kernel": ([32, 32], [256]),
              "chunk_gdr_fwd_sm90_split_kernel": SPLIT, "chunk_gdr_fwd_sm90_split_pair_kernel": SPLIT}
POOLS = {"chunk_gdr_fwd_sm90_kernel": [(32, 232, 240)], "chunk_gdr_fwd_sm90_pair_kernel": [(32, 232, 240)],
         "chunk_gdr_fwd_sm90_state_kernel": [(32, 32, 256)],
         "chunk_gdr_fwd_sm90_split_kernel": [(32, 32, 256), (32, 232, 232)],
         "chunk_gdr_fwd_sm90_split_pair_kernel": [(32, 32, 256), (32, 232, 232)]}


def forward_of(name):
    """The forward kernel (SETMAXNREG's key) a SASS function or ptxas record name is an instantiation of."""
    return next((k for k in ("chunk_gdr_fwd_sm90_state_kernel", "chunk_gdr_fwd_sm90_split_kernel",
                             "chunk_gdr_fwd_sm90_split_pair_kernel", "chunk_gdr_fwd_sm90_pair_kernel") if k in name),
                "chunk_gdr_fwd_sm90_kernel")


def setmaxnreg(body):
    """(decreases, sorted distinct increases) of a function's SASS: USETMAXREG.DEALLOC / TRY_ALLOC counts."""
    dec = [int(x, 16) for x in re.findall(r"USETMAXREG\.DEALLOC\S*\s+(0x[0-9a-f]+)", body)]
    inc = sorted({int(x, 16) for x in re.findall(r"USETMAXREG\.TRY_ALLOC\S*\s+\w+,\s*(0x[0-9a-f]+)", body)})
    return dec, inc


# the sm_90a file's compile (its flags, the tools, the CuTe headers) is the sm_90 report's, cached on disk
# by its sources: one compile for both (bench/sm90/cuda_chunk.py)
cutlass_include, parse_ptxas = cuda_chunk.cutlass_include, cuda_chunk.parse_ptxas
NVCC, CUOBJDUMP = cuda_chunk.find_tool("nvcc"), cuda_chunk.find_tool("cuobjdump")
SASS = {}   # file name -> cuobjdump -sass of its object (the sm_90a-only sources), filled by ptxas_report
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda/bin): "
                                                     "csrc/ compile checks skipped")


def demangle(names):
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout
    pretty = out.splitlines()
    if len(pretty) != len(names):
        return {n: n for n in names}
    # drop the anonymous-namespace noise and the parameter list
    short = [re.sub(r"\(anonymous namespace\)::", "", p).split("(")[0] for p in pretty]
    return dict(zip(names, short))


@pytest.fixture(scope="module")
def ptxas_report():
    """Compile every csrc/*.cu once for sm_80 and sm_90a with -Xptxas -v (in parallel)."""
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
    assert sources, "no csrc/*.cu"
    assert cutlass_include(), "the CuTe headers of nvidia-cutlass==4.2.0.0 (a build requirement) are missing"
    tmp = tempfile.mkdtemp(prefix="gdn_ptxas_")

    def compile_one(src):
        obj = os.path.join(tmp, os.path.basename(src) + ".o")
        if os.path.basename(src) in SM90_ONLY:
            out = cuda_chunk.build(src)
            SASS[os.path.basename(src)] = out.get("sass", "")
            return src, cuda_chunk.nvcc_command(src, obj), SimpleNamespace(
                returncode=1 if "error" in out else 0, stdout=out.get("ptxas", ""), stderr=out.get("error", ""))
        cmd = [NVCC, "-c", src, "-o", obj, "-std=c++17", "-O3", "-I", CSRC, "-Xptxas", "-v",
               "-DGDN_CUDA_ARCHS=\"80,90a\"", "-gencode=arch=compute_90a,code=sm_90a",
               "-gencode=arch=compute_80,code=sm_80"]
        return src, cmd, subprocess.run(cmd, capture_output=True, text=True)

    try:
        with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
            results = list(ex.map(compile_one, sources))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for src, cmd, p in results:
        assert p.returncode == 0, f"nvcc failed on {src}:\n{' '.join(cmd)}\n{p.stdout}\n{p.stderr}"
    return results


@needs_nvcc
def test_csrc_compiles_without_spills(ptxas_report, report_table):
    recs = []
    for src, _, p in ptxas_report:
        for r in parse_ptxas(p.stdout + "\n" + p.stderr):
            r["file"] = os.path.basename(src)
            recs.append(r)
    assert recs, "ptxas reported no kernels"
    names = demangle(sorted({r["name"] for r in recs}))
    title = "csrc/ kernels, ptxas -v"
    report_table(title, f"{'kernel':<58} {'arch':<7} {'regs':>4} {'smem':>6} {'spill':>5} {'stack':>5}")
    for r in recs:
        report_table(title, f"{names[r['name']][:58]:<58} {r['arch']:<7} {r['registers']!s:>4} {r['smem']:>6} "
                            f"{r['spill']:>5} {r['stack']:>5}")
    kernels = {r["name"] for r in recs}
    missing = [f for f in KERNEL_FAMILIES if not any(f in names[k] for k in kernels)]
    assert not missing, f"kernels missing from the ptxas report: {missing}"
    for k in kernels:
        want = {"sm_90a"} if any(f in names[k] for fs in SM90_ONLY.values() for f in fs) else set(ARCHS)
        assert {r["arch"] for r in recs if r["name"] == k} >= want, f"{names[k]} not built for {want}"
    bad = [f"{names[r['name']]} {r['arch']}: spill {r['spill']} B, stack {r['stack']} B"
           for r in recs if r["spill"] or r["stack"]]
    assert not bad, "register spills / stack frames:\n" + "\n".join(bad)


@needs_nvcc
def test_sm90_chunk_kernel_resources(ptxas_report, report_table):
    """The warp-specialised chunked forwards (384 threads: 65536 / 384 -> 168 registers at launch, which
    setmaxnreg redistributes 32 / 232 / 240 to the producer, prep and state warpgroups; the state-only
    kernel 32 / 32 / 256: its prep warpgroup idles; the split kernel's state CTAs as those, its prep CTAs
    32 / 232 / 232) and the backward's
    reverse dS pass (256 threads: at most 255 registers, one CTA per SM as its shared memory allows): no
    local memory in either instantiation (bf16, fp16) of either; ptxas checks every setmaxnreg region
    against its count; no wait that ptxas had to inject before a use of a wgmma's registers (C7517: a
    register read while its group was in flight, which serialises the chain), and no loop whose wgmma
    ptxas serialized (C7514, C7512)."""
    for src, _, p in ptxas_report:
        if os.path.basename(src) in SM90_ONLY:
            # no injected wait (C7517), no wgmma serialized for an accumulator read in flight (C7514: what an
            # issue under a branch caused) or for want of registers (C7512)
            bad = [ln for ln in (p.stdout + p.stderr).splitlines() if any(c in ln for c in ("C7517", "C7514", "C7512"))]
            assert not bad, (src, bad)
    for file, kernels in SM90_ONLY.items():
        recs = [r for src, _, p in ptxas_report if os.path.basename(src) == file
                for r in parse_ptxas(p.stdout + "\n" + p.stderr)]
        assert len(recs) == 2 * len(kernels), (file, recs)
        for r in recs:
            report_table("sm_90a chunked kernels, ptxas -v", f"{file} {r['name'][-60:]}: {r['registers']} registers, "
                                                              f"spill {r['spill']} B, stack {r['stack']} B")
            assert (r["spill"], r["stack"]) == (0, 0), r
            assert r["registers"] == 168 if "fwd" in file else r["registers"] <= 255, r


def sass_loops(sass):
    """{kernel name: [Counter of the HGMMA shapes of each loop holding one]}: a loop is a backward branch
    before the kernel's last EXIT (ptxas moves an mbarrier try-wait's retry after it, with a branch back:
    not a loop); an inner loop's instructions are also its outer loop's (the kernel's loops do not nest)."""
    out = {}
    for body in re.split(r"\n\s*Function : ", sass)[1:]:
        name = body.split("\n", 1)[0].strip()
        ins = [(int(a, 16), op, rest) for a, op, rest in
               re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);", body)]
        last_exit = max(a for a, op, _ in ins if op == "EXIT")
        loops = []
        for a, op, rest in ins:
            m = re.match(r"\s*(0x[0-9a-f]+)", rest)
            if op.startswith("BRA") and m and int(m.group(1), 16) < a < last_exit:
                body_ops = [o for x, o, _ in ins if int(m.group(1), 16) <= x <= a]
                shapes = Counter(re.match(r"HGMMA\.(\d+x\d+x\d+)", o).group(1) for o in body_ops
                                 if o.startswith("HGMMA"))
                waits = sum(o.startswith("WARPGROUP.DEPBAR") for o in body_ops)
                if shapes:
                    loops.append((shapes, waits))
        out[name] = loops
    return out


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (CUDA toolkit or triton's copy): SASS not read")
def test_sm90_chunk_loops_run_the_tile_program_on_the_tensor_cores(ptxas_report, report_table):
    """cuobjdump SASS of both instantiations: the two chunk loops hold exactly the wgmma of the tile
    program (csrc/chunk_gdr_sm90.cuh), each issued once per chunk (nothing serialised into a loop of its
    own): prep 16 HGMMA 64x64x16 (K K^T and Q K^T, 8 each, in one group) and the inverse's two doubling
    levels, their nonzero blocks only (64x16x16: 2 + 2; 64x32x16: 2 k-steps + 2), in 5 waits (the
    diagonal blocks before them are mma.sync: HMMA, not counted here); state 4 HGMMA 64x128x16 (the state
    update U K) and 24 HGMMA 64x64x16
    (S^T K^T and S^T Q^T 8 each, X'^T Ts^T 4, U^T M^T 4) in 3 waits (S^T Q^T waited for with X'^T Ts^T; U^T M^T
    and U K share one). The state-only kernel: the state loop alone, in 4 waits (its output deferred a
    step: the previous chunk's U^T M^T first, waited for on its own before that O is stored). The split
    kernel: the fused kernel's prep loop (its prep CTAs) and the state-only kernel's state loop. Each one's
    GVA-pair form (the fused one's clusters of 4, the split one's of 8) as itself."""
    sass = SASS.get("chunk_gdr_fwd_sm90.cu")
    assert sass, "no SASS of chunk_gdr_fwd_sm90.cu"
    loops = sass_loops(sass)
    assert len(loops) == 10, list(loops)
    state = (Counter({"64x128x16": 4, "64x64x16": 24}), 3)
    prep = (Counter({"64x64x16": 16, "64x16x16": 4, "64x32x16": 4}), 5)
    for name, got in loops.items():
        report_table("sm_90a chunked kernel, HGMMA per chunk loop (cuobjdump)",
                     f"{name[-60:]}: " + "; ".join(f"{dict(c)} in {w} waits" for c, w in got))
        want = {"chunk_gdr_fwd_sm90_state_kernel": [(state[0], 4)], "chunk_gdr_fwd_sm90_split_kernel": [prep, (state[0], 4)],
                "chunk_gdr_fwd_sm90_split_pair_kernel": [prep, (state[0], 4)],
                "chunk_gdr_fwd_sm90_kernel": [prep, state], "chunk_gdr_fwd_sm90_pair_kernel": [prep, state]}[forward_of(name)]
        key = lambda x: sorted(x[0].items())  # noqa: E731
        assert sorted(got, key=key) == sorted(want, key=key), (name, got)


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (CUDA toolkit or triton's copy): SASS not read")
def test_sm90_setmaxnreg_fits_the_launch_allocation(ptxas_report, report_table):
    """setmaxnreg only moves registers within the CTA's pool (the launch count x the threads): in the
    forward's SASS, the producer's decrease plus the prep and state warpgroups' increases (one warpgroup
    each, 128 threads) must not exceed 3 x the launch registers, or a warp retries USETMAXREG.TRY_ALLOC
    forever. 40 + 232 + 240 = 512 > 3 x 168 = 504 was the split when the forward hung on an H200
    (2026-12-04), its likely cause. The state-only kernel's idle prep warpgroup gives registers back too.
    The split kernel's two kinds of CTA each stay within the pool (POOLS)."""
    sass = SASS.get("chunk_gdr_fwd_sm90.cu")
    assert sass, "no SASS of chunk_gdr_fwd_sm90.cu"
    launch = {r["registers"] for src, _, p in ptxas_report if os.path.basename(src) == "chunk_gdr_fwd_sm90.cu"
              for r in parse_ptxas(p.stdout + "\n" + p.stderr)}
    assert launch == {168}, launch
    for body in re.split(r"\n\s*Function : ", sass)[1:]:
        name = body.split("\n", 1)[0].strip()
        dec, inc = setmaxnreg(body)
        pools = POOLS[forward_of(name)]
        report_table("sm_90a chunked forward, setmaxnreg (cuobjdump)",
                     f"{name[-50:]}: decreases {dec}, increases {inc}, per kind of CTA "
                     f"{' / '.join(str(sum(p)) for p in pools)} <= 3 x 168 = 504")
        assert (dec, inc) == SETMAXNREG[forward_of(name)], (name, dec, inc)
        assert sorted({x for p in pools for x in p[1:] if x > 168}) == inc, (name, pools, inc)
        assert all(len(p) == 3 and sum(p) <= 3 * 168 for p in pools), (name, pools)


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (CUDA toolkit or triton's copy): SASS not read")
def test_sm90_dstate_loop_runs_its_step_on_the_tensor_cores(ptxas_report, report_table):
    """cuobjdump SASS of both instantiations of the backward's reverse dS pass and of its form on GVA pairs:
    each chunk loop (the producer's holds none) issues exactly the wgmma of dstate_step
    (csrc/chunk_gdr_sm90.cuh) once a chunk,
    in 3 waits: 16 HGMMA 64x64x16 (dS^T K^T 8 and dO^T M 4 in one group, dU^T Ts 4) and 12 HGMMA 64x128x16
    (the dS update: the gated dO^T's rounded value and its rounding error times Q, 4 each, dX'^T K 4)."""
    sass = SASS.get("chunk_gdr_bwd_sm90.cu")
    assert sass, "no SASS of chunk_gdr_bwd_sm90.cu"
    loops = sass_loops(sass)
    assert len(loops) == 4, list(loops)
    for name, got in loops.items():
        report_table("sm_90a dS pass, HGMMA per chunk loop (cuobjdump)",
                     f"{name[-60:]}: " + "; ".join(f"{dict(c)} in {w} waits" for c, w in got))
        assert got == [(Counter({"64x64x16": 16, "64x128x16": 12}), 3)], (name, got)


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (CUDA toolkit or triton's copy): SASS not read")
def test_sm90_grads_loops_run_on_the_tensor_cores(ptxas_report, report_table):
    """cuobjdump SASS of both instantiations of the backward's chunk-parallel gradients (csrc/
    chunk_gdr_grads_sm90.cuh): setmaxnreg 24 (producer) / 240 / 240 (the two sides); the dq side's V-block
    loop (and its value-head loop around it) issues 24 HGMMA 64x64x16 in 4 waits (dO U^T 4 with dO S^T's
    K-halves 4 + 4, the second waited for after the first is used; then dX' v^T 4 and S^T dSn 8, likewise);
    the dk side's 16 in 3 waits (dX' S^T's first K-half 4, dX' U^T 4 in flight while it is used, its second
    4) around its K-half
    loop of U dSn^T (4 in 1 wait; unrolled, ptxas spills): every product of grads_dq / grads_dk's loops on
    the tensor cores, all from shared memory (SS: no register A operand, so no layout conversion)."""
    sass = SASS.get("chunk_gdr_grads_sm90.cu")
    assert sass, "no SASS of chunk_gdr_grads_sm90.cu"
    loops = sass_loops(sass)
    assert len(loops) == 2, list(loops)
    want = sorted([(Counter({"64x64x16": n}), w) for n, w in ((4, 1), (16, 3), (16, 3), (24, 4), (24, 4))],
                  key=repr)
    for name, got in loops.items():
        report_table("sm_90a chunk-parallel gradients, HGMMA per loop (cuobjdump)",
                     f"{name[-60:]}: " + "; ".join(f"{dict(c)} in {w} waits" for c, w in got))
        assert sorted(got, key=repr) == want, (name, got)
    for body in re.split(r"\n\s*Function : ", sass)[1:]:
        assert setmaxnreg(body) == ([24], [240]), setmaxnreg(body)


WATCHDOG_SPINS = 1000000


def watchdog_command(src, obj):
    """The sm_90a compile (cuda_chunk.nvcc_command) of the debug build with the barrier watchdog
    (setup.py: GDN_PACKED_SM90_WATCHDOG)."""
    return cuda_chunk.nvcc_command(src, obj) + [f"-DGDN_SM90_WATCHDOG={WATCHDOG_SPINS}"]


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (CUDA toolkit or triton's copy): SASS not read")
def test_sm90_watchdog_build_traps_and_prints(ptxas_report, report_table):
    """The debug build of both sm_90a chunked kernels with -DGDN_SM90_WATCHDOG (every mbarrier wait
    prints the stuck barrier and traps after that many failed try_waits: csrc/chunk_gdr_sm90_device.cuh)
    compiles; each instantiation's SASS has the trap (BPT.TRAP) and the printf (vprintf: the only
    absolute call, an extern; the default build has neither, checked here too); the forward keeps its
    setmaxnreg split (ptxas did not drop it for the call: C7507) so the debug build runs the default's
    register budget. Registers and spills are reported, not bounded (printf is a call: values live across
    it spill on its cold path, and ptxas serializes the wgmma, C7510). Compiled once each, in parallel,
    cached with the report's compiles (bench/sm90/cuda_chunk.py)."""
    keys = glob.glob(os.path.join(CSRC, "*.cu*")) + glob.glob(os.path.join(CSRC, "*.h"))
    with ThreadPoolExecutor(max_workers=2) as ex:
        outs = dict(zip(SM90_ONLY, ex.map(
            lambda f: cuda_chunk.nvcc_cached("cuda_chunk_watchdog", os.path.join(CSRC, f), watchdog_command, keys),
            SM90_ONLY)))
    for file, kernels in SM90_ONLY.items():
        out = outs[file]
        assert "error" not in out, f"{file} with -DGDN_SM90_WATCHDOG={WATCHDOG_SPINS}: {out.get('error')}"
        default = SASS.get(file, "")
        assert default and "BPT.TRAP" not in default and "CALL.ABS" not in default, \
            f"the default build of {file} has a trap or an extern call"
        recs = parse_ptxas(out["ptxas"])
        assert len(recs) == 2 * len(kernels), (file, recs)
        for r in recs:
            report_table(f"sm_90a chunked kernels, watchdog build (-DGDN_SM90_WATCHDOG={WATCHDOG_SPINS}), ptxas -v",
                         f"{file} {r['name'][-60:]}: {r['registers']} registers, spill {r['spill']} B, "
                         f"stack {r['stack']} B")
        bodies = re.split(r"\n\s*Function : ", out["sass"])[1:]
        assert len(bodies) == 2 * len(kernels), (file, len(bodies))
        for body in bodies:
            name = body.split("\n", 1)[0].strip()
            assert "BPT.TRAP" in body, f"{name}: no trap in the watchdog build"
            assert "CALL.ABS" in body, f"{name}: no vprintf call in the watchdog build"
            if "fwd" in file:
                assert "C7507" not in out["ptxas"], [ln for ln in out["ptxas"].splitlines() if "C7507" in ln]
                assert setmaxnreg(body) == SETMAXNREG[forward_of(name)], (name, setmaxnreg(body))


def prep_arrivals_command(src, obj):
    """The sm_90a compile (cuda_chunk.nvcc_command) of the forward with every prep thread arriving on its
    buffer's mbarrier (setup.py: GDN_PACKED_SM90_PREP_ARRIVALS=1)."""
    return cuda_chunk.nvcc_command(src, obj) + ["-DGDN_SM90_PREP_ARRIVALS=1"]


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (CUDA toolkit or triton's copy): SASS not read")
def test_sm90_prep_arrivals_build_keeps_the_kernels_budget(report_table):
    """The forward's build with per-thread prep arrivals (-DGDN_SM90_PREP_ARRIVALS: the form
    compute-sanitizer's racecheck follows, waiting for a GPU before it becomes the default) compiles with
    the default build's budget: 168 launch registers, no spill or stack, the setmaxnreg split 32 / 232 /
    240, the prep loop's wgmma; and its prep loop's arrival on the local prepped[b] after the named barrier
    is reached by every thread, where the default's is skipped by thread 0's branch. _C (built as this
    environment asks: make venv) reports its kernel's count, 1 by default."""
    from gdn_packed import _cext
    C = _cext.get_C()
    if C is not None and not getattr(C, "chunk_gdr_fwd_sm90_missing", "no sm_90a kernel"):
        assert C.sm90_prep_arrivals == (128 if os.environ.get("GDN_PACKED_SM90_PREP_ARRIVALS") == "1" else 1)
    src = os.path.join(CSRC, "chunk_gdr_fwd_sm90.cu")
    keys = glob.glob(os.path.join(CSRC, "*.cu*")) + glob.glob(os.path.join(CSRC, "*.h"))
    out = cuda_chunk.nvcc_cached("cuda_chunk_prep_arrivals", src, prep_arrivals_command, keys)
    assert "error" not in out, out.get("error")
    recs = parse_ptxas(out["ptxas"])
    assert len(recs) == 10 and all((r["registers"], r["spill"], r["stack"]) == (168, 0, 0) for r in recs), recs
    for r in recs:
        report_table("sm_90a forward, per-thread prep arrivals (-DGDN_SM90_PREP_ARRIVALS), ptxas -v",
                     f"{r['name'][-40:]}: {r['registers']} registers, spill {r['spill']} B, stack {r['stack']} B")
    for body in re.split(r"\n\s*Function : ", out["sass"])[1:]:
        name = body.split("\n", 1)[0].strip()
        assert setmaxnreg(body) == SETMAXNREG[forward_of(name)], (name, setmaxnreg(body))
    default = cuda_chunk.build()
    for dtype in cuda_chunk.DTYPES:
        arrivals = {}
        for name, text in (("default", default["sass"]), ("per-thread", out["sass"])):
            prog = sass.program(cuda_chunk._kernel_sass(text, dtype))
            first, last = cuda_chunk._role_loops(prog)["prep"]
            loop = prog[first:last + 1]
            hgmma = sum(x.op.startswith("HGMMA") for x in loop)
            # the arrival on the local prepped[b] (SYNCS.ARRIVE, not the remote .RED one) after prep's last
            # named barrier: skipped by a conditional branch (thread 0's test) or reached by every thread
            (i,) = [j for j, x in enumerate(loop) if x.op.startswith("SYNCS.ARRIVE") and ".RED" not in x.op]
            bar = max(j for j in range(i) if loop[j].op.startswith("BAR.SYNC"))
            skipped = any(x.op == "BRA" and x.guarded and x.target is not None and x.target > loop[i].addr
                          for x in loop[bar:i])
            arrivals[name] = (hgmma, skipped)
        assert arrivals == {"default": (arrivals["default"][0], True), "per-thread": (arrivals["default"][0], False)}, \
            arrivals


def test_parse_ptxas_sample():
    sample = """ptxas info    : Compiling entry function '_Z1kPi' for 'sm_90a'
ptxas info    : Function properties for _Z1kPi
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 256 bytes smem, 380 bytes cmem[0]"""
    (r,) = parse_ptxas(sample)
    assert (r["arch"], r["registers"], r["smem"], r["spill"], r["stack"]) == ("sm_90a", 40, 256, 8, 8)


def _so_files():
    return glob.glob(os.path.join(ROOT, "gdn_packed", "_C*.so")) + \
        glob.glob(os.path.join(ROOT, "gdn_packed", "_C*.pyd"))


def test_extension_imports_when_built():
    import gdn_packed
    from gdn_packed import _cext

    built_here = [f for f in _so_files() if os.path.dirname(f) == os.path.dirname(gdn_packed.__file__)]
    if not built_here and not _cext.built():
        if os.environ.get("GDN_PACKED_REQUIRE_C", "") == "1":
            pytest.fail("GDN_PACKED_REQUIRE_C=1 but gdn_packed._C was not built: "
                        + _cext.cuda_unavailable_reason())
        pytest.skip("gdn_packed._C not built: " + _cext.cuda_unavailable_reason())
    from gdn_packed import _C

    for fn in ("chunk_table", "chunk_table_host", "cuda_runtime_version", "device_count", "cuda_status",
               "conv1d_varlen_fwd", "conv1d_varlen_fwd_host", "conv1d_varlen_bwd", "conv1d_varlen_bwd_host",
               "recurrent_gdr_fwd", "recurrent_gdr_fwd_host", "chunk_gdr_fwd_sm90", "chunk_gdr_fwd_sm90_host",
               "chunk_gdr_bwd_sm90", "chunk_gdr_bwd_sm90_host"):
        assert hasattr(_C, fn), fn
    assert _C.cuda_runtime_version() >= 12000
    assert _C.cuda_runtime_version() == _C.cuda_compiled_version()  # static cudart
    assert "90a" in _C.cuda_archs and "80" in _C.cuda_archs
    st = _C.cuda_status()
    assert set(st) >= {"runtime_version", "driver_version", "device_count", "error", "archs"}


def test_cuda_availability_is_reported():
    import torch
    from gdn_packed import _cext

    avail, why = _cext.cuda_available(), _cext.cuda_unavailable_reason()
    assert isinstance(avail, bool) and isinstance(why, str)
    assert avail == (why == "")
    if not torch.cuda.is_available():  # e.g. this GPU-less CI machine
        assert avail is False and len(why) > 20, why
        if _cext.built():
            st = _cext.cuda_status()
            assert st["device_count"] == 0 and st["error"], st
            assert "no CUDA device is usable" in why
            if _cext.get_C().cuda_driver_version() == 0:
                assert "InsufficientDriver" in st["error"] or "NoDevice" in st["error"], st
    elif _cext.built():
        assert avail, why


def test_install_without_nvcc(tmp_path):
    """GDN_PACKED_NO_CUDA=1 (what a machine without nvcc gets) still yields an installable wheel: the
    gdn_packed packages, no _C, no tests/ or bench/, the declared dependencies and extras."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("_C*.so", "__pycache__", "*.egg-info")
    src.mkdir()
    for f in ("setup.py", "pyproject.toml", "CMakeLists.txt"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    for d in ("gdn_packed", "csrc", "tests", "bench"):
        if os.path.isdir(os.path.join(ROOT, d)):
            shutil.copytree(os.path.join(ROOT, d), src / d, ignore=ignore)
    env = dict(os.environ, GDN_PACKED_NO_CUDA="1", PIP_NO_INPUT="1")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "building WITHOUT the CUDA extension" in p.stdout + p.stderr
    (whl,) = glob.glob(str(tmp_path / "dist" / "*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    assert "gdn_packed/__init__.py" in names and "gdn_packed/ops/chunk_table.py" in names
    assert "gdn_packed/cuda/launch.py" in names   # the host side of csrc/ ships even without _C
    assert not [n for n in names if "/_C" in n and n.endswith(".so")], names
    assert not [n for n in names if n.startswith(("tests/", "bench/"))], names
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    for req in ("Requires-Dist: torch>=2.4", "Requires-Dist: numpy", "Provides-Extra: triton",
                "Provides-Extra: test", "Provides-Extra: bench", 'fla-core==0.6.0; extra == "test"'):
        assert req in meta, req
