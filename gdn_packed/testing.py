"""Test helpers shared by tests/ and bench/ (docs/DESIGN.md section 7). Not needed at run time.

Numerics
    BUDGETS, GPU_FP32_BUDGETS, budgets(dtype, device): the error budgets {o, state, grad, gate_grad}.
    rel_err(x, ref): ||x - ref|| / ||ref|| in float64 (inf when x has NaN/Inf).
    reference_gdr(...): the float64 per-token recurrence run per sequence, unpacked (differentiable).
Packed layouts and cases
    layout(lengths, gaps=, tail=): cu_seqlens, cu_seqlens_padded (or None) and the row count.
    real_rows(cu_seqlens, cu_seqlens_padded, rows): bool mask of the rows holding a real token.
    Packing, PACKINGS, PACKING_BY_NAME: the one list of packed layouts every op's specification test runs.
    GdrCase, GDR_CASES: the chunked op's cases (PACKINGS x heads, head sizes, initial state, l2norm).
    case_id(packing, *parts, flags=), gdr_case_id(case), DTYPE_ID: test ids.
    gdr_inputs(rows, H, HV, K, V, dtype, ...): random q, k, v, g, beta (and h0) in the packed layout.
    cuda_forward_probe(): the sm_90a chunked forward's launch that hung on an H200, run once on the GPU.
Backends
    op_backends(op, device): the backends of gdn_packed.ops.BACKENDS[op] that can run here.
    backend_params(op, device): one pytest parameter per backend of the op, a skip with the reason
    for those that cannot run here.
Guards
    poisoned_outputs(): ops allocate their outputs filled with NaN inside (a row nobody writes shows).
    no_host_sync(): raises on any read-back of a tensor to the host inside (CPU stand-in for CUDA's
    sync debug mode).
"""
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gdn_packed.ops._common import poisoned_outputs  # noqa: F401  (re-exported)
from gdn_packed.torch_ref.naive import naive_recurrent_gdr

# bf16/fp16 budgets of docs/DESIGN.md section 7, and the fp32-on-CPU budget
# (gate_grad: dg and dbeta, the same as the other gradients except for fp32 on a GPU)
BUDGETS = {
    torch.float32: dict(o=1e-5, state=1e-5, grad=1e-5, gate_grad=1e-5),
    torch.float64: dict(o=1e-10, state=1e-10, grad=1e-10, gate_grad=1e-10),
    torch.float16: dict(o=2e-2, state=2e-2, grad=2.5e-2, gate_grad=2.5e-2),
    torch.bfloat16: dict(o=2e-2, state=2e-2, grad=2.5e-2, gate_grad=2.5e-2),
}

# fp32 inputs on a GPU: the Triton kernels run every fp32 dot at tf32 (gdn_packed/triton/configs.py,
# dot_precision), so outputs of fp32 inputs on CUDA are held to these (docs/DESIGN.md section 7)
GPU_FP32_BUDGETS = dict(o=2e-3, state=2e-3, grad=3e-3, gate_grad=5e-3)


# short test ids of the input dtypes
DTYPE_ID = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}


def budgets(dtype, device="cpu"):
    """Error budgets {o, state, grad, gate_grad} for outputs of `dtype` inputs computed on `device`."""
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        return GPU_FP32_BUDGETS
    return BUDGETS[dtype]


def rel_err(x, ref):
    """||x - ref|| / ||ref|| in float64 (||x|| when ref is all zeros); inf if x has NaN/Inf."""
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return float("inf")
    d = (x - ref).norm().item()
    n = ref.norm().item()
    return d / n if n > 0 else d


def real_rows(cu_seqlens, cu_seqlens_padded=None, total_rows=None):
    """Bool [rows]: True on rows that hold a real token (host-side, for tests)."""
    cu = cu_seqlens.tolist()
    pad = cu if cu_seqlens_padded is None else cu_seqlens_padded.tolist()
    rows = total_rows if total_rows is not None else pad[-1]
    mask = torch.zeros(rows, dtype=torch.bool)
    for i in range(len(cu) - 1):
        mask[pad[i]: pad[i] + cu[i + 1] - cu[i]] = True
    return mask


