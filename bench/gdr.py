"""The chunked gated delta rule (ops `gdr` and `packing`): inputs, provider calls, cases, correctness gate.

Calling convention of a provider's `call` (bench/providers.py declares the providers):
  varlen providers:  call(q, k, v, g, beta, cu_seqlens) -> o, on either a batch [B, T, ...] with
                     cu_seqlens None (dense scenarios and the padded side of `packing`) or a packed row
                     [1, T, ...] with cu_seqlens (int32);
  varlen=False:      call(q, k, v, g, beta) -> o on a batch; packed input is run one sequence at a time
                     (hf-torch, naive: that is what a caller of theirs has to do, and the rows say so).
The final state is always asked for (output_final_state=True), so every provider does the same work.
"""
import torch

from bench.common import Case, Family, Skip, grad_fn, randn
from gdn_packed.packing import cu_seqlens_from_lengths, unpack
from gdn_packed.testing import budgets as testing_budgets
from gdn_packed.testing import reference_gdr, rel_err

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
    cu = cu_seqlens_from_lengths(lengths, device=device)
    xs = [q, k, v, g, beta]
    if rows is not None:
        B, L = rows
        xs = [unpack(x, cu, B, L) for x in xs]
        cu = None
    xs = [x.contiguous().requires_grad_(requires_grad) for x in xs]
    return xs, cu


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


def varlen_call(p):
    """The provider's call in the varlen convention (batch-only calls wrapped by per_sequence)."""
    return p.call if p.varlen else per_sequence(p.call)


# ------------------------------------------------------------------------------------------------ calls
def ours(backend):
    """gdn_packed.chunk_gated_delta_rule on one backend. Inputs the backend refuses are a skip with its
    reason: the cuda chunked kernel takes K = V = 128 in bf16 / fp16 only, and asked for anything else
    the op raises, before any launch, the error of gdn_packed.cuda.chunk.refusal, which names
    backend='triton' as the way out."""
    def call(q, k, v, g, beta, cu):
        from gdn_packed import chunk_gated_delta_rule
        try:
            return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                          backend=backend)[0]
        except (TypeError, ValueError, RuntimeError) as e:
            if backend == "cuda" and "use backend='triton'" in str(e):
                raise Skip(f"ours-cuda refuses these inputs: {e}") from None
            raise
    call.backend = backend
    return call


def fla(q, k, v, g, beta, cu):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                  cu_seqlens=None if cu is None else cu.long())[0]


def hf(q, k, v, g, beta):
    """transformers' torch_chunk_gated_delta_rule (its plain torch function, not the FLA dispatch)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    f = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
    return f(q, k, v, g, beta, output_final_state=True)[0]


def naive(q, k, v, g, beta):
    """The per-token recurrence of gdn_packed.torch_ref.naive (docs/DESIGN.md section 9) in fp32."""
    from gdn_packed.torch_ref.naive import naive_recurrent_gdr
    return naive_recurrent_gdr(q, k, v, g, beta, compute_dtype=torch.float32)[0].to(v.dtype)


# ----------------------------------------------------------------------------------------------- cases
def build_case(p, s, layout, mode, device, dtype):
    """layout: 'dense' (B x T batch), 'packed' (cu_seqlens) or 'padded' (one document per row)."""
    if p.max_token_heads and s.real_tokens * s.HV > p.max_token_heads:
        raise Skip(f"{p.name} skipped above {p.max_token_heads} token-heads "
                   f"(this case: {s.real_tokens * s.HV})")
    grads = mode != "fwd"
    rows = s.rows(layout)
    xs, cu = make_inputs(s.H, s.HV, s.K, s.V, s.docs, dtype, device, rows=rows, requires_grad=grads)
    call = varlen_call(p)
    note = p.note_for(layout)
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
    """{o, grad} budgets of gdn_packed.testing.budgets; one gradient budget (the looser of grad and
    gate_grad: dg, dbeta on a GPU in fp32) for every gradient."""
    b = testing_budgets(dtype, device)
    return dict(o=b["o"], grad=max(b["grad"], b["gate_grad"]))


def gate(p, device, dtype, grads):
    """Run the provider's call at a small size, packed and batched, against the float64 reference (and
    its autograd gradients when `grads`). Returns (ok, {name: rel_err}, detail). ours-cuda at the one
    head size its kernel takes (K = V = 128)."""
    H, HV, K, V = (2, 4, 128, 128) if getattr(p.call, "backend", None) == "cuda" else (2, 4, 32, 32)
    call = varlen_call(p)
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


FAMILY = Family(ops=("gdr", "packing"), build=build_case, gate=gate)

__all__ = ["FAMILY", "make_inputs", "budgets", "ours", "fla", "hf", "naive", "NAIVE_MAX_TOKEN_HEADS"]
