"""The FLOP and byte model of docs/DESIGN.md section 8, and the roofline ceilings of known GPUs.

Everything is counted on REAL tokens: a padded run gets no credit for the pad it computes, so its
TFLOP/s and GB/s are "useful" rates, directly comparable with the packed run of the same documents.
Matmuls count 2*m*n*k, full (not triangular) C x C blocks, as the forward formula of docs/DESIGN.md does.

gdr, per real token and v-head, chunk size C:
  fwd     6CK + 4CV + 6KV + C^2/3       (KK^T, W = T Kb, QK^T; U = T Vb, intra-chunk O;
                                          W S, Q S, state update; the triangular inverse)
  bwd     16CK + 10CV + 20KV + 13C^2/3  (recompute of the forward's chunk quantities without O:
                                          6CK + 2CV + 6KV + C^2/3, then the analytic backward of
                                          docs/DESIGN.md section 2: 10CK + 8CV + 14KV + 4C^2 for dP K, dP^T Q,
                                          T^T dW', (dKK + dKK^T) K, dW' Kb^T; M^T dO, dO Vnew^T, T^T dVnew,
                                          dVnew Vb^T; seven KxV products; -T^T dT T^T)
  bytes   fwd: q, k, v read, o written in the input dtype, g and beta read in fp32, final state written
          (fp32); bwd: the same inputs plus dO read, dq dk dv dg dbeta written; fwdbwd = fwd + bwd.
conv (depthwise, width W, D channels, per token): fwd 2WD; bwd 4WD (dx and dweight);
  bytes fwd x + y, bwd x + dy + dx (+ weights).
recurrent (decode, per token and v-head): 7KV FLOPs (decay, S^T k, rank-1 update, S^T q);
  bytes: the fp32 state read and written + q, k, v, o.
layer: projections 2 * hidden * (2HK + 2HV*V + 2HV) + 2 * HV*V * hidden, the conv over q|k|v and the gdr
  fwd per token; fwdbwd = 3x projections and conv + gdr fwd + bwd. No byte model (weights dominate).
hybrid: no model (time and tokens/s only).
"""
from typing import Optional

from bench.registry import Scenario

CHUNK = 64
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

# name fragment -> (bytes/s, dense bf16 FLOP/s, source)
GPU_PEAKS = {
    "H200": (4.3e12, 790e12, "measured on the project's H200 (docs/DESIGN.md section 8)"),
    "H100": (3.35e12, 989e12, "H100 SXM spec sheet (not measured)"),
    "A100": (2.0e12, 312e12, "A100 80GB spec sheet (not measured)"),
}


def gdr_flops_per_token_head(K, V, mode, C=CHUNK):
    fwd = 6 * C * K + 4 * C * V + 6 * K * V + C * C / 3
    bwd = 16 * C * K + 10 * C * V + 20 * K * V + 13 * C * C / 3
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]


def flops(s: Scenario, op: str, mode: str) -> Optional[float]:
    t = s.real_tokens
    if op in ("gdr", "packing"):
        return t * s.HV * gdr_flops_per_token_head(s.K, s.V, mode)
    if op == "conv":
        return t * s.width * s.conv_width * (2 if mode == "fwd" else 6 if mode == "fwdbwd" else 4)
    if op == "recurrent":
        return t * s.HV * 7 * s.K * s.V
    if op == "layer":
        qkv = 2 * s.H * s.K + s.HV * s.V
        proj = 2 * s.hidden * (qkv + s.HV * s.V + 2 * s.HV) + 2 * s.HV * s.V * s.hidden
        conv = 2 * s.conv_width * qkv
        g = s.HV * gdr_flops_per_token_head(s.K, s.V, mode if mode != "bwd" else "bwd")
        return t * ((proj + conv) * (3 if mode == "fwdbwd" else 1) + g)
    return None


def bytes_moved(s: Scenario, op: str, mode: str) -> Optional[float]:
    t, e = s.real_tokens, DTYPE_BYTES[s.dtype]
    n = len(s.docs)
    if op in ("gdr", "packing"):
        qkv = t * (2 * s.H * s.K + s.HV * s.V) * e
        gb = t * s.HV * 2 * 4
        o = t * s.HV * s.V * e
        state = n * s.HV * s.K * s.V * 4
        fwd = qkv + gb + o + state
        bwd = 2 * (qkv + gb) + o
        return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]
    if op == "conv":
        x = t * s.width * e
        return {"fwd": 2 * x, "bwd": 3 * x, "fwdbwd": 5 * x}[mode]
    if op == "recurrent":
        return n * s.HV * s.K * s.V * 4 * 2 + t * (2 * s.H * s.K + 2 * s.HV * s.V) * e
    return None


def gpu_peaks(device_name: str, dtype: str):
    """(bytes/s, FLOP/s, source) for a known GPU, else None. fp32 inputs run tf32 dots: half the
    bf16 rate."""
    for frag, (bw, fl, src) in GPU_PEAKS.items():
        if frag in device_name.upper():
            return bw, (fl / 2 if dtype == "float32" else fl), src
    return None


def roofline_floor(fl, by, peaks):
    """Seconds the roofline allows: max(FLOPs / peak FLOP/s, bytes / peak bandwidth)."""
    if peaks is None or (fl is None and by is None):
        return None
    bw, pf, _ = peaks
    return max((fl or 0) / pf, (by or 0) / bw)