def layout(lengths, *, gaps=None, tail=0, index_dtype=torch.int32):
    """cu_seqlens and cu_seqlens_padded (or None when gaps is None) and the total rows, for sequences
    of `lengths` stored with gaps[i] padding rows after sequence i and `tail` rows at the end."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if gaps is None:
        return torch.tensor(cu, dtype=index_dtype), None, cu[-1] + tail
    pad = [0]
    for n, gap in zip(lengths, gaps):
        pad.append(pad[-1] + n + gap)
    return torch.tensor(cu, dtype=index_dtype), torch.tensor(pad, dtype=index_dtype), pad[-1] + tail


class Packing:
    """One packed layout: sequence lengths, padding rows after each sequence (or None: no gaps) and
    padding rows at the end. `layout()` gives (cu_seqlens, cu_seqlens_padded or None, rows)."""

    def __init__(self, name, lengths, gaps=None, tail=0):
        self.name, self.lengths, self.gaps, self.tail = name, list(lengths), gaps, tail

    def layout(self, index_dtype=torch.int32):
        return layout(self.lengths, gaps=self.gaps, tail=self.tail, index_dtype=index_dtype)

    @property
    def has_padding(self):
        return bool(self.tail) or bool(self.gaps and any(self.gaps))

    def __repr__(self):
        return self.name


# The packings every op's specification test runs (docs/DESIGN.md section 7): zero-length and
# single-token sequences, lengths around the chunk size (64), padding between and after sequences;
# the across-chunks pair (a first document of 40 rows, one token as the third, the last owning the
# last row when dense) is what tests/test_isolation.py poisons the chunked op's documents in.
PACKINGS = [
    Packing("one-long", [300]),
    Packing("mixed", [0, 1, 63, 64, 65, 127, 300, 5]),
    Packing("gaps-and-empties", [65, 0, 1, 0], gaps=[3, 0, 7, 1], tail=5),
    Packing("around-chunk-gaps", [127, 64, 63], gaps=[1, 64, 0], tail=9),
    Packing("one-token", [1]),
    Packing("chunk-multiples", [64, 64, 1, 0, 127], gaps=[0, 0, 0, 2, 0], tail=3),
    Packing("only-padding", [0, 0], gaps=[2, 3], tail=1),
    Packing("across-chunks", [40, 70, 1, 66]),
    Packing("across-chunks-gaps", [40, 70, 1, 66], gaps=[3, 0, 2, 0], tail=4),
]
PACKING_BY_NAME = {p.name: p for p in PACKINGS}


class GdrCase(NamedTuple):
    """One case of the chunked op's specification test: a packing from PACKINGS crossed with head
    counts (H qk-heads, HV v-heads), head sizes K, V and the flags (initial state, l2norm in kernel)."""
    packing: Packing
    H: int
    HV: int
    K: int
    V: int
    h0: bool
    l2: bool


def _gdr(name, H, HV, K, V, h0=False, l2=False):
    return GdrCase(PACKING_BY_NAME[name], H, HV, K, V, h0, l2)


# The chunked op's cases (tests/test_chunk_gdr.py runs each on every backend available): every packing,
# GVA ratios 1/2/4/8, K != V, with and without initial state and l2norm, and K > 128 (192 is not a power
# of 2: the state's upper K block is masked) on a packing whose 65-token sequence spans two chunks.
GDR_CASES = [
    _gdr("one-long", 2, 2, 32, 16),
    _gdr("mixed", 1, 4, 16, 32, h0=True, l2=True),
    _gdr("gaps-and-empties", 2, 4, 16, 32, h0=True),
    _gdr("around-chunk-gaps", 1, 2, 32, 48, l2=True),
    _gdr("one-token", 1, 8, 16, 16, h0=True, l2=True),
    _gdr("chunk-multiples", 1, 1, 64, 32, h0=True, l2=True),
    _gdr("only-padding", 1, 2, 16, 16, h0=True),
    _gdr("gaps-and-empties", 1, 2, 192, 16, h0=True, l2=True),
    _gdr("gaps-and-empties", 1, 1, 256, 16),
]


def case_id(packing, *parts, flags=()):
    """Test id of a case: packing name, N sequences, T real tokens, then `parts` and the names of the
    true `flags` ((name, bool) pairs), e.g. gaps-and-empties-N4-T66-H2x4-K16-V32-h0."""
    head = f"{packing.name}-N{len(packing.lengths)}-T{sum(packing.lengths)}"
    return "-".join([head, *map(str, parts), *(name for name, on in flags if on)])


def gdr_case_id(case):
    """Test id of a GdrCase, e.g. gaps-and-empties-N4-T66-H2x4-K16-V32-h0-l2."""
    return case_id(case.packing, f"H{case.H}x{case.HV}", f"K{case.K}", f"V{case.V}",
                   flags=(("h0", case.h0), ("l2", case.l2)))


def op_backends(op, device):
    """The backends of gdn_packed.ops.BACKENDS[op] that can run on tensors of `device` on this machine
    (triton on CPU needs the interpreter, cuda needs the built extension and CUDA tensors)."""
    from gdn_packed.ops import BACKENDS
    from gdn_packed.ops._common import backend_usable
    return [b for b in BACKENDS[op] if backend_usable(b, torch.device(device))]


def backend_params(op, device):
    """pytest parameters, one per backend of gdn_packed.ops.BACKENDS[op]: those that cannot run on
    `device` tensors here (op_backends) are skipped with the reason, so a missing backend shows."""
    import pytest
    from gdn_packed.ops import BACKENDS
    here = op_backends(op, device)
    return [pytest.param(b, marks=pytest.mark.skipif(b not in here, reason=f"backend {b!r} cannot run on "
                                                     f"{torch.device(device).type} tensors here"))
            for b in BACKENDS[op]]


def gdr_inputs(rows, H, HV, K, V, dtype=torch.float32, *, N=None, batch=1, seed=0, device="cpu",
               initial_state=False, slow_decay=True, unit_k=True):
    """Random q, k, v, g, beta (and h0 [N, HV, K, V] float32) in the layout of docs/DESIGN.md section 3.
    g = logsigmoid(x + 2) (slow decay, the hard case for bf16) or logsigmoid(x). k has unit rows
    (the delta rule is stable for beta |k|^2 <= 2) unless unit_k=False, for kernels that l2-normalise
    k themselves."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = r(batch, rows, H, K), r(batch, rows, H, K)
    if unit_k:
        k = k / k.norm(dim=-1, keepdim=True)
    v = r(batch, rows, HV, V)
    g = F.logsigmoid(r(batch, rows, HV) + (2.0 if slow_decay else 0.0))
    beta = torch.rand(batch, rows, HV, generator=gen)
    h0 = r(N if N is not None else batch, HV, K, V) * 0.1 if initial_state else None
    out = [x.to(dtype).to(device) for x in (q, k, v)] + [g.float().to(device), beta.float().to(device)]
    return out + [None if h0 is None else h0.to(device)]


