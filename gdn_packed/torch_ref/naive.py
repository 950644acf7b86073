"""The gated delta rule as docs/DESIGN.md section 2 states it: one token at a time.

    S~  = exp(g_t) * S_{t-1}
    u_t = beta_t * (v_t - S~^T k_t)
    S_t = S~ + k_t u_t^T
    o_t = scale * S_t^T q_t

q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [B, HV, K, V]. Every row of the
batch is one sequence. GVA: v-head h reads qk-head h // (HV // H). Computed in the dtype of `q` after
promotion to `compute_dtype` (float64 for the test reference), differentiable by autograd.
This is the reference, not a fast path: it loops over tokens.
"""
import torch


def l2norm(x, eps: float = 1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def naive_recurrent_gdr(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                        use_qk_l2norm_in_kernel=False, compute_dtype=torch.float64):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    G = HV // H
    q = q.repeat_interleave(G, dim=2)   # reference only; the kernels index natively
    k = k.repeat_interleave(G, dim=2)
    S = (torch.zeros(B, HV, K, V, dtype=compute_dtype, device=q.device) if initial_state is None
         else initial_state.to(compute_dtype))
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        kt = k[:, t]
        u = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * u[..., None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1) if T else v.new_zeros(B, 0, HV, V)
    return o, (S if output_final_state else None)
