"""The byte/FLOP/latency model of `python -m bench kernels` (written out in bench/NOTES.md, "sm_90 report").

Per launch, from toolchain.py's Compiled facts and the launch's grid:
    CTAs/SM  = min(64K regs / (regs rounded up to 8 x 32 x warps), 228 KB / (smem + 1 KB), 64 / warps, 32)
    waves    = ceil(programs / (CTAs/SM x 132))
    bytes    = programs x tile bytes loaded and stored per program (no L2 reuse credited)
    FLOPs    = programs x 2 M N K of every tt.dot executed per program (masked lanes included)
    t_mem    = bytes / 4.3 TB/s;  t_tc = FLOPs / (790 TFLOP/s bf16/fp16, 395 for tf32)
    t_loop   = waves x trips x (kappa x instructions + MMA issue cycles) / 1.98 GHz
               (only for kernels whose dot loop has a run-time trip count: the sequential chunk
               pass, trips = chunks per sequence (per segment where the kernel splits sequences),
               or a loop over segments; the SASS counts are those of one iteration of that loop)
    t        = max(t_mem x tail, t_tc x tail, t_loop) + 2.5 us launch,  tail = waves x slots / programs
               (infinite when not one CTA fits an SM: such an autotune config is never picked)
kappa (cycles per non-MMA instruction of the latency-bound loop) is the one free constant: it is set
so that FLA 0.6.0's forward at the anchor shape (bf16) sums to the 1.89 ms measured on an H200.
"""
import math

from bench.sm90.hopper import (CLOCK_HZ, HBM_BPS, MAX_CTAS_PER_SM, MAX_WARPS_PER_SM, NUM_SMS, REGS_PER_SM,
                               SMEM_PER_SM, TC_FLOPS)

LAUNCH_S = 2.5e-6
FLA_FWD_ANCHOR_S = 1.89e-3       # FLA 0.6.0 chunk_gated_delta_rule forward, H200, 1x32768, 16/32 heads, K=V=128, bf16
KAPPA_DEFAULT = 4.0
KAPPA_MAX = 64.0


def ctas_per_sm(regs, smem, warps):
    r = max(8, -(-regs // 8) * 8)
    by_regs = REGS_PER_SM // (r * 32 * warps)
    by_smem = SMEM_PER_SM // (smem + 1024)
    return max(0, min(by_regs, by_smem, MAX_WARPS_PER_SM // warps, MAX_CTAS_PER_SM))


def estimate(programs, warps, c, kappa):
    """Model numbers of one launch (c: toolchain.Compiled) as a dict."""
    ctas = ctas_per_sm(c.regs, c.smem, warps)
    slots = max(1, ctas) * NUM_SMS
    waves = math.ceil(programs / slots) if programs else 0
    tail = waves * slots / programs if programs else 1.0
    nbytes = programs * (c.bytes_ld + c.bytes_st)
    flops = programs * c.flops
    ab = {a for a, _, _ in c.dots}
    rate = TC_FLOPS["f32"] if "f32" in ab else TC_FLOPS["bf16"]
    t_mem, t_tc = nbytes / HBM_BPS * tail, flops / rate * tail
    t_loop, cycles = 0.0, 0.0
    if c.seq_loop and c.loop:
        cycles = kappa * c.loop["instr"] + c.loop["mma_cycles"]
        t_loop = waves * c.seq_trips * cycles / CLOCK_HZ
    parts = {"mem": t_mem, "tc": t_tc, "loop": t_loop}
    bound = max(parts, key=parts.get) if ctas else "nofit"
    if not ctas:            # more shared memory or registers than an SM has: cannot launch
        parts["nofit"] = math.inf
    return dict(ctas_per_sm=ctas, waves=waves, hbm_bytes=nbytes, flops=flops, t_mem=t_mem, t_tc=t_tc,
                t_loop=t_loop, cycles_per_iter=cycles, bound=bound,
                est_s=(parts[bound] + LAUNCH_S) if programs else 0.0)


def calibrate(total_at, target=FLA_FWD_ANCHOR_S, lo=0.0, hi=KAPPA_MAX):
    """The kappa at which total_at(kappa) (monotone) equals target; clamped to [lo, hi]."""
    if total_at(lo) >= target:
        return lo
    if total_at(hi) <= target:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total_at(mid) < target else (lo, mid)
    return (lo + hi) / 2
