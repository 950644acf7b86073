"""The timing model of `python -m bench kernels` (bench/NOTES.md, "sm_90 report": the model, its constants
and its check against FLA's published H200 times).

Per launch of P programs of w warps, from the compile's facts (kernel_facts):
    c        CTAs per SM = min(64K regs / (regs rounded up to 8 x 32 x w), 228 KB / (smem + 1 KB), 64 / w, 32)
    latency  one warp's path through the kernel's SASS (sass.simulate: in-order issue, each instruction
             waiting for its sources, results at issue + latency, cp.async / wgmma / TMA waits, barriers,
             fences;
             loops run their TTIR trip counts, a sequential chunk loop its sequence's chunks); one CTA
             takes D = max(path, instructions x s, MMA cycles x s), s = max(1, w c / 4): the 4 warp
             schedulers and the tensor pipe of an SM shared by the warps of its c co-resident CTAs (the
             latency one CTA exposes is hidden by the others only up to those two limits); the CTAs go to
             the c x 132 slots in launch order, each to the slot free first; the CTAs of a kernel with a
             chunk loop split evenly over the sequences in cu_seqlens order.
    bytes    the tiles loaded and stored (ttir.py): up to the size of the tensors touched from HBM at
             4.3 TB/s, the rest (tiles read again) at l2_bps, a fitted effective rate (it comes out below
             HBM's: re-read tiles cost more than streamed ones, see bench/NOTES.md); no more than SM_BPS
             for each busy SM.
    FLOPs    2MNK of every dot / the tensor-core rate (bf16 790 TFLOP/s, tf32 395)
    narrow   the 1-2 byte global accesses (LDG / STG .U16 ...: an element-wise tile access) of the busiest SM,
             `narrow` cycles each: what the H200 showed (5-12x the model in the kernels with them) and
             the terms above do not see
    smem     the shared-memory wavefronts of every warp and the operand reads of every warpgroup MMA, per
             busy SM, at one 128-byte wavefront a cycle: an access's bank conflicts where banks.py can run
             its lanes' addresses from the SASS, else its conflict-free count (LDS / STS / LDSM / STSM /
             LDGSTS by width; SHFL one). Against the H200's ncu L1/TEX busy time of the code that ran: the
             sequential passes 0.81-0.97 (no conflicts, no shuffles), dq 0.84, dk 0.78, prep 0.73
             (bench/NOTES.md, "The second H200 session")
    est      max((latency^p + max(bytes, smem)^p)^(1/p), FLOPs, narrow) + launch, p = overlap x c: latency
             and the memory pipes' time overlap the better the more CTAs share an SM (1 CTA: near their
             sum; many: their max); the bound names the largest term.
The constants (Constants: the latencies of sass.Latencies, l2_bps, launch_s, narrow, overlap) are global:
none is per kernel. FIT names the ones fitted on FLA's published rows (validate.py); narrow is fitted on
the H200's per-kernel times of ours (bench/results/h200_2026-12-04); the others are fixed."""
import dataclasses
import heapq
import math

from bench.sm90 import banks, sass
from bench.sm90.hopper import (CLOCK_HZ, HBM_BPS, MAX_CTAS_PER_SM, MAX_WARPS_PER_SM, NUM_SMS, REGS_PER_SM,
                               SMEM_PER_SM, SM_BPS, TC_FLOPS)


@dataclasses.dataclass(frozen=True)
class Constants:
    lat: sass.Latencies = sass.Latencies()
    l2_bps: float = 3.407e12    # tiles read again (fitted)
    launch_s: float = 2.5e-6
    # SM cycles of one warp's 1-2 byte global access: fitted on the H200's per-kernel times of the four
    # kernels that had them (bench/NOTES.md, "The model after the H200": the geometric mean of 151, 115-131,
    # 104, 78; each kernel within -28% / +39% of it, a kernel held out of the mean -35% / +56%)
    narrow: float = 109.0
    # latency and bytes of one launch combine as (lat^p + bytes^p)^(1/p), p = overlap x CTAs per SM: the
    # more co-resident CTAs, the more of one CTA's waits the others' memory traffic hides (p -> inf: max,
    # p = 1: the sum). Fitted on FLA's published rows (FIT); the H200's sequential passes of ours alone
    # (1 CTA per SM) give 1.1-1.37 (bench/NOTES.md, "The model after the H200" item 5)
    overlap: float = 1.28

    def get(self, name):
        return getattr(self.lat, name) if name in sass.Latencies.__dataclass_fields__ else getattr(self, name)

    def fitted_text(self):
        return ", ".join(f"{n} {self.get(n):.4g}" for n in FIT)

    def as_dict(self):
        return dict(dataclasses.asdict(self.lat), l2_bps=self.l2_bps, launch_s=self.launch_s, narrow=self.narrow,
                    overlap=self.overlap)

    @classmethod
    def from_dict(cls, d):
        return cls().with_(**d)

    def text(self):
        lat = ", ".join(f"{k} {v:.4g}" for k, v in dataclasses.asdict(self.lat).items())
        return (f"latencies (cycles) {lat}; L2 {self.l2_bps / 1e12:.3g} TB/s; launch {self.launch_s * 1e6:.3g} us; "
                f"narrow access {self.narrow:.4g} cycles; overlap {self.overlap:.3g}; fitted: {', '.join(FIT)}")

    def with_(self, **kw):
        lat = {k: v for k, v in kw.items() if k in sass.Latencies.__dataclass_fields__}
        rest = {k: v for k, v in kw.items() if k not in lat}
        return dataclasses.replace(self, lat=dataclasses.replace(self.lat, **lat), **rest)


