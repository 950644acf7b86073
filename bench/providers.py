"""Every provider of the benchmark, declared once: PROVIDERS[op][name] -> Provider.

A declaration names the provider, its op family (bench/gdr.py, kernels.py, layers.py: how its cases
are built and how it is gated), its call in that family's convention, whether it takes cu_seqlens
(`varlen`), and why it cannot run on a device (`why_not`). gdn_packed's own providers are
`ours-<backend>` for exactly the backends gdn_packed.ops.BACKENDS lists for the public op, so no row
stands for a backend an op does not have. The layers use `ours` (the backend the layer picks).

register(provider) adds a provider to every op of its family and unregister(provider) removes it
(the tests register deliberately wrong providers to check that the gate stops them).
"""
import os
import sys

from bench import gdr, kernels, layers
from bench.common import NEEDS_GPU, Provider, import_reason
from gdn_packed.ops import BACKENDS

PROVIDERS = {}      # op -> {provider name -> Provider}, in declaration order


def register(p: Provider) -> Provider:
    """Add `p` under every op of its family; a name already taken there is a ValueError."""
    for op in p.family.ops:
        if p.name in PROVIDERS.get(op, {}):
            raise ValueError(f"provider {p.name!r} is already registered for op {op!r}")
    for op in p.family.ops:
        PROVIDERS.setdefault(op, {})[p.name] = p
    return p


def unregister(p: Provider) -> None:
    """Remove `p` from every op of its family (a KeyError if it is not registered there)."""
    for op in p.family.ops:
        if PROVIDERS.get(op, {}).get(p.name) is not p:
            raise KeyError(f"provider {p.name!r} is not registered for op {op!r}")
    for op in p.family.ops:
        del PROVIDERS[op][p.name]


def _ours_why_not(fn_name, backend):
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


def _ours(family, fn_name, call_for):
    """ours-<backend> for each backend gdn_packed.ops.BACKENDS lists for the public op `fn_name`."""
    return [Provider(f"ours-{b}", family, call_for(b), _ours_why_not(fn_name, b)) for b in BACKENDS[fn_name]]


FLA_NOTE = "FLA's Triton kernels (FLA_DISABLE_BACKEND_DISPATCH=1: no dispatch to FlashQLA)"


def _fla_why_not(fn_name):
    def why_not(device):
        if device.type != "cuda":
            return "fla-core needs a GPU (its CPU path is the Triton interpreter)"
        # recent FLA hands its ops to FlashQLA when flash_qla imports; the fla row times FLA's own kernels
        os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
        why = import_reason("fla.ops.gated_delta_rule", fn_name)
        backends = sys.modules.get("fla.backends")
        if not why and backends is not None and hasattr(backends, "_DISPATCH_DISABLED"):
            backends._DISPATCH_DISABLED = True      # fla imported before the variable was set: it read it then
        return why
    return why_not


def _needs(modname, attr):
    """why_not of a provider that runs wherever `modname.attr` imports."""
    return lambda device: import_reason(modname, attr)


_NAIVE = _needs("gdn_packed.torch_ref.naive", "naive_recurrent_gdr")


DECLARED = (
    *_ours(gdr.FAMILY, "chunk_gated_delta_rule", gdr.ours),
    Provider("fla", gdr.FAMILY, gdr.fla, _fla_why_not("chunk_gated_delta_rule"), note=FLA_NOTE),
    Provider("hf-torch", gdr.FAMILY, gdr.hf, _needs("transformers.models.qwen3_next.modeling_qwen3_next",
                                                    "torch_chunk_gated_delta_rule"), varlen=False),
    Provider("naive", gdr.FAMILY, gdr.naive, _NAIVE, note="per-token loop, fp32", varlen=False,
             max_token_heads=gdr.NAIVE_MAX_TOKEN_HEADS),
    *_ours(kernels.CONV, "causal_conv1d_varlen", kernels.ours_conv),
    *_ours(kernels.RECURRENT, "fused_recurrent_gated_delta_rule", kernels.ours_rec),
    Provider("fla", kernels.RECURRENT, kernels.fla_rec, _fla_why_not("fused_recurrent_gated_delta_rule"),
             note=FLA_NOTE),
    Provider("naive", kernels.RECURRENT, kernels.naive_rec, _NAIVE,
             note="torch per-token reference in fp32, the N decode steps batched"),
    Provider("ours", layers.LAYER, layers.ours_layer, _needs("gdn_packed.layers", "GatedDeltaNet")),
    Provider("megatron", layers.LAYER, layers.megatron_layer, layers.megatron_why_not,
             note="megatron-core block, local submodules"),
    Provider("ours", layers.HYBRID, layers.ours_hybrid, _needs("gdn_packed.layers", "HybridLM")),
)
for _p in DECLARED:
    register(_p)

__all__ = ["DECLARED", "PROVIDERS", "register", "unregister"]
