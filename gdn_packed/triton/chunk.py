"""Host side of the Triton chunked gated delta rule: launch configs and the backend entry points that
gdn_packed.ops.chunk_gdr dispatches to (same signatures as gdn_packed.torch_ref.chunk).

Launch configs come from a fixed heuristic on (K, V, dtype, GPU), never from autotuning a shape, so
the launch sequence is the same for every cu_seqlens of the same T and N (CUDA-graph safe) and the
set of compiled kernels is known ahead of time (tests/test_triton_aot.py compiles all of them):
  prep   (chunk_prep_kernel):          BK = 16 (divides every K; the ten 16x16 K K^T blocks keep
         their mma operands in registers, and BK = 64 runs out of them); 4 warps; 2 stages.
  state  (chunk_state_output_kernel):  BK = K padded to a power of two (the whole state row block).
         BV = 32 when V is a multiple of 32, else 16; also 16 when K > 128, or K > 64 with fp32
         inputs (the [BK, BV] state and its hi/lo copies must fit next to the operand tiles): at the
         hot shape (K = V = 128) a [128, 32] fp32 state is 32 registers per thread for one warpgroup
         and 1x32768 with HV = 32 gives 128 programs, about one per H200 SM; a larger BV would idle
         half the SMs on long sequences. num_warps 4 (one warpgroup: wgmma M = 64 = C), 8 when
         K > 128. num_stages 2 (the next chunk's q, k, v, Tm, M are copied to shared memory by
         cp.async while this one computes; with 1 stage the tiles are staged through registers,
         which spills from 2 x [64, 128] fp32 up) when two stages fit the SM's shared memory (227 KB
         on sm_90, 163 KB on sm_80/86/89, 99 KB otherwise), else 1.
         The state's hi/lo split is formed once per chunk for both K S and Q S (bf16/fp16 K = 256:
         ~250 registers, no spill). fp32 with K > 128 (HALVES in the kernel) cannot double-buffer
         within 227 KB, and the tf32 wgmma needs K-major operands; written like the other paths,
         K^T of the state update is a register transpose of a [64, 256] fp32 tile and whole-K
         tiles live through the chunk (1.3 KB of spills). So the kernel holds the state as two
         K-halves [128, BV], loads each q/k half next to its dot, reads K^T transposed by the
         pointer order, and runs the K S / Q S dots as a 2-step loop over the halves (one shared
         memory tile site: fewer loop-invariant addresses hoisted into registers): 173 registers
         at 8 warps, 1 stage, 44 KB, no spill (158 for the STORE_STATES recompute).
         SPLIT (Tm, M, the state and Vnew as hi + lo pairs of the input dtype in the tensor-core
         dots): on for bf16 and fp16, where one rounding costs ~4e-3 / ~5e-4 relative error and
         would put us at FLA's accuracy instead of well below it; off for fp32 (tf32 dots).
Under the Triton interpreter the same function gives the one config used.
"""
import torch
import triton

from gdn_packed.triton.chunk_fwd import chunk_prep_kernel, chunk_state_output_kernel

CHUNK = 64

_SMEM_KB = {9: 227, 8: 163}


def _pow2(x):
    return triton.next_power_of_2(x)


def _smem_kb(device):
    if device.type != "cuda":
        return _SMEM_KB[9]
    major, minor = torch.cuda.get_device_capability(device)
    return 227 if major >= 9 else 163 if (major, minor) in ((8, 0), (8, 6), (8, 7), (8, 9)) else 99


def split_planes(dtype):
    """Whether Tm, M and the state enter the bf16/fp16 tensor-core dots as hi + lo pairs."""
    return dtype != torch.float32


def prep_config(K, dtype):
    return dict(BK=16, SPLIT=split_planes(dtype), num_warps=4, num_stages=2)


def state_config(K, V, dtype, smem_kb=227):
    BK = _pow2(K)
    esize = torch.finfo(dtype).bits // 8
    small_v = V % 32 != 0 or K > 128 or (esize == 4 and K > 64)
    BV = 16 if small_v else 32
    C = CHUNK
    # one pipeline stage holds q, k [C, BK], v [C, BV] in the input dtype and Tm, M [C, C] (4 B)
    stage_kb = (2 * C * BK * esize + C * BV * esize + 2 * C * C * 4) / 1024
    return dict(BK=BK, BV=BV, SPLIT=split_planes(dtype),
                num_warps=8 if K > 128 else 4,
                num_stages=2 if 2 * stage_kb + 16 <= smem_kb else 1)


