"""Module-spec helpers: put gdn_packed's GatedDeltaNet where a Megatron spec has Megatron's.

    spec = use_packed_gdn(any_megatron_spec)    # ModuleSpec, list of specs, or a *Submodules dataclass
                                                # (strict=True: raise when it holds no GDN layer)

Everything else in the spec (TE or local linears, norms, layer wiring, metainfo) is kept, so the
model builds with the same parameters and loads the same checkpoints.
"""
import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec

from gdn_packed.megatron.gdn import GatedDeltaNet

_MEGATRON_GDN_MODULES = ("megatron.core.ssm.gated_delta_net", "megatron.core.ssm.gated_delta_net.gdn")


def _is_megatron_gdn(module) -> bool:
    if isinstance(module, tuple):  # (import path, class name) form of ModuleSpec.module
        return len(module) == 2 and module[0] in _MEGATRON_GDN_MODULES and module[1] == "GatedDeltaNet"
    return (isinstance(module, type) and module.__name__ == "GatedDeltaNet"
            and module.__module__ in _MEGATRON_GDN_MODULES)


def use_packed_gdn(spec, strict=False):
    """A copy of `spec` with every Megatron `GatedDeltaNet` replaced by gdn_packed's.

    `spec` may be a ModuleSpec, a list/tuple of them, or a submodules dataclass (e.g.
    TransformerBlockSubmodules, HybridStackSubmodules); it is walked recursively and not modified.
    A bare Megatron GatedDeltaNet class is replaced too. A spec without any (a pipeline stage that
    holds only attention layers) comes back as an equal copy; with `strict=True` that raises
    ValueError instead."""
    found = []
    out = _replace(spec, found)
    if strict and not found:
        raise ValueError("use_packed_gdn(strict=True): the spec contains no Megatron GatedDeltaNet "
                         "to replace")
    return out


def _replace(spec, found):
    if isinstance(spec, ModuleSpec):
        module = spec.module
        if _is_megatron_gdn(module):
            found.append(spec)
            module = GatedDeltaNet
        return dataclasses.replace(spec, module=module, submodules=_replace(spec.submodules, found))
    if _is_megatron_gdn(spec):
        found.append(spec)
        return GatedDeltaNet
    if isinstance(spec, (list, tuple)):
        return type(spec)(_replace(s, found) for s in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _replace(getattr(spec, f.name), found)
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec


def get_gated_delta_net_module_spec(config, backend=None) -> ModuleSpec:
    """Megatron's GDN attention spec for `config` (megatron.core.models.gpt.
    experimental_attention_variant_module_specs.get_gated_delta_net_module_spec) with our block."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec as megatron_spec,
    )
    return use_packed_gdn(megatron_spec(config=config, backend=backend))


def get_hybrid_stack_spec() -> ModuleSpec:
    """Megatron's hybrid (Mamba/GDN/attention) stack spec, `megatron.core.models.hybrid.
    hybrid_layer_specs.hybrid_stack_spec` (Transformer Engine layers), with our GDN block."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    return use_packed_gdn(hybrid_stack_spec)
