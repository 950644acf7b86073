"""Custom-op registration and dispatch, one module per op (namespace `gdn_packed`).

BACKENDS maps each public op to the backends it has kernels for (fastest GPU one first); "auto" picks
among them (gdn_packed.ops._common.resolve_backend). Layers and the bench read it from here. It is
derived from the dispatch table gdn_packed.ops._dispatch.TABLE (op -> backend -> implementation).
"""
from gdn_packed.ops._dispatch import TABLE as _TABLE

BACKENDS = {op: tuple(backends) for op, backends in _TABLE.items()}