def all_configs():
    """Every distinct launch config the dispatcher can choose on sm_90, for the AOT check, as
    (kernel, dtype, K, V, config) with the largest K and V (multiples of 16 up to 256) that choose it."""
    out, seen = [], set()
    dims = range(256, 0, -16)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for K in dims:
            for kind, V, cfg in [("prep", None, prep_config(K, dtype))] + [
                    ("state", V, state_config(K, V, dtype)) for V in dims]:
                key = (kind, dtype, tuple(sorted(cfg.items())))
                if key not in seen:
                    seen.add(key)
                    out.append((kind, dtype, K, V, cfg))
    return out


def chunk_prep(q, k, g, beta, table, HV, scale, use_l2norm):
    """Launches chunk_prep_kernel (grid (NC, HV)) and returns (Tm, M, rn), the per-chunk inputs of the
    state passes of the forward and the backward:
    Tm, M [NC, HV, P, C, C]: P = 1 plane of fp32 (fp32 inputs) or 2 planes hi, lo of the input dtype;
    rn [NC, HV, 2, C] fp32, the l2norm row factors of q and k (with use_l2norm; else a stand-in that
    no kernel reads)."""
    NC, (_, H, K) = table.shape[0], q.shape
    C = CHUNK
    p = prep_config(K, q.dtype)
    t_mat = torch.empty(NC, HV, 1 + p["SPLIT"], C, C, device=q.device,
                        dtype=q.dtype if p["SPLIT"] else torch.float32)
    m_mat = torch.empty_like(t_mat)
    l2 = bool(use_l2norm)
    rnorm = torch.empty(NC, HV, 2, C, dtype=torch.float32, device=q.device) if l2 else t_mat
    if NC > 0 and HV > 0:
        chunk_prep_kernel[(NC, HV)](q, k, g, beta, table, t_mat, m_mat, rnorm, scale, H=H, HV=HV, K=K,
                                    C=C, USE_L2=l2, **p)
    return t_mat, m_mat, rnorm


def chunk_state_pass(q, k, v, g, beta, table, cu_chunks, prep, h0, scale, use_l2norm, o=None, ht=None,
                     s_out=None, vnew_out=None):
    """Launches chunk_state_output_kernel, grid (N, HV, cdiv(V, BV)), on chunk_prep's outputs `prep`.
    Forward: writes o [T, HV, V] (every row) and ht [N, HV, K, V]. With s_out [NC, HV, K, V] and
    vnew_out [T, HV, V] (fp32; the backward's recompute) it writes those instead, and neither o nor ht."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu_chunks.numel() - 1
    store = s_out is not None
    s = state_config(K, V, q.dtype, _smem_kb(q.device))
    t_mat, m_mat, rnorm = prep
    unused = s_out if store else ht            # stand-in for the pointers this variant does not touch
    chunk_state_output_kernel[(N, HV, triton.cdiv(V, s["BV"]))](
        q, k, v, g, beta, table, cu_chunks, t_mat, m_mat, rnorm, unused if h0 is None else h0,
        unused if o is None else o, unused if ht is None else ht, unused if s_out is None else s_out,
        unused if vnew_out is None else vnew_out, scale, T,
        H=H, HV=HV, K=K, V=V, BK=s["BK"], BV=s["BV"], C=CHUNK, USE_L2=bool(use_l2norm),
        HAS_H0=h0 is not None, SPLIT=s["SPLIT"], STORE_STATES=store, num_warps=s["num_warps"],
        num_stages=s["num_stages"])


def chunk_gdr_fwd_triton(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                         o, final_state):
    """Writes o [T, HV, V] (every row: padding rows 0) and final_state [N, HV, K, V] float32.

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; table int32 [NC, 4]; cu_chunks int32 [N+1];
    initial_state [N, HV, K, V] or None. Two launches, grids from T, N and the shapes only."""
    if C != CHUNK:
        raise ValueError(f"the Triton kernels are written for chunk size {CHUNK}, got {C}")
    HV = v.shape[1]
    N = cu_chunks.numel() - 1
    if not (o.is_contiguous() and final_state.is_contiguous()):
        raise ValueError("o and final_state must be contiguous")
    if N == 0:
        o.zero_()               # no sequence: every row is padding
        return
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    prep = chunk_prep(q, k, g, beta, table, HV, scale, use_l2norm)
    chunk_state_pass(q, k, v, g, beta, table, cu_chunks, prep, h0, scale, use_l2norm, o=o,
                     ht=final_state)


def chunk_gdr_bwd_triton(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                         do, dht, dq, dk, dv, dg, dbeta, dh0):
    """Backward of backend="triton": the Triton backward kernels of gdn_packed/triton/chunk_bwd.py
    (imported here, not at the top: chunk_bwd imports this module's configs)."""
    from gdn_packed.triton.chunk_bwd import chunk_gdr_bwd_triton as bwd
    bwd(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
        do, dht, dq, dk, dv, dg, dbeta, dh0)
