"""Launch configs of the Triton kernels: one fixed heuristic on (K, V, dtype, GPU), never autotuned,
so the launch sequence is the same for every cu_seqlens of the same T and N (CUDA-graph safe) and the
set of compiled kernels is known ahead of time (tests/test_sm90_aot.py compiles every variant;
`python -m bench kernels` reports registers, shared memory, spills and CTAs per SM of each).
Each config dict holds the kernel's block constexprs plus num_warps and num_stages.
"""
import torch
import triton

CHUNK = 64          # rows per chunk; the kernels are written for 64 (one wgmma M tile per warpgroup)

_SMEM_KB = {9: 227, 8: 163}


def pow2(x):
    return triton.next_power_of_2(x)


def smem_kb(device):
    """Shared memory per block (KB) the kernels may plan for on `device` (sm_90 sizes off CUDA)."""
    if device.type != "cuda":
        return _SMEM_KB[9]
    major, minor = torch.cuda.get_device_capability(device)
    return 227 if major >= 9 else 163 if (major, minor) in ((8, 0), (8, 6), (8, 7), (8, 9)) else 99


def dot_precision(dtype):
    """input_precision of every dot with fp32 operands: the C x C products of prep (T's doubling
    steps) for every input dtype, and every dot of fp32 inputs. "tf32" (one tensor-core pass, as
    Triton's default and FLA): the products are stored in the input dtype afterwards, and bf16/fp16
    rounding (2^-9 / 2^-11) is not smaller than tf32's (2^-11); "tf32x3" spills registers in prep
    (bench/NOTES.md).
    So fp32 inputs run at tf32 accuracy on a GPU and are held to the GPU fp32 budgets of
    docs/DESIGN.md there (the interpreter computes every dot in fp32: the CPU budgets)."""
    return "tf32"


def prep_config(K, dtype):
    """chunk_fwd_prep_kernel: K K^T and Q K^T over K-blocks of BK (128, so at K <= 128 the q and k tiles
    load in one go with the group's gate columns; 32 for fp32 inputs, whose tiles are twice the bytes),
    4 warps, 2 CTAs per SM, 1 stage (the loop is short and the C x C tiles dominate). The model's
    numbers for these choices: bench/NOTES.md, "The group's gate columns loaded once".
    DOUBLING_16 (bf16 inputs): the inverse's two whole-tile doubling levels take bf16 operands, not fp32
    at PREC: half the operand bytes and one bf16 tensor-core pass (prep 288.5 -> 232.7 us at the anchor in
    the model); their rounding (2^-9) is that of the Ts they produce, stored in bf16, and the bf16 errors
    against float64 stay where they were (bench/NOTES.md, "Prep's whole-tile doubling in bf16, pass A in
    halves"). fp16 inputs keep fp32 operands: in fp16 the same change took one FLA comparison over 1.1x
    (dg, chunk-multiples: 7.00e-4 against FLA's 6.27e-4), and fp16's range would bound T's entries."""
    BK = min(pow2(K), 32 if dtype == torch.float32 else 128)
    return dict(BK=BK, PREC=dot_precision(dtype), DOUBLING_16=dtype == torch.bfloat16, num_warps=4,
                num_stages=1)


def _stage_kb(BK, BV, esize):
    """Shared memory (KB) of one pipeline stage of a state pass: q, k [C, BK], v (the dS pass: dO) [C, BV]
    and Ts, M [C, C], in the input dtype of esize bytes."""
    return (2 * CHUNK * BK + CHUNK * BV + 2 * CHUNK * CHUNK) * esize / 1024


