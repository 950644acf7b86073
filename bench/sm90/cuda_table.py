"""The chunk table as a user with gdn_packed._C built gets it: csrc/chunk_table.cu's two launches, in
`python -m bench kernels`.

Under the fake H200 (hopper.fake_hopper) gdn_packed._C cannot run, so the ops would build their chunk
table with the torch implementation (torch_ref/chunk_table.py: 42 operators a call). On a GPU with the
package built, "auto" picks the csrc/ kernels instead (ops/chunk_table.py), and that is what the report
models unless asked for a Triton-only install (--triton-only): while recording, built(rec) routes the
table to a stub that records one TableLaunch (N sequences, T rows), and rows() models its two kernels
from their SASS (nvcc for sm_90a, cached; sass.simulate at the model's constants):

    chunk_count_scan_kernel   1 CTA of 512 threads; its loop over the sequences runs ceil(N / 512) tiles
    chunk_table_fill_kernel   ceil(NC / 256) CTAs of 256 threads, NC = T // 64 + N slots; its binary
                              search of the slot's sequence runs ceil(log2 N) steps

a CTA taking max(one warp's path, its instructions x warps per scheduler), the CTAs list-scheduled
on the SMs (model._schedule), max'd with their bytes at HBM rate, + a launch each."""
import contextlib
import dataclasses
import math
import os
import re
from unittest import mock

from bench.sm90 import model as M
from bench.sm90 import sass
from bench.sm90.hopper import CLOCK_HZ, HBM_BPS, NUM_SMS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
SOURCE = os.path.join(CSRC, "chunk_table.cu")
KERNELS = (("chunk_count_scan_kernel", 512), ("chunk_table_fill_kernel", 256))   # csrc: kScanThreads, kFillThreads


@dataclasses.dataclass
class TableLaunch:
    """The chunk table's two launches in a recorded case (report.py asks rows() for their rows)."""
    phase: str
    n: int                          # sequences
    t: int                          # rows
    chunk: int
    int64: bool                     # cu_seqlens' index type (the kernels are templated on it)
    kernel: str = "chunk_table (csrc)"
    group: int = 0
    lane: tuple = ()

    def config_text(self):
        return ""


@contextlib.contextmanager
def built(rec):
    """While recording into `rec` (an active launches.Recorder): the ops' chunk table of device
    tensors comes from csrc/chunk_table.cu, as "auto" picks it where gdn_packed._C runs; recorded as a
    TableLaunch, with outputs of the table's shapes."""
    import torch

    from gdn_packed.ops import chunk_table as op

    def stub(cu_seqlens, cu_seqlens_padded, T, chunk_size):
        n = cu_seqlens.shape[0] - 1
        rec.launches.append(TableLaunch(rec.phase, n, T, chunk_size, cu_seqlens.dtype == torch.int64))
        return (torch.empty((T // chunk_size + n, 4), dtype=torch.int32, device=cu_seqlens.device),
                torch.empty((n + 1,), dtype=torch.int32, device=cu_seqlens.device))
    with mock.patch.object(op, "resolve_backend", lambda *a, **k: "cuda"), \
            mock.patch.object(op, "kernel", lambda *a: stub):
        yield


def build():
    """{"ptxas", "sass"} of csrc/chunk_table.cu compiled for sm_90a (cuda_chunk.nvcc_cached: cached on disk
    beside the Triton compiles, keyed by its sources and nvcc's version), or {"error"}."""
    from bench.sm90.cuda_chunk import find_tool, nvcc_cached
    if find_tool("nvcc") is None or find_tool("cuobjdump") is None:
        return dict(error="no nvcc / cuobjdump (CUDA toolkit: $CUDACXX, PATH or /usr/local/cuda/bin)")

    def cmd(src, obj):
        return [find_tool("nvcc"), "-c", src, "-o", obj, "-std=c++17", "-O3", "-I", CSRC, "-Xptxas", "-v",
                "-gencode=arch=compute_90a,code=sm_90a"]
    keys = [os.path.join(CSRC, n) for n in ("chunk_table.cu", "segments.cuh", "cuda_status.cuh", "api.h")]
    return nvcc_cached("cuda_table", SOURCE, cmd, keys)


def _kernel(text, name, int64):
    """The SASS body of kernel `name` for the index type (int32: ...IiEE, int64: ...IlEE)."""
    tag = f"{name}I{'l' if int64 else 'i'}EE"
    for body in re.split(r"\n\s*Function : ", text)[1:]:
        if tag in body.split("\n", 1)[0]:
            return body
    return ""


def _regs(ptxas, name, int64):
    from bench.sm90.cuda_chunk import parse_ptxas
    tag = f"{name}I{'l' if int64 else 'i'}EE"
    recs = [r for r in parse_ptxas(ptxas) if tag in r["name"]]
    return (recs[0]["registers"] or 0, recs[0]["smem"]) if recs else (0, 0)


def rows(tl, shape, dtype, impl, const):
    """The report rows (report.py's columns; the others left to report._complete) of a TableLaunch."""
    out = build()
    base = dict(impl=impl, shape=shape, dtype=dtype, mode=tl.phase, config="csrc", candidates=1, dots="-",
                spill_b=0, step_stalls={})
    if "error" in out:
        return [dict(base, kernel=name, bound="error", est_us="", error=out["error"]) for name, _ in KERNELS]
    nc = tl.t // tl.chunk + tl.n
    trips = {"chunk_count_scan_kernel": math.ceil(tl.n / 512),
             "chunk_table_fill_kernel": math.ceil(math.log2(tl.n)) if tl.n > 1 else 0}
    ctas = {"chunk_count_scan_kernel": 1, "chunk_table_fill_kernel": math.ceil(nc / 256)}
    moved = {"chunk_count_scan_kernel": 8 * (tl.n + 1),                  # cu_seqlens in, cu_chunks out
             "chunk_table_fill_kernel": 8 * (tl.n + 1) + 16 * nc}        # + the table out
    result = []
    for name, threads in KERNELS:
        body = _kernel(out["sass"], name, tl.int64)
        if not body:
            result.append(dict(base, kernel=name, bound="error", est_us="", error=f"no {name} in the SASS"))
            continue
        regs, smem = _regs(out["ptxas"], name, tl.int64)
        warps = threads // 32
        sim = sass.simulate(sass.program(body), lambda k, _l, n=trips[name]: n, const.lat)
        per_sm = max(1, M.ctas_per_sm(regs, smem, warps))
        resident = min(per_sm, math.ceil(ctas[name] / NUM_SMS))     # CTAs sharing an SM's 4 schedulers
        cta = max(sim["cycles"], sim["instr"] * max(1.0, warps * resident / 4))
        t_lat = M._schedule([cta] * ctas[name], per_sm * NUM_SMS) / CLOCK_HZ
        t_mem = moved[name] / HBM_BPS
        bound = "latency" if t_lat >= t_mem else "bytes"
        result.append(dict(base, kernel=name, grid=str(ctas[name]), ctas=ctas[name], warps=warps, regs=regs,
                           smem_kb=round(smem / 1024, 1), ctas_per_sm=per_sm,
                           waves=math.ceil(ctas[name] / (per_sm * NUM_SMS)), hbm_gb=float(f"{moved[name] / 1e9:.4g}"),
                           gflop=0.0, lat_us=round(t_lat * 1e6, 1), bytes_us=round(t_mem * 1e6, 1), flops_us="",
                           bound=bound, est_us=round((max(t_lat, t_mem) + const.launch_s) * 1e6, 1), error=""))
    return result