def cuda_forward_probe():
    """backend='cuda' of the chunked forward on one 64-token sequence (1 head, K = V = 128, bf16, no
    initial state), synchronized: the launch that hung on an H200 (2026-12-04). Run in a child process
    with a timeout (tests/test_cuda_chunk_gpu.py, tools/gpu_check.py's sanitizer step): a hung kernel
    holds the GPU until its process dies. Every forward kernel (gdn_packed.cuda.chunk.KERNELS: the fused
    one, the split one, and after Triton prep the state-only one)."""
    from gdn_packed.cuda.chunk import KERNELS, chunk_gdr_fwd_cuda
    from gdn_packed.ops.chunk_table import make_chunk_table
    q, k, v, g, beta = (t.cuda() for t in gdr_inputs(64, 1, 1, 128, 128, torch.bfloat16, N=1, seed=0)[:5])
    cu = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    table, cc = make_chunk_table(cu, None, 64, 64)
    for kernel in KERNELS:
        o, ht = torch.empty_like(v[0]), torch.empty(1, 1, 128, 128, device="cuda")
        chunk_gdr_fwd_cuda(q[0], k[0], v[0], g[0], beta[0], table, cc, None, 128 ** -0.5, 64, False, o, ht,
                           kernel=kernel)
        torch.cuda.synchronize()