def state_config(K, V, dtype, smem=227, store_states=False):
    """chunk_fwd_state_kernel: the transposed state block S^T [BV, BK] (BK = K padded to a power of
    two) in fp32 registers. bf16/fp16 with K <= 128: BV = 64 (the wgmma M of one warpgroup, so the S^T
    products take the state from registers), smaller only when V is, 4 warps. K > 128 or fp32 inputs (a
    [64, K] fp32 state with tf32 operands does not fit next to the tiles): BV = 16 at 8 warps; fp32 with
    K > 128: BV = 8 (tf32's inner dimension) and SPLIT_K, the K-products over the two halves of K, each
    half's [C, BK / 2] fp32 tile loaded for its product (a whole [C, 256] fp32 tile as a register operand
    spills; what is left: tests/test_sm90_aot.py's known_spills, the history in bench/NOTES.md).
    2 stages (the next chunk's tiles copied while this one computes) when two fit in shared memory,
    else 1; one stage holds q, k [C, BK], v [C, BV] and Ts, M [C, C] in the input dtype.
    V >= 128 (bf16/fp16, K <= 128), and V = 64 with K = 128 (its upper rows masked): BV = 128 at 8 warps, each warpgroup one 64-row half of S^T (the same
    registers per thread as BV = 64 at 4 warps), so q, k, Ts and M are read once per value head and
    segment instead of once per 64-row V-block (1 CTA of 8 warps per SM: the warps per SM of two 4-warp
    CTAs), at 3 stages where they fit, every variant: the next chunk's tile loads take their addresses
    from its chunk table row, itself a load, and at 2 stages part of their wait stays on the chunk step
    (the STORE_STATES variant, the backward's recompute, is at 1 stage when 3 do not fit; 2 are slower
    for it; bench/NOTES.md has the model's numbers for each)."""
    BK = pow2(K)
    narrow = dtype == torch.float32 or BK > 128
    BV = 8 if dtype == torch.float32 and BK > 128 else max(16, min(16 if narrow else 64, pow2(V)))
    esize = torch.finfo(dtype).bits // 8
    # two warpgroups, one 64-row half of S^T each; at BK = 128 also for V = 64 (rows 64-127 masked: the
    # 64-row block at 4 warps spilled 8 B there)
    wide = BV == 64 and (pow2(V) >= 128 or BK == 128)
    if wide:
        BV = 128
    stage_kb = _stage_kb(BK, BV, esize)
    stages = 1 if 2 * stage_kb + 16 > smem or (store_states and BV >= 64) else 2
    if wide and 3 * stage_kb + 16 <= smem:
        stages = 3
    return dict(BK=BK, BV=BV, SPLIT_K=esize == 4 and BK > 128, num_warps=8 if narrow or wide else 4,
                num_stages=stages)


