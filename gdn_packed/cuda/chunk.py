"""Host side of csrc/chunk_gdr_fwd_sm90.cu: the chunked gated delta rule forward on sm_90a (K = V = 128,
bf16 / fp16), one warp-specialised CTA per (value head, sequence), over the device chunk table.
host=True runs the kernel's host mirror (the same tile program with plain loops, CPU tensors; it also
takes float32, which the device kernel does not). The backward of a cuda forward is the Triton one
(gdn_packed.triton.chunk.chunk_gdr_bwd_triton): the op saves only its inputs, which is all it needs.
"""
import torch

from gdn_packed.cuda.launch import launch

HEAD_DIM = 128          # the kernel's only K and V
CHUNK = 64


def unsupported(q, v, device):
    """'' when chunk_gdr_fwd_cuda takes these inputs on `device`, else the reason it does not."""
    from gdn_packed import _cext
    C = _cext.get_C()
    if C is not None and getattr(C, "chunk_gdr_fwd_sm90_missing", ""):
        return f"gdn_packed._C has no sm_90a chunked kernel: {C.chunk_gdr_fwd_sm90_missing}"
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"the cuda chunked kernel takes K = V = {HEAD_DIM}, got K = {q.shape[-1]}, V = {v.shape[-1]}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the cuda chunked kernel takes bfloat16 or float16 inputs, got {q.dtype}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        return "the cuda chunked kernel needs an sm_90 GPU (H100 / H200)"
    return ""


def _aligned(x):
    """x contiguous with a 16-byte aligned base (TMA)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def chunk_gdr_fwd_cuda(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm, o,
                       final_state, kept=None, *, A_log=None, dt_bias=None, host=False):
    """Writes o [T, HV, V] (every row: padding rows 0) and final_state [N, HV, K, V] float32, as
    gdn_packed.triton.chunk.chunk_gdr_fwd_triton. With A_log, dt_bias, g and beta are the raw a, b and
    the kernel forms the gates itself."""
    if C != CHUNK:
        raise ValueError(f"the cuda chunked kernel is written for chunk size {CHUNK}, got {C}")
    T, H, K = q.shape
    HV, Vd = v.shape[1], v.shape[2]
    N = cu_chunks.numel() - 1
    if N == 0:
        o.zero_()               # no sequence: every row is padding
        return
    raw = A_log is not None
    launch("chunk_gdr_fwd_sm90", q.device, host=host,
           reads=dict(q=_aligned(q), k=_aligned(k), v=_aligned(v), g=g.to(torch.float32),
                      beta=beta.to(torch.float32),
                      A_log=A_log.to(torch.float32) if raw else None, dt_bias=dt_bias.to(torch.float32) if raw else None,
                      table=table, cu_chunks=cu_chunks,
                      initial_state=None if initial_state is None else initial_state.to(torch.float32)),
           writes=dict(o=o, final_state=final_state), N=N, T=T, H=H, HV=HV, K=K, V=Vd, chunk_size=C,
           dtype=q.dtype, scale=float(scale), l2norm=bool(use_l2norm), raw_gates=raw)
