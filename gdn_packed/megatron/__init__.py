"""Megatron-Core integration: a drop-in `GatedDeltaNet` block (megatron-core 0.19.2 contract, with
TP, SP and CP; Megatron-LM main's constructor keywords) on gdn_packed kernels, and spec helpers that
put it in place of Megatron's.

    from gdn_packed.megatron import GatedDeltaNet, use_packed_gdn
    spec = use_packed_gdn(megatron_spec)      # every Megatron GatedDeltaNet in the spec replaced

Needs megatron-core (only this subpackage does); never fla-core or causal-conv1d.
"""
try:
    import megatron.core  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "gdn_packed.megatron needs megatron-core (tested with 0.19.2: `pip install megatron-core==0.19.2`, "
        "or on Python 3.11 `pip install --no-deps --ignore-requires-python megatron-core==0.19.2`); "
        "the rest of gdn_packed works without it") from e

from gdn_packed.megatron.gdn import GatedDeltaNet
from gdn_packed.megatron.spec import get_gated_delta_net_module_spec, get_hybrid_stack_spec, use_packed_gdn

__all__ = ["GatedDeltaNet", "use_packed_gdn", "get_gated_delta_net_module_spec", "get_hybrid_stack_spec"]