def bwd_configs(K, V, dtype, smem=227):
    """Block sizes and warps of the backward kernels (gdn_packed/triton/chunk_bwd.py), one config each:
    - dstate: the whole K (padded to a power of two) x BV = 128 at 8 warps when V >= 128 (each
      warpgroup one 64-row half of dS^T, the register A operand of its wgmma: q, k, dO, M, Ts read once
      per value head and segment; at 1 x 32768, HV = 32, V = 128: 32 programs per segment, S = 3) and
      3 pipeline stages where they fit in smem (KB; as state_config's 128-row passes), else 1;
      also when V = 64 with K = 128 (rows 64-127 masked: BV = 64 at 4 warps spilled 8-16 B there), BV = 64
      at 4 warps and 1 stage when V = 64 at smaller K, smaller when V is; fp32 inputs or K > 128 (as the forward's
      state pass): BV = 16 at 8 warps; fp32 with K > 128: BV = 8 (16 spills).
    - p, a (chunk_bwd_p_kernel, chunk_bwd_a_kernel; per qk head and chunk, the C x C parts of dq and dk:
      dO U^T, dX' U^T over V-blocks, the Gram matrices over K-blocks): 4 warps, K-blocks of 128 and
      V-blocks of 128 (p, 2 stages) / 64 (a, 1 stage; 128 when K > 128: 64 spilled 16 B in a K = 256
      variant under triton 3.6.0, the GPU image's); fp32 inputs at 8 warps, 32 / 32 and 32 / 16.
    - dq, dk (chunk_bwd_dq_kernel, chunk_bwd_dk_kernel; per K-block, qk head and chunk, the state
      products into a [C, BK] fp32 accumulator, then P K^ / P^T Q^ + B K^): bf16 / fp16 at 4 warps, 2
      CTAs per SM (the loop holds the accumulator alone: at 8 warps they were latency-bound at one CTA
      per SM, bench/NOTES.md), K-blocks of 128, V-blocks of 32, 3 pipeline stages (dq: 2 with V < 128
      <= K; dk at 2 spilled 16 B under triton 3.6.0, the GPU image's); fp32 inputs at 8 warps, K-blocks
      of 64, V-blocks of 16 (the V-block is the inner dimension of dO U^T: triton 3.6.0 refuses a tf32
      dot with an inner dimension of 8, which 3.9 takes; it failed to compile on an H200 with 3.6.0,
      2026-12-04: every V-block here is >= 16). Every K-block reads the V-blocks again (dO, dX', U, S^T,
      dSn^T). The widest blocks without register spills on sm_90 (tests/test_sm90_aot.py, every
      variant). HL (bf16 / fp16): their fp32 factors enter bf16 / fp16 dots as rounded value and
      rounding error (chunk_bwd._dot2).
    - finalize: K-blocks of 64 (the l2norm backward's row dot, then its rows), 4 warps (no dots)."""
    fp32 = dtype == torch.float32
    narrow = fp32 or pow2(K) > 128
    BV = min(8 if fp32 and pow2(K) > 128 else 16 if narrow else 128, pow2(V))
    if not narrow and pow2(K) == 128 and BV == 64:
        BV = 128        # a 64-row block at 4 warps spills at BK = 128 (255 registers): 128 rows, masked
    wide = not narrow and BV == 128
    stages = 3 if wide and 3 * _stage_kb(pow2(K), BV, torch.finfo(dtype).bits // 8) + 16 <= smem else 1
    return dict(
        dstate=dict(BK=pow2(K), BV=BV, num_warps=8 if narrow or wide else 4, num_stages=stages),
        p=dict(BK=min(32 if fp32 else 128, pow2(K)), BV=max(16, min(32 if fp32 else 128, pow2(V))),
               PREC=dot_precision(dtype), num_warps=8 if fp32 else 4, num_stages=2),
        dq=dict(BK=min(64 if fp32 else 128, pow2(K)), BV=max(16, min(16 if fp32 else 32, pow2(V))),
                PREC=dot_precision(dtype), HL=not fp32,
                num_warps=8 if fp32 else 4, num_stages=3 if pow2(V) >= 128 or pow2(K) < 128 else 2),
        a=dict(BK=min(32 if fp32 else 128, pow2(K)),
               BV=max(16, min(16 if fp32 else 128 if pow2(K) > 128 else 64, pow2(V))),
               PREC=dot_precision(dtype), num_warps=8 if fp32 else 4, num_stages=1),
        dk=dict(BK=min(64 if fp32 else 128, pow2(K)), BV=max(16, min(16 if fp32 else 32, pow2(V))),
                PREC=dot_precision(dtype), HL=not fp32, num_warps=8 if fp32 else 4, num_stages=3),
        finalize=dict(BK=min(64, pow2(K)), num_warps=4, num_stages=1),
    )


MIN_SEGMENT_CHUNKS = 8      # a segment shorter than this costs more in launches and the combine than it saves


def num_sms(device):
    """Streaming multiprocessors of `device` (132, an H200, off CUDA: the report's and the AOT tests' GPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def state_segments(T, N, HV, K, V, cfg, sms=132, dots=(5, 3), cfg_a=None, bwd=None, fwd_pass_a=True):
    """Segments per sequence of the forward state pass (docs/DESIGN.md section 11). With few sequences
    the pass has fewer programs (cdiv(V, BV) x HV x N) than the GPU has CTA slots, and its time is the
    sequence's chunk count times one chunk step. Splitting every sequence into S segments runs pass A
    (each segment from a zero state, carrying the K x K transition: cdiv(V + K, BV) blocks) on S - 1
    segments, a short sequential combine of the segment boundary states, and the pass itself on all S
    segments from their true entering states. dots = (per chunk of the pass, of pass A): (5, 3) for the
    forward state pass, (6, 6) for the backward's dS pass. S minimises waves x chunks per segment x dots
    over both passes plus the combine's S - 1 steps (a larger S only for a 5% gain; the forward's pass A,
    fwd_pass_a, as pass_a_plan plans it without h0), from shapes only (T, N: an average sequence of
    T / N rows; never the values of cu_seqlens), with at least MIN_SEGMENT_CHUNKS chunks per segment;
    1 when the state block is wider than 128 (the combine holds the whole K x K transition in one tile).
    cfg / cfg_a: the launch configs of the pass and of pass A (default cfg): their warps give the CTA
    slots (2 per SM at 4 warps, 1 at 8: the registers of the state block).
    bwd = (cfg_r, cfg_d), the configs of the backward's recompute and dS pass: S for a training step,
    whose backward runs in the forward's segments (it keeps the entering states and transitions, so
    the recompute is the pass alone, at 5 dots, and the dS pass's pass A carries no transition rows:
    cdiv(V, BV) blocks, 6 dots, as its pass): the sum of the forward's cost and those."""
    if N == 0 or pow2(K) > 128:
        return 1
    cfg_a = cfg if cfg_a is None else cfg_a

    def blocks(c, rows):
        return triton.cdiv(rows, c["BV"])
    chunks = triton.cdiv(T, CHUNK * N)

    def cost(S):        # + the combine: S - 1 sequential steps, each about one chunk step
        steps = triton.cdiv(chunks, S)

        def walk(c, rows, segs, d):     # a pass over `segs` segments of every sequence at d dots a chunk
            return triton.cdiv(N * HV * blocks(c, rows) * segs, _slots(c, sms)) * steps * d
        total = (walk(cfg, V, S, dots[0]) + (S - 1) * dots[0]
                 + (pass_a_plan(N, HV, K, V, S, steps, cfg_a, sms)[1] * dots[1] if fwd_pass_a else
                    walk(cfg_a, V + K, S - 1, dots[1])))
        if bwd is not None:
            cfg_r, cfg_d = bwd
            total += walk(cfg_r, V, S, 5) + walk(cfg_d, V, S, 6) + walk(cfg_d, V, S - 1, 6) + (S - 1) * 6
        return total
    best = 1
    for S in range(2, 65):
        if triton.cdiv(chunks, S) < MIN_SEGMENT_CHUNKS:
            break
        if cost(S) < 0.95 * cost(best):     # more segments only for a clear gain
            best = S
    return best


