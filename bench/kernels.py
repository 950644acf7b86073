"""The varlen causal conv (`conv`) and the decode step (`recurrent`): inputs, provider calls, cases, gates.

conv:      a provider's call(x, weight, bias, cu_seqlens) -> y, as gdn_packed.causal_conv1d_varlen(x
           [1, T, D] | [B, L, D], weight [D, W], bias, "silu", cu_seqlens) computes it; reference:
           per-sequence depthwise F.conv1d in float64.
recurrent: a provider's call(q, k, v, g, beta, cu_seqlens, h0) -> (o, final_state), as
           gdn_packed.fused_recurrent_gated_delta_rule(..., initial_state=h0, output_final_state=True,
           cu_seqlens) computes it, on N sequences of one token each (decode) with fp32 states;
           reference: gdn_packed.testing.reference_gdr.
bench/providers.py declares the providers.
"""
import torch
import torch.nn.functional as F

from bench.common import Case, Family, grad_fn, randn
from bench.gdr import budgets, make_inputs
from gdn_packed.packing import cu_seqlens_from_lengths
from gdn_packed.testing import reference_gdr, rel_err


# ------------------------------------------------------------------------------------------------ conv
def conv_reference(x, weight, bias, lengths, rows=None):
    """float64 per-sequence causal depthwise conv + SiLU; x packed [1, T, D] (or [B, L, D] with
    rows = (B, L): each row one sequence)."""
    D, W = weight.shape
    w = weight.double().unsqueeze(1)
    b = None if bias is None else bias.double()
    bounds = cu_seqlens_from_lengths(lengths).tolist()
    segs = ([x[i:i + 1] for i in range(x.shape[0])] if rows is not None else
            [x[:, a:e] for a, e in zip(bounds[:-1], bounds[1:])])
    outs = [F.silu(F.conv1d(F.pad(s.double().transpose(1, 2), (W - 1, 0)), w, b, groups=D)).transpose(1, 2)
            for s in segs]
    return torch.cat(outs, dim=0 if rows is not None else 1)


def ours_conv(backend):
    """gdn_packed.causal_conv1d_varlen on one backend."""
    def call(x, w, b, cu):
        from gdn_packed import causal_conv1d_varlen
        return causal_conv1d_varlen(x, w, b, "silu", cu, output_final_state=True, backend=backend)[0]
    return call


def _conv_inputs(D, W, lengths, rows, dtype, device, grads, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(lengths)
    B, L = rows if rows is not None else (1, T)
    x = randn((B, L, D), dtype, device, gen).requires_grad_(grads)
    w = randn((D, W), dtype, device, gen, scale=0.5).requires_grad_(grads)
    b = randn((D,), dtype, device, gen, scale=0.1).requires_grad_(grads)
    cu = None if rows is not None else cu_seqlens_from_lengths(lengths, device=device)
    return x, w, b, cu


def _conv_build(p, s, layout, mode, device, dtype):
    rows = s.rows(layout)
    x, w, b, cu = _conv_inputs(s.width, s.conv_width, s.docs, rows, dtype, device, mode != "fwd")
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return p.call(x, w, b, cu)
        return Case(fwd, p.note)
    bwd, fwdbwd = grad_fn(lambda: p.call(x, w, b, cu), [x, w, b])
    return Case(bwd if mode == "bwd" else fwdbwd, p.note)


def _conv_gate(p, device, dtype, grads):
    errs, lengths = {}, (1, 3, 37, 100)
    x, w, b, cu = _conv_inputs(20, 4, lengths, None, dtype, device, False, seed=1)
    errs["y"] = rel_err(p.call(x, w, b, cu).float().cpu(), conv_reference(x.cpu(), w.cpu(), b.cpu(), lengths))
    ok = errs["y"] <= budgets(dtype, device)["o"]
    return ok, errs, "" if ok else f"y rel. err {errs['y']:.2e}"


CONV = Family(ops=("conv",), build=_conv_build, gate=_conv_gate)


# ------------------------------------------------------------------------------------------- recurrent
def _decode_inputs(H, HV, K, V, lengths, dtype, device, seed=0):
    xs, cu = make_inputs(H, HV, K, V, lengths, dtype, device, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    h0 = randn((len(lengths), HV, K, V), torch.float32, device, gen, scale=0.1)
    return xs, cu, h0


def _rec_build(p, s, layout, mode, device, dtype):
    xs, cu, h0 = _decode_inputs(s.H, s.HV, s.K, s.V, s.docs, dtype, device)

    def fwd():
        with torch.no_grad():
            return p.call(*xs, cu, h0)
    return Case(fwd, p.note)


def _rec_gate(p, device, dtype, grads):
    lengths = (1, 5, 17)
    xs, cu, h0 = _decode_inputs(2, 4, 32, 32, lengths, dtype, device, seed=1)
    o, ht = p.call(*xs, cu, h0)
    ref_o, ref_h = reference_gdr(*[x.cpu().double() for x in xs], initial_state=h0.cpu().double(),
                                 cu_seqlens=cu.cpu())
    errs = {"o": rel_err(o.float().cpu(), ref_o), "state": rel_err(ht.float().cpu(), ref_h)}
    b = budgets(dtype, device)["o"]
    bad = {k: e for k, e in errs.items() if not e <= b}
    return not bad, errs, ", ".join(f"{k} rel. err {e:.2e}" for k, e in bad.items())


RECURRENT = Family(ops=("recurrent",), build=_rec_build, gate=_rec_gate)


def ours_rec(backend):
    """gdn_packed.fused_recurrent_gated_delta_rule on one backend."""
    def call(q, k, v, g, beta, cu, h0):
        from gdn_packed import fused_recurrent_gated_delta_rule
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, backend=backend)
    return call


def fla_rec(q, k, v, g, beta, cu, h0):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu.long())


def naive_rec(q, k, v, g, beta, cu, h0):
    """gdn_packed.torch_ref.naive's per-token recurrence in fp32: the N decode steps as one batch,
    longer sequences one at a time."""
    from gdn_packed.torch_ref.naive import naive_recurrent_gdr
    bounds = cu.tolist()
    if all(b - a == 1 for a, b in zip(bounds[:-1], bounds[1:])):     # decode: one batched step
        o, h = naive_recurrent_gdr(*[x.transpose(0, 1) for x in (q, k, v, g, beta)], initial_state=h0,
                                   compute_dtype=torch.float32)
        return o.transpose(0, 1).to(v.dtype), h
    outs, hs = [], []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, h = naive_recurrent_gdr(*[x[:, a:b] for x in (q, k, v, g, beta)], initial_state=h0[i:i + 1],
                                   compute_dtype=torch.float32)
        outs.append(o.to(v.dtype))
        hs.append(h)
    return torch.cat(outs, 1), torch.cat(hs)


__all__ = ["CONV", "RECURRENT", "conv_reference", "ours_conv", "ours_rec", "fla_rec", "naive_rec"]