FIT = ("bar", "l2_bps", "overlap")     # ldg, hgmma, hmma, smem: from published microbenchmarks (sass.Latencies)
BOUNDS = dict(ldg=(300.0, 1500.0), hgmma=(20.0, 600.0), bar=(10.0, 200.0), l2_bps=(1e12, 2e13), alu=(2.0, 8.0),
              smem=(15.0, 120.0), xu=(6.0, 40.0), launch_s=(1e-6, 1e-5), overlap=(0.5, 64.0))   # what a fit may take
CONSTANTS = Constants()


def ctas_per_sm(regs, smem, warps):
    r = max(8, -(-regs // 8) * 8)
    by_regs = REGS_PER_SM // (r * 32 * warps)
    by_smem = SMEM_PER_SM // (smem + 1024)
    return max(0, min(by_regs, by_smem, MAX_WARPS_PER_SM // warps, MAX_CTAS_PER_SM))


def loop_trips(prog, ttir_loops):
    """trips(k, loop) for sass.simulate: the SASS loops (in program order) aligned with the TTIR loops
    (in program order), a SASS loop matching a TTIR loop only if both hold an MMA / a dot or neither
    does; the alignment keeps the most pairs, then prefers pairs at the same depth and leaves out
    (as unrolled by ptxas) TTIR loops of constant bounds and few trips before the others. Triton keeps
    a constant loop of 2 or 8 trips as a SASS loop as often as not (our prep, dq and dk keep every
    one; some of FLA's kernels lose theirs), so no loop is taken as unrolled from its trip count
    alone. An unmatched SASS loop runs once. Returns (table of the TTIR loop dicts, one per SASS loop,
    index of the chunk loop among the SASS loops or None); `n` chunks for the chunk loop."""
    sl = sass.loops_in_order(prog)
    tl_ = list(ttir_loops)
    n, m = len(sl), len(tl_)

    def pair_score(i, j):
        s, t = sl[i], tl_[j]
        if s[2] != bool(t["dot"]):
            return None
        few = t["const"] and t["trips"] <= 8
        return 4 + (s[3] == t.get("depth", s[3])) + (not few)

    best = [[0] * (m + 1) for _ in range(n + 1)]       # best[i][j]: SASS loops i.., TTIR loops j..
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            ps = pair_score(i, j)
            best[i][j] = max(best[i + 1][j], best[i][j + 1], ps + best[i + 1][j + 1] if ps is not None else 0)
    table, i, j = [], 0, 0
    while i < n:
        ps = pair_score(i, j) if j < m else None
        if ps is not None and best[i][j] == ps + best[i + 1][j + 1]:
            table.append(tl_[j])
            i, j = i + 1, j + 1
        elif j < m and best[i][j] == best[i][j + 1]:
            j += 1
        else:
            table.append(dict(trips=1, seq=False))
            i += 1
    seq_at = next((k for k, t in enumerate(table) if t.get("seq")), None)
    return table, seq_at


def footprint(tensors):
    """Bytes of the tensors a launch touches (launches.Launch.tensors)."""
    return sum(math.prod(shape) * esize for shape, _, esize in tensors.values())


def _per_cta_linear(c, const):
    """One CTA's cycles, instructions and MMA cycles as a + b x n when its chunk loop runs n trips
    (sass.simulate at 4 and 8; linear beyond the simulated iterations): {"a", "b", "seq_at" (the chunk
    loop's index among the SASS loops, None without one), "seq_trips" (its TTIR trips at c.chunks chunks
    a sequence), "stalls" (a chunk step's waits by kind)}."""
    if c.prog is None:          # facts without their SASS: the terms computed at the constants they came with
        if c.linear_const != const.as_dict():
            raise ValueError("these facts hold no SASS, only per-CTA terms at other constants")
        return c.linear
    key = (id(c.prog), repr(c.ttir_loops), const)
    if key not in _LINEAR:
        table, seq_at = loop_trips(c.prog, c.ttir_loops)
        wavefronts = banks.conflict_wavefronts(c.prog)

        def run(n):
            return sass.simulate(c.prog, lambda k, _l: (n if k == seq_at else table[k]["trips"])
                                 if k < len(table) else 1, const.lat, wavefronts=wavefronts)
        r4, r8 = run(4), run(8)
        terms = ("cycles", "instr", "mma_cycles", "narrow", "smem", "smem_mma")
        _LINEAR[key] = dict(a={k: r4[k] - (r8[k] - r4[k]) for k in terms}, b={k: (r8[k] - r4[k]) / 4 for k in terms},
                            seq_at=seq_at, seq_trips=table[seq_at]["trips"] if seq_at is not None else 0,
                            stalls={k: (r8["stalls"].get(k, 0.0) - r4["stalls"].get(k, 0.0)) / 4 for k in r8["stalls"]})
    return _LINEAR[key]


_LINEAR = {}


def chunk_step(c, const):
    """One chunk step of a kernel's chunk loop on one warp's path: {"cycles", "stalls": {what: cycles}}, or
    None for a kernel without one."""
    lin = _per_cta_linear(c, const)
    return None if lin["seq_at"] is None else dict(cycles=lin["b"]["cycles"], stalls=lin["stalls"])


def _schedule(durations, slots):
    """Makespan of CTAs (in launch order) on `slots` identical slots, each to the slot free first."""
    if len(durations) <= slots:
        return max(durations, default=0.0)
    free = [0.0] * slots
    for d in durations:
        heapq.heapreplace(free, free[0] + d)
    return max(free)


CHUNK = 64      # rows per chunk of every chunked kernel here (ours and FLA's BT)


def estimate(c, programs, warps, seq_lens, tensor_bytes, const, sms=NUM_SMS):
    """The model of one launch: c (toolchain.Compiled, per program), its grid size and warps, the
    recorded sequence lengths (tokens), the bytes of the tensors it touches, the constants; sms: the SMs
    it runs on (fewer beside another lane's launch: lanes())."""
    P, w = programs, warps
    ctas = ctas_per_sm(c.regs, c.smem, w)
    if not ctas or c.error or sms < 1:
        return dict(ctas_per_sm=ctas, waves=0, est_s=math.inf, bound="nofit", t_lat=math.inf, t_mem=0.0,
                    t_tc=0.0, t_narrow=0.0, narrow=0.0, t_smem=0.0, hbm_bytes=0.0, flops=0.0)
    slots = ctas * sms
    s = max(1.0, w * ctas / 4)
    lin = _per_cta_linear(c, const)
    a, b, seq_at = lin["a"], lin["b"], lin["seq_at"]
    lens = tuple(seq_lens) or (CHUNK,)
    # a CTA's chunk loop runs the TTIR's trips (read at c.chunks chunks a sequence: per segment, or over
    # the segments) scaled to its own sequence's chunks
    per_chunk = lin["seq_trips"] / max(1, c.chunks) if seq_at is not None else 0.0
    chunks = [per_chunk * max(1, -(-n // CHUNK)) for n in lens]

    # each CTA's chunk-loop trips: its sequence's (the CTAs split evenly over the sequences in order)
    if seq_at is None:
        trips = [0.0] * P
    elif P % len(lens):
        trips = [max(chunks)] * P
    else:
        trips = [n for n in chunks for _ in range(P // len(lens))]

    def dur(n):
        return max(a["cycles"] + b["cycles"] * n, (a["instr"] + b["instr"] * n) * s,
                   (a["mma_cycles"] + b["mma_cycles"] * n) * s)
    t_lat = _schedule([dur(n) for n in trips], slots) / CLOCK_HZ
    # 1-2 byte global accesses: const.narrow cycles of an SM each (its load/store path), per busy SM
    narrow = w * sum(a.get("narrow", 0.0) + b.get("narrow", 0.0) * n for n in trips)
    t_narrow = narrow / max(1, min(P, sms)) * const.narrow / CLOCK_HZ
    # shared memory: every warp's wavefronts and every warpgroup's MMA operand reads, per busy SM
    smem = sum(w * (a.get("smem", 0.0) + b.get("smem", 0.0) * n) + w / 4 * (a.get("smem_mma", 0.0) +
               b.get("smem_mma", 0.0) * n) for n in trips)
    t_smem = smem / max(1, min(P, sms)) / CLOCK_HZ
    tiles = P * (c.bytes_ld + c.bytes_st)
    hbm = min(tiles, tensor_bytes)
    busy = min(P, slots) / ctas
    t_mem = max(hbm / HBM_BPS + (tiles - hbm) / const.l2_bps, tiles / (busy * SM_BPS))
    flops = P * c.flops
    rate = TC_FLOPS["f32"] if any(a == "f32" for a, _, _ in c.dots) else TC_FLOPS["bf16"]
    t_tc = flops / rate
    t, bound = bounded({"latency": t_lat, "bytes": t_mem, "FLOPs": t_tc, "narrow": t_narrow, "smem": t_smem}, ctas,
                       const)
    return dict(ctas_per_sm=ctas, waves=math.ceil(P / slots) if P else 0, t_lat=t_lat, t_mem=t_mem, t_tc=t_tc,
                t_narrow=t_narrow, narrow=narrow, t_smem=t_smem,
                hbm_bytes=tiles, flops=flops, bound=bound, est_s=(t + const.launch_s) if P else 0.0)


def bounded(parts, ctas_per_sm, const):
    """(time, bound) of a launch's terms {"latency", "bytes", optionally "smem", and others (FLOPs,
    narrow)}: latency and the memory pipes' time M = max(bytes, smem) combined as (L^p + M^p)^(1/p), p =
    const.overlap x CTAs per SM (named by the largest of the three), the others max'd with that; the
    bound names the largest. Every estimate (Triton kernels here, the CUDA kernels in cuda_chunk.py)
    ends here."""
    lat, byt, smem = parts["latency"], parts["bytes"], parts.get("smem", 0.0)
    mem = max(byt, smem)
    hi, lo = max(lat, mem), min(lat, mem)
    p = const.overlap * max(1, ctas_per_sm)
    both = hi * ((lo / hi) ** p + 1.0) ** (1.0 / p) if lo > 0 else hi
    rest = {k: v for k, v in parts.items() if k not in ("latency", "bytes", "smem")}
    top = max(rest, key=rest.get, default=None)
    if top is not None and rest[top] > both:
        return rest[top], top
    return both, ("latency" if lat >= mem else "bytes" if byt >= smem else "smem")


def lanes(main, side, sides_sms, const):
    """(time, bound) of two lanes of launches that run at once (gdn_packed._runtime.fork): each lane's
    launches one after another, the side lane's on the `sides_sms` SMs the main lane's CTAs leave it.
    Each launch is a dict of its terms in seconds (t_lat, t_mem, t_smem, t_tc), est_s and, for a side
    launch, alone_s (its estimate on every SM; else est_s). The lanes
    have SMs of their own and share the memory system: latency the slower lane's, bytes both lanes'
    (HBM and L2 are shared), shared memory the busier lane's (its SMs'), FLOPs both lanes'; combined as
    bounded() combines one launch's terms (at 1 CTA per SM, the least overlap of latency and memory)
    and never under either lane's own time (its launches' estimates in sequence, without their launch
    overhead); plus every launch's overhead. Never over `sequence`, the launches' estimates on all the
    SMs one after the other: the side lane's CTAs not yet dispatched when the main lane ends take the
    SMs it frees. With no SM left (sides_sms < 1) the side lane runs after the main one: `sequence`."""
    sequence = sum(x.get("alone_s", x["est_s"]) for x in main + side)
    if sides_sms < 1 or not main or not side:
        return sequence, "lanes in sequence"
    total = lambda xs, key: sum(x[key] for x in xs)                     # noqa: E731
    t, bound = bounded({"latency": max(total(main, "t_lat"), total(side, "t_lat")),
                        "bytes": total(main + side, "t_mem"),
                        "smem": max(total(main, "t_smem"), total(side, "t_smem")),
                        "FLOPs": total(main + side, "t_tc")}, 1, const)
    own = max(total(main, "est_s") - len(main) * const.launch_s, total(side, "est_s") - len(side) * const.launch_s)
    if own > t:
        t, bound = own, "a lane"
    t += (len(main) + len(side)) * const.launch_s
    return (sequence, "lanes in sequence") if t >= sequence else (t, bound)


def torch_estimate(nbytes, launches, const):
    """torch operators between the kernels (launches.TorchOp): their bytes from HBM, one launch each."""
    t = nbytes / HBM_BPS
    return dict(ctas_per_sm="", waves="", t_lat=0.0, t_mem=t, t_tc=0.0, hbm_bytes=nbytes, flops=0.0, bound="bytes",
                est_s=t + launches * const.launch_s if launches else 0.0)