def _slots(cfg, sms):
    """CTA slots of a state pass's launch: 2 per SM at 4 warps, 1 at 8 (the registers of the state block)."""
    return sms * (2 if cfg["num_warps"] == 4 else 1)


def pass_a_plan(N, HV, K, V, S, steps, cfg_a, sms, has_h0=False):
    """(pieces, cost) of the forward's pass A over the first S - 1 segments of N sequences (segments of
    `steps` chunks; cost in chunk steps on the critical path: waves x chunks a CTA). pieces = 1: one
    launch over every row block of [S^T; P^T] (the first segment's blocks of P^T only with h0). pieces =
    2: the S^T blocks in one launch, then the P^T blocks in a second one, each walking one half of its
    segment (chunk_fwd_state: the halves' transitions are multiplied after it, P = P_first P_second),
    when V is a multiple of the block rows (no block holds rows of both) and it shortens the critical
    path: at the anchor (1 x 32768, 32 value heads, S = 4) one launch is 160 CTAs of 128 chunks at one
    CTA per SM, two waves (256), the split 96 CTAs of 128 and then 128 of 64 (192). The cost model of
    state_segments assumes no h0 (S is a function of shapes only)."""
    if S <= 1:
        return 1, 0
    slots, nb, nv = _slots(cfg_a, sms), triton.cdiv(V + K, cfg_a["BV"]), triton.cdiv(V, cfg_a["BV"])
    p_blocks = (S - 1 - (0 if has_h0 else 1)) * (nb - nv)
    one = triton.cdiv(N * HV * ((S - 1) * nv + p_blocks), slots) * steps
    if V % cfg_a["BV"] or not p_blocks:
        return 1, one
    two = (triton.cdiv(N * HV * (S - 1) * nv, slots) * steps
           + triton.cdiv(N * HV * p_blocks * 2, slots) * triton.cdiv(steps, 2))
    return (2, two) if two < one else (1, one)


def combine_config(K, V, dtype, has_h0=False):
    """chunk_combine_kernel: S^T blocks of BV = 32 rows times the whole K x K transition (fp32), 16 with
    an h0 (the dS pass: dht) to start from (at 32 that variant spills 288 B at K = 128). Every program
    reads the whole transition, so its bytes go with cdiv(V, BV): at the anchor 20.5 us at BV = 16, 13.4
    at 32 (bytes-bound), 19.2 at 64 (shared-memory-bound) in the model."""
    return dict(BK=pow2(K), BV=min(16 if has_h0 else 32, pow2(V)), PREC=dot_precision(dtype), num_warps=4,
                num_stages=1)


def compose_config(K, dtype):
    """chunk_compose_kernel: BR = 64 rows of the first half's transition times the second's whole K x K
    (fp32; the combine's precision). Each program reads the whole second transition: at the anchor 12.7
    us at BR = 32 (bytes), 9.7 at 64 (shared memory) in the model."""
    return dict(BK=pow2(K), BR=min(64, pow2(K)), PREC=dot_precision(dtype), num_warps=4, num_stages=1)