def reference_gdr(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                  cu_seqlens_padded=None, use_qk_l2norm_in_kernel=False):
    """The float64 per-token recurrence run per sequence, unpacked, on exactly these inputs.
    Returns (o float64 with exact zeros on padding rows, final_state float64 [N, HV, K, V]).
    Differentiable (autograd gives the reference gradients)."""
    kw = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if cu_seqlens is None:
        return naive_recurrent_gdr(q, k, v, g, beta, initial_state=initial_state, **kw)
    cu = cu_seqlens.tolist()
    pad = cu if cu_seqlens_padded is None else cu_seqlens_padded.tolist()
    T = q.shape[1]
    pieces, states, pos = [], [], 0
    zeros = lambda n: v.new_zeros(1, n, *v.shape[2:], dtype=torch.float64)  # noqa: E731
    for i in range(len(cu) - 1):
        s, n = pad[i], cu[i + 1] - cu[i]
        pieces.append(zeros(s - pos))
        h0 = None if initial_state is None else initial_state[i: i + 1]
        o, st = naive_recurrent_gdr(q[:, s:s + n], k[:, s:s + n], v[:, s:s + n], g[:, s:s + n],
                                    beta[:, s:s + n], initial_state=h0, **kw)
        pieces.append(o)
        states.append(st)
        pos = s + n
    pieces.append(zeros(T - pos))
    HV, K, Vd = v.shape[2], q.shape[3], v.shape[3]
    final = torch.cat(states) if states else v.new_zeros(0, HV, K, Vd, dtype=torch.float64)
    return torch.cat(pieces, dim=1), final


_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_trapped = ContextVar("gdn_packed_no_host_sync", default=False)
_traps = {"users": 0, "saved": {}, "lock": threading.Lock()}


def _trap(name, original):
    def f(self, *a, **kw):
        if _trapped.get():
            raise AssertionError(f"host sync: Tensor.{name}() called on the hot path")
        return original(self, *a, **kw)
    return f


@contextmanager
def no_host_sync():
    """Raise if the code inside reads a tensor's values back to the host (.item(), .tolist(),
    .cpu(), .numpy(), bool()/int()/float() of a tensor): the CPU stand-in for
    torch.cuda.set_sync_debug_mode('error'). The ops run the schedule they use on CUDA tensors
    inside (gdn_packed._runtime.device_schedule): on CPU tensors the torch backend otherwise
    plans its loops from cu_seqlens read on the host, which costs nothing there. Both belong to the
    thread that enters the block: other threads read back and schedule as before."""
    from gdn_packed._runtime import device_schedule
    with _traps["lock"]:
        if _traps["users"] == 0:
            _traps["saved"] = {n: getattr(torch.Tensor, n) for n in _SYNC_METHODS}
            for n, fn in _traps["saved"].items():
                setattr(torch.Tensor, n, _trap(n, fn))
        _traps["users"] += 1
    token = _trapped.set(True)
    try:
        with device_schedule():
            yield
    finally:
        _trapped.reset(token)
        with _traps["lock"]:
            _traps["users"] -= 1
            if _traps["users"] == 0:
                for n, fn in _traps["saved"].items():
                    setattr(torch.Tensor, n, fn)
