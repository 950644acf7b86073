"""The chunked gated delta rule (ops `gdr` and `packing`): inputs, providers, correctness gate.

Every provider is reduced to one call, `call(q, k, v, g, beta, cu_seqlens) -> o`, on either
  a batch [B, T, ...] without cu_seqlens (dense scenarios and the padded side of `packing`), or
  a packed row [1, T, ...] with cu_seqlens (int32).
The final state is always asked for (output_final_state=True), so every provider does the same work.
Providers without cu_seqlens support (hf-torch, naive) run packed input one sequence at a time:
that is what a caller of theirs has to do, and the rows say so.
"""
import torch

from bench.common import NEEDS_GPU, Case, Provider, Skip, grad_fn, import_reason, randn
from gdn_packed.testing import BUDGETS, reference_gdr, rel_err

NAIVE_MAX_TOKEN_HEADS = 64 * 1024     # naive: real tokens x v-heads above this are skipped


# ---------------------------------------------------------------------------------------------- inputs
def make_inputs(H, HV, K, V, lengths, dtype, device, *, rows=None, seed=0, requires_grad=False):
    """Packed [1, sum(lengths)] inputs with cu_seqlens, or with rows=(B, L) the batch [B, L] holding
    the same documents right-padded (pad: q = k = v = 0, g = 0, beta = 0) and cu_seqlens None.
    k rows are unit vectors, g = logsigmoid(x + 2) (slow decay), beta uniform in [0, 1]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(lengths)
    q = randn((1, T, H, K), torch.float32, device, gen)
    k = randn((1, T, H, K), torch.float32, device, gen)
    k = k / k.norm(dim=-1, keepdim=True)
    v = randn((1, T, HV, V), torch.float32, device, gen)
    g = torch.nn.functional.logsigmoid(randn((1, T, HV), torch.float32, device, gen) + 2.0)
    beta = torch.rand((1, T, HV), generator=gen, device=device)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device=device)
    xs = [q, k, v, g, beta]
    if rows is not None:
        from gdn_packed.packing import unpack
        B, L = rows
        xs = [unpack(x, cu, B, L) for x in xs]
        cu = None
    xs = [x.contiguous().requires_grad_(requires_grad) for x in xs]
    return xs, cu


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def per_sequence(fn):
    """A batch-only gdr function applied to packed input one sequence at a time."""
    def call(q, k, v, g, beta, cu):
        if cu is None:
            return fn(q, k, v, g, beta)
        bounds = cu.tolist()
        outs = [fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
                for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs, dim=1)
    return call


# ------------------------------------------------------------------------------------------- providers
def _ours(backend):
    def call(q, k, v, g, beta, cu):
        from gdn_packed import chunk_gated_delta_rule
        return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                      backend=backend)[0]

    def why_not(device):
        r = import_reason("gdn_packed", "chunk_gated_delta_rule")
        if r:
            return r
        if backend in ("triton", "cuda") and device.type != "cuda":
            return NEEDS_GPU
        from gdn_packed.ops import chunk_gdr
        have = getattr(chunk_gdr, "BACKENDS_IMPLEMENTED", ("torch",))
        if backend not in have:
            return f"backend={backend!r} not implemented yet (chunk_gdr has {', '.join(have)})"
        if backend == "cuda":
            from gdn_packed import cuda_available, cuda_unavailable_reason
            if not cuda_available():
                return f"gdn_packed._C unavailable: {cuda_unavailable_reason()}"
        return ""
    return call, why_not


def _fla():
    def call(q, k, v, g, beta, cu):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                      cu_seqlens=None if cu is None else cu.long())[0]

    def why_not(device):
        if device.type != "cuda":
            return "fla-core needs a GPU (its CPU path is the Triton interpreter)"
        return import_reason("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    return call, why_not


def _hf():
    def fn(q, k, v, g, beta):
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        f = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
        return f(q, k, v, g, beta, output_final_state=True)[0]

    def why_not(device):
        return import_reason("transformers.models.qwen3_next.modeling_qwen3_next",
                             "torch_chunk_gated_delta_rule")
    return per_sequence(fn), why_not


def _naive():
    def fn(q, k, v, g, beta):
        from gdn_packed.torch_ref.naive import naive_recurrent_gdr
        return naive_recurrent_gdr(q, k, v, g, beta, compute_dtype=torch.float32)[0].to(v.dtype)

    def why_not(device):
        return import_reason("gdn_packed.torch_ref.naive", "naive_recurrent_gdr")
    return per_sequence(fn), why_not


def _provider(name, call, why_not, note=""):
    p = Provider(name=name, why_not=why_not, build=None, gate=None, note=note)
    p.build = lambda s, layout, mode, device, dtype: build_case(p, call, s, layout, mode, device, dtype)
    p.gate = lambda device, dtype, grads: gate(call, device, dtype, grads)
    p.extra["call"] = call
    return p


def make_provider(name, call, why_not=lambda device: "", note=""):
    """A gdr provider from `call(q, k, v, g, beta, cu_seqlens) -> o` (tests register wrong ones)."""
    return _provider(name, call, why_not, note)


PROVIDERS = {
    "ours-triton": _provider("ours-triton", *_ours("triton")),
    "ours-cuda": _provider("ours-cuda", *_ours("cuda")),
    "ours-torch": _provider("ours-torch", *_ours("torch")),
    "fla": _provider("fla", *_fla()),
    "hf-torch": _provider("hf-torch", *_hf()),
    "naive": _provider("naive", *_naive(), note="per-token loop, fp32"),
}
# hf-torch and naive have no cu_seqlens: a batch is one call, packed input one call per sequence
PROVIDERS["hf-torch"].extra["notes"] = {"packed": "no cu_seqlens: one call per sequence",
                                        "padded": "one batched call over the padded rows"}
PROVIDERS["naive"].extra["notes"] = {"packed": "per-token loop, fp32, one call per sequence",
                                     "padded": "per-token loop, fp32, batched rows"}


# ----------------------------------------------------------------------------------------------- cases
def build_case(p, call, s, layout, mode, device, dtype):
    """layout: 'dense' (B x T batch), 'packed' (cu_seqlens) or 'padded' (one document per row)."""
    if p.name == "naive" and s.real_tokens * s.HV > NAIVE_MAX_TOKEN_HEADS:
        raise Skip(f"naive per-token loop skipped above {NAIVE_MAX_TOKEN_HEADS} token-heads "
                   f"(this case: {s.real_tokens * s.HV})")
    grads = mode != "fwd"
    if layout == "dense":
        xs, cu = make_inputs(s.H, s.HV, s.K, s.V, s.docs, dtype, device, rows=(s.B, s.T),
                             requires_grad=grads)
    elif layout == "padded":
        xs, cu = make_inputs(s.H, s.HV, s.K, s.V, s.docs, dtype, device, rows=(len(s.docs), s.T),
                             requires_grad=grads)
    else:
        xs, cu = make_inputs(s.H, s.HV, s.K, s.V, s.docs, dtype, device, requires_grad=grads)
    note = p.extra.get("notes", {}).get(layout, p.note)
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return call(*xs, cu)
        return Case(fwd, note)
    bwd, fwdbwd = grad_fn(lambda: call(*xs, cu), xs)
    return Case(bwd if mode == "bwd" else fwdbwd, note)


# ------------------------------------------------------------------------------------------------ gate
GATE_LENGTHS = (37, 64, 100)     # packed: odd lengths, a partial chunk, two chunks
GATE_DENSE = (2, 70)             # batch rows x tokens


def budgets(dtype, device):
    if dtype == torch.float32 and device.type == "cuda":    # tf32 dots (docs/DESIGN.md section 7)
        return dict(o=2e-3, grad=5e-3)
    b = BUDGETS[dtype]
    return dict(o=b["o"], grad=b["grad"])


def gate(call, device, dtype, grads):
    """Run `call` at a small size, packed and batched, against the float64 reference (and its autograd
    gradients when `grads`). Returns (ok, {name: rel_err}, detail)."""
    H, HV, K, V = 2, 4, 32, 32
    errs = {}
    budget = budgets(dtype, device)
    for tag, rows, lengths in (("packed", None, GATE_LENGTHS),
                               ("batch", GATE_DENSE, (GATE_DENSE[1],) * GATE_DENSE[0])):
        xs, cu = make_inputs(H, HV, K, V, lengths, dtype, device, rows=rows, seed=1, requires_grad=grads)
        o = call(*xs, cu)
        ref_in = [x.detach().cpu().double().requires_grad_(grads) for x in xs]
        ref, _ = reference_gdr(*ref_in, cu_seqlens=None if cu is None else cu.cpu())
        errs[f"o[{tag}]"] = rel_err(o.float().cpu(), ref)
        if grads:
            do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
            got = torch.autograd.grad(o, xs, do.to(device=device, dtype=o.dtype))
            want = torch.autograd.grad(ref, ref_in, do)
            for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
                errs[f"{n}[{tag}]"] = rel_err(a.float().cpu(), b)
    bad = {n: e for n, e in errs.items() if not e <= budget["o" if n.startswith("o") else "grad"]}
    detail = ", ".join(f"{n} {e:.2e}" for n, e in bad.items())
    return (not bad), errs, (f"rel. err over budget {budget}: {detail}" if bad else "")


__all__ = ["PROVIDERS", "make_provider", "make_inputs", "gate", "budgets"]
