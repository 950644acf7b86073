"""The varlen causal conv (`conv`) and the decode step (`recurrent`): inputs, providers, gates.

conv:      gdn_packed.causal_conv1d_varlen(x [1, T, D] | [B, L, D], weight [D, W], bias, "silu",
           cu_seqlens) -> (y, final_state); reference: per-sequence depthwise F.conv1d in float64.
recurrent: gdn_packed.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
           output_final_state=True, cu_seqlens) -> (o, final_state), N sequences of one token each
           (decode) with fp32 states; reference: gdn_packed.testing.reference_gdr.
"""
import torch
import torch.nn.functional as F

from bench.common import DTYPES, NEEDS_GPU, Case, Provider, grad_fn, import_reason, randn
from bench.gdr import budgets, make_inputs
from gdn_packed.testing import reference_gdr, rel_err


def _backend_why_not(fn_name, backend):
    def why_not(device):
        r = import_reason("gdn_packed", fn_name)
        if r:
            return r
        if backend in ("triton", "cuda") and device.type != "cuda":
            return NEEDS_GPU
        if backend == "cuda":
            from gdn_packed import cuda_available, cuda_unavailable_reason
            if not cuda_available():
                return f"gdn_packed._C unavailable: {cuda_unavailable_reason()}"
        return ""
    return why_not


# ------------------------------------------------------------------------------------------------ conv
def conv_reference(x, weight, bias, lengths, rows=None):
    """float64 per-sequence causal depthwise conv + SiLU; x packed [1, T, D] (or [B, L, D] with
    rows = (B, L): each row one sequence)."""
    D, W = weight.shape
    w = weight.double().unsqueeze(1)
    b = None if bias is None else bias.double()
    segs = ([x[i:i + 1] for i in range(x.shape[0])] if rows is not None else
            [x[:, a:a + n] for a, n in zip([sum(lengths[:i]) for i in range(len(lengths))], lengths)])
    outs = [F.silu(F.conv1d(F.pad(s.double().transpose(1, 2), (W - 1, 0)), w, b, groups=D)).transpose(1, 2)
            for s in segs]
    return torch.cat(outs, dim=0 if rows is not None else 1)


def _conv_provider(backend):
    def call(x, w, b, cu):
        from gdn_packed import causal_conv1d_varlen
        return causal_conv1d_varlen(x, w, b, "silu", cu, output_final_state=True, backend=backend)[0]

    def inputs(D, W, lengths, rows, dtype, device, grads, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        T = sum(lengths)
        B, L = rows if rows is not None else (1, T)
        x = randn((B, L, D), dtype, device, gen).requires_grad_(grads)
        w = randn((D, W), dtype, device, gen, scale=0.5).requires_grad_(grads)
        b = randn((D,), dtype, device, gen, scale=0.1).requires_grad_(grads)
        cu = (None if rows is not None else
              torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))],
                           dtype=torch.int32, device=device))
        return x, w, b, cu

    def build(s, layout, mode, device, dtype):
        rows = {"dense": (s.B, s.T), "padded": (len(s.docs), s.T)}.get(layout)
        x, w, b, cu = inputs(s.width, s.conv_width, s.docs, rows, dtype, device, mode != "fwd")
        if mode == "fwd":
            def fwd():
                with torch.no_grad():
                    return call(x, w, b, cu)
            return Case(fwd)
        bwd, fwdbwd = grad_fn(lambda: call(x, w, b, cu), [x, w, b])
        return Case(bwd if mode == "bwd" else fwdbwd)

    def gate(device, dtype, grads):
        errs, lengths = {}, (1, 3, 37, 100)
        x, w, b, cu = inputs(20, 4, lengths, None, dtype, device, False, seed=1)
        errs["y"] = rel_err(call(x, w, b, cu).float().cpu(), conv_reference(x.cpu(), w.cpu(), b.cpu(), lengths))
        ok = errs["y"] <= budgets(dtype, device)["o"]
        return ok, errs, "" if ok else f"y rel. err {errs['y']:.2e}"

    p = Provider(f"ours-{backend}", _backend_why_not("causal_conv1d_varlen", backend), build, gate)
    p.extra["call"] = call
    return p


CONV_PROVIDERS = {f"ours-{b}": _conv_provider(b) for b in ("triton", "cuda", "torch")}


# ------------------------------------------------------------------------------------------- recurrent
def _decode_inputs(s_H, s_HV, K, V, lengths, dtype, device, seed=0):
    xs, cu = make_inputs(s_H, s_HV, K, V, lengths, dtype, device, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    h0 = randn((len(lengths), s_HV, K, V), torch.float32, device, gen, scale=0.1)
    return xs, cu, h0


def _rec_provider(name, call, why_not, note=""):
    def build(s, layout, mode, device, dtype):
        xs, cu, h0 = _decode_inputs(s.H, s.HV, s.K, s.V, s.docs, dtype, device)

        def fwd():
            with torch.no_grad():
                return call(*xs, cu, h0)
        return Case(fwd, note)

    def gate(device, dtype, grads):
        lengths = (1, 5, 17)
        xs, cu, h0 = _decode_inputs(2, 4, 32, 32, lengths, dtype, device, seed=1)
        o, ht = call(*xs, cu, h0)
        ref_o, ref_h = reference_gdr(*[x.cpu().double() for x in xs], initial_state=h0.cpu().double(),
                                     cu_seqlens=cu.cpu())
        errs = {"o": rel_err(o.float().cpu(), ref_o), "state": rel_err(ht.float().cpu(), ref_h)}
        b = budgets(dtype, device)["o"]
        bad = {k: e for k, e in errs.items() if not e <= b}
        return not bad, errs, ", ".join(f"{k} rel. err {e:.2e}" for k, e in bad.items())

    p = Provider(name, why_not, build, gate, note)
    p.extra["call"] = call
    return p


def _ours_rec(backend):
    def call(q, k, v, g, beta, cu, h0):
        from gdn_packed import fused_recurrent_gated_delta_rule
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, backend=backend)
    return _rec_provider(f"ours-{backend}", call, _backend_why_not("fused_recurrent_gated_delta_rule", backend))


def _fla_rec():
    def call(q, k, v, g, beta, cu, h0):
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu.long())

    def why_not(device):
        if device.type != "cuda":
            return "fla-core needs a GPU (its CPU path is the Triton interpreter)"
        return import_reason("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule")
    return _rec_provider("fla", call, why_not)


def _naive_rec():
    def call(q, k, v, g, beta, cu, h0):
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
    return _rec_provider("naive", call, lambda device: import_reason("gdn_packed.torch_ref.naive"),
                         note="torch per-token reference in fp32, the N decode steps batched")


REC_PROVIDERS = {"ours-cuda": _ours_rec("cuda"), "ours-triton": _ours_rec("triton"),
                 "ours-torch": _ours_rec("torch"), "fla": _fla_rec(), "naive": _naive_rec()}

__all__ = ["CONV_PROVIDERS", "REC_PROVIDERS", "conv_reference", "DTYPES"]