def gate_config(HV):
    """chunk_gate_fwd_kernel / chunk_gate_bwd_kernel: rows per program BT = 1024 // HV padded (a [BT, HV]
    tile of ~1k elements: 8 per thread at the default 4 warps; the backward keeps about ten such
    tiles, which spill registers at 4k elements)."""
    BH = pow2(max(HV, 1))
    return dict(BT=max(16, 1024 // BH), BH=BH)


RMSNORM_MAX_N = 16384       # the widest row gated_rmsnorm's kernels hold (one [BLOCK_M, BLOCK_N] tile)


def rmsnorm_config(N):
    """gated_rmsnorm_fwd_kernel / _bwd_kernel: whole rows of BLOCK_N = N padded, BLOCK_M rows per step
    (a tile of at most 4096 elements, at most 16 rows), 4 warps up to rows of 1024, else 8."""
    BLOCK_N = pow2(N)
    if BLOCK_N > RMSNORM_MAX_N:
        raise ValueError(f"gated_rmsnorm: the normalised dim {N} exceeds the Triton kernel's limit "
                         f"{RMSNORM_MAX_N}")
    return dict(BLOCK_M=max(1, min(16, 4096 // BLOCK_N)), BLOCK_N=BLOCK_N, num_warps=4 if BLOCK_N <= 1024 else 8)


def rmsnorm_bwd_programs(device, row_blocks):
    """Programs of gated_rmsnorm_bwd_kernel (each owns a contiguous range of row blocks and writes one
    partial weight gradient): two per SM on a GPU, a few under the interpreter (enough to exercise the
    partial sums)."""
    cap = 2 * num_sms(device) if device.type == "cuda" else 4
    return max(1, min(cap, row_blocks))


BWD_SCRATCH_BUDGET = 16 * 2**30     # bytes of scratch the Triton backward may hold at once (bwd_head_slices)


def bwd_scratch_bytes(T, N, H, HV, K, V, dtype, l2, sms=132):
    """Bytes of scratch the Triton backward (gdn_packed/triton/chunk.py, chunk_gdr_bwd_triton) allocates for
    T rows and N sequences of H qk / HV value heads, from shapes only (e = the input dtype's bytes, C = 64,
    NC = T // C + N chunk slots, nq / nk = the dq / dk kernels' K-blocks):
        NC HV (2 V K e + 2 V C e + 2 C^2 e + 7 C 4 + 4)   S^T, dSn^T; U^T, dX'^T; Ts, M; gates, row factors
      + 2 NC H C^2 4                                      the group's P, B (P, A kernels -> dq, dk)
      + T HV 2 (2 + nq + nk) 4                            dg / dbeta partials
      + T H 2 K 4 with l2norm                             dq, dk before the l2norm backward
      + the segmented passes' boundary rows: N (S - 1) HV (V + K) K 4 + N S HV K V 4 for the recompute
        and for the dS pass (S from state_segments), + N (S - 1) HV K K 4 for the recompute's pass A
        (its second halves' transitions: pass_a_plan)
    (~2.1 kB per token and value head at K = V = 128, bf16, G = 2: ~71 GB at T = 1M, HV = 32; +17 GB with
    l2norm)."""
    e, C, NC = torch.finfo(dtype).bits // 8, CHUNK, T // CHUNK + N
    cfg = bwd_configs(K, V, dtype)
    nq, nk = triton.cdiv(K, cfg["dq"]["BK"]), triton.cdiv(K, cfg["dk"]["BK"])
    total = NC * HV * (2 * V * K * e + 2 * V * C * e + 2 * C * C * e + 7 * C * 4 + 4) + 2 * NC * H * C * C * 4
    total += T * HV * 2 * (2 + nq + nk) * 4 + (T * H * 2 * K * 4 if l2 else 0)
    for c, dots in ((state_config(K, V, dtype, store_states=True), (5, 3)), (cfg["dstate"], (6, 6))):
        fwd = dots == (5, 3)
        S = state_segments(T, N, HV, K, V, c, sms, dots=dots, fwd_pass_a=fwd)
        total += N * (S - 1) * HV * (V + (2 if fwd else 1) * K) * K * 4 + (N * S * HV * K * V * 4 if S > 1 else 0)
    return total


def bwd_head_slices(T, N, H, HV, K, V, dtype, l2, budget=None, sms=132):
    """How many slices of qk heads (each with its group's value heads) the Triton backward runs one after
    another so that its scratch (bwd_scratch_bytes of one slice) fits `budget` (BWD_SCRATCH_BUDGET): the
    fewest that divides H, at most H (one qk head a slice: the bound's floor, ~2 kB per token and value
    head of the group). From shapes only: the same for every cu_seqlens of the same T and N."""
    budget = BWD_SCRATCH_BUDGET if budget is None else budget
    G = HV // max(H, 1)
    for P in range(1, H + 1):
        if H % P == 0 and bwd_scratch_bytes(T, N, H // P, G * (H // P), K, V, dtype, l2, sms) <= budget:
            return P
    return max(H, 1)
