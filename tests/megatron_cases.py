"""Megatron-dependent checks of gdn_packed.megatron, run by tests/test_megatron.py in subprocesses.

    python tests/megatron_cases.py CASE PORT     ->  last stdout line: RESULT {json}

Megatron on CPU needs a gloo process group, a patched torch.cuda.current_device, TORCHDYNAMO_DISABLE=1
and (for Megatron's own block, the oracle) fla-core under the Triton interpreter; all of that stays
inside this process. Cases (each returns measurements; the asserts live in test_megatron.py):
    oracle  Megatron's block vs ours, fp32 and bf16, on SBHD batch 2, THD, THD with alignment padding
    packed  ours alone in deterministic mode: packing, padding, run-to-run, host syncs, SBHD batches
    module  constructor/spec/checkpoint contract: init, sharded_state_dict, errors, spec helper,
            TransformerLayer integration (Megatron-LM main's keywords), zero-centred out_norm
    tp      TP=2 (+ sequence parallel, + zero-centred out_norm) over gloo, two CPU processes, vs TP=1
    cp      CP=2 over gloo, two CPU processes: ours vs ours at CP=1 and vs Megatron's block at CP=2
    cp_tp   CP=2 x TP=2 (+ sequence parallel) over gloo, four CPU processes, vs CP=1 x TP=1
"""
import contextlib
import json
import os
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"          # Megatron's jit_fuser is torch.compile
os.environ.setdefault("TRITON_INTERPRET", "1")   # fla-core (Megatron's kernels) on CPU
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HIDDEN, HK, HV, DK, DV, W = 128, 2, 4, 32, 32, 4
LENGTHS = [70, 1, 64, 65]            # THD: odd lengths, a 1-token sequence, a chunk edge
LENGTHS_PADDED = [70, 1, 64, 45]     # THD + cu_seqlens_q_padded, each padded to a multiple of 16
ALIGN = 16


def use_heads(hk, hv):
    """Set the GDN head counts of this process's configs and weights (the CP x TP case needs the key
    heads divisible by 4)."""
    global HK, HV
    HK, HV = hk, hv


def setup(port, rank=0, world_size=1):
    torch.cuda.current_device = lambda: torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)


def config(dtype=torch.float32, **kw):
    from megatron.core.transformer import TransformerConfig
    args = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=2 * HIDDEN,
        linear_conv_kernel_dim=W, linear_key_head_dim=DK, linear_value_head_dim=DV,
        linear_num_key_heads=HK, linear_num_value_heads=HV, normalization="RMSNorm",
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, activation_func=F.silu, add_bias_linear=False)
    return TransformerConfig(**{**args, **kw})


def local_submodules(out_norm=None):
    """The local (non-TE) GDN submodules: Megatron's local backend has no fused LN + linear."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    return GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=out_norm or LocalSpecProvider().layer_norm(rms_norm=True),
        out_proj=RowParallelLinear)


class PlainLayerNorm:
    """torch.nn.LayerNorm as an out_norm spec: a norm the block does not fuse with the gate."""

    def __new__(cls, config, hidden_size, eps):
        return torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)


class PlainRMSNorm:
    """torch.nn.RMSNorm as an out_norm spec. Megatron's local norm (WrappedTorchNorm) refuses
    config.sequence_parallel, and Transformer Engine's TENorm is not installable here."""

    def __new__(cls, config, hidden_size, eps):
        return torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)


def pgs(tp=None, cp=None):
    from megatron.core.process_groups_config import ProcessGroupCollection
    world = dist.group.WORLD
    return ProcessGroupCollection(tp=tp or world, cp=cp or world)


def build(cls, cfg, pg=None, out_norm=None, **kw):
    return cls(cfg, local_submodules(out_norm), layer_number=1, pg_collection=pg or pgs(), **kw)


def full_weights(seed=0, conv_bias=False):
    """Random full (TP=1) weights, keyed like the block's state_dict, float32."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    in_dim = 2 * HK * DK + 2 * HV * DV + 2 * HV
    conv_dim = 2 * HK * DK + HV * DV
    sd = {
        "dt_bias": 1.0 + 0.3 * r(HV),
        "A_log": torch.empty(HV).uniform_(1, 16, generator=gen).log(),
        "in_proj.weight": 0.08 * r(in_dim, HIDDEN),
        "conv1d.weight": 0.3 * r(conv_dim, 1, W),
        "out_norm.weight": 1.0 + 0.1 * r(DV),
        "out_proj.weight": 0.08 * r(HIDDEN, HV * DV),
    }
    if conv_bias:
        sd["conv1d.bias"] = 0.1 * r(conv_dim)
    return sd


def load(block, sd):
    own = block.state_dict()
    block.load_state_dict({k: (sd[k].to(own[k].dtype) if k in sd else own[k]) for k in own},
                          strict=True)


def layout(lengths, align=None):
    """cu_seqlens, cu_seqlens_padded (None without align), total rows, real-row mask."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if align is None:
        pad = cu
    else:
        pad = [0]
        for n in lengths:
            pad.append(pad[-1] + -(-n // align) * align)
    real = torch.zeros(pad[-1], dtype=torch.bool)
    for i, n in enumerate(lengths):
        real[pad[i]: pad[i] + n] = True
    cu_t = torch.tensor(cu, dtype=torch.int32)
    pad_t = None if align is None else torch.tensor(pad, dtype=torch.int32)
    return cu_t, pad_t, pad[-1], real


def thd_params(cu, cu_padded=None):
    from megatron.core.packed_seq_params import PackedSeqParams
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded)


def scenario(name, dtype, seed=1):
    """(x [s, b, HIDDEN], packed_seq_params or None, loss weights like the output, real-row mask
    [s, b] or None). Inputs are nonzero on padding rows too; loss weights are 0 there."""
    gen = torch.Generator().manual_seed(seed)
    if name == "sbhd_b2":
        x, psp, real = torch.randn(80, 2, HIDDEN, generator=gen), None, None
    else:
        cu, pad, rows, real = layout(LENGTHS if name == "thd" else LENGTHS_PADDED,
                                     None if name == "thd" else ALIGN)
        x, psp, real = torch.randn(rows, 1, HIDDEN, generator=gen), thd_params(cu, pad), real[:, None]
    wts = torch.randn(x.shape, generator=gen)
    if real is not None:
        wts = wts * real[..., None]
    return x.to(dtype), psp, wts, real


def fwd_bwd(block, x, psp, wts):
    """out [s, b, h], input grad, {param: grad} of loss = sum(out * wts) (float32 sum)."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out, bias = block(x, None, packed_seq_params=psp)
    assert bias is None
    (out.float() * wts).sum().backward()
    return out.detach(), x.grad, {n: p.grad.detach().clone() for n, p in block.named_parameters()}


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    n = b.norm().item()
    return (a - b).norm().item() / n if n > 0 else (a - b).norm().item()


def on_real(t, real):
    return t if real is None else t[real]


# ------------------------------------------------------------------------------------------------
def case_oracle():
    """Megatron's block (fla-core under the interpreter) vs ours, ours loaded strictly from
    Megatron's state_dict, both also measured against ours in float64 (the reference: our torch
    kernels and Megatron's linears run in float64 on the same weights).
    fp32 on SBHD batch 2, THD and THD + cu_seqlens_q_padded; bf16 on THD + padding, where the
    reference runs on the bf16-rounded weights and inputs."""
    import triton_shim  # noqa: F401
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN

    from gdn_packed.megatron import GatedDeltaNet
    res = {}

    def pair(dtype, sd):
        meg = build(MegatronGDN, config(dtype))
        load(meg, sd)
        ours = build(GatedDeltaNet, config(dtype))
        ours.load_state_dict(meg.state_dict(), strict=True)
        ref = build(GatedDeltaNet, config(torch.float64))
        load(ref, {k: v.double() for k, v in meg.state_dict().items() if torch.is_tensor(v)})
        return meg, ours, ref

    def errs(result, ref, real):
        out, dx, g = result[:3]
        return dict(out=rel(on_real(out, real), on_real(ref[0], real)),
                    dx=rel(on_real(dx, real), on_real(ref[1], real)),
                    grads={n: rel(g[n], ref[2][n]) for n in ref[2]})

    def gated_run(block, x, psp, wts):
        """fwd_bwd of one of our blocks, plus the per-token gradients of the raw gate inputs a and b
        (the in_proj output columns that the op turns into g and beta)."""
        store = {}

        def keep_grad(module, args, output):
            output[0].register_hook(lambda grad: store.update(grad=grad))
        handle = block.in_proj.register_forward_hook(keep_grad)
        out, dx, grads = fwd_bwd(block, x, psp, wts)
        handle.remove()
        hv = block.num_v_heads_local_tp
        db, da = store["grad"][..., -2 * hv:].split(hv, dim=-1)  # [S, B, hv] each
        return out, dx, grads, {"a": da, "b": db}

    def gate_errs(result, ref, real):
        """Per-token da and db against float64 (real rows)."""
        return {n: rel(on_real(result[3][n], real), on_real(ref[3][n], real)) for n in ("a", "b")}

    meg, ours, ref = pair(torch.float32, full_weights())
    for name in ("sbhd_b2", "thd", "thd_padded"):
        x, psp, wts, real = scenario(name, torch.float32)
        m, o, r = (fwd_bwd(meg, x, psp, wts), gated_run(ours, x, psp, wts),
                   gated_run(ref, x.double(), psp, wts))
        res[f"fp32_{name}"] = dict(vs_megatron=errs(o, m, real), ours_vs_fp64=errs(o, r, real),
                                   megatron_vs_fp64=errs(m, r, real),
                                   ours_gate_grads_vs_fp64=gate_errs(o, r, real))
        if real is not None:
            pad = ~real
            res[f"fp32_{name}"].update(
                pad_rows=int(pad.sum()),
                ours_pad_out_absmax=o[0][pad].abs().max().item() if pad.any() else 0.0,
                ours_pad_dx_absmax=o[1][pad].abs().max().item() if pad.any() else 0.0,
                megatron_pad_out_absmax=m[0][pad].abs().max().item() if pad.any() else 0.0)

    meg, ours, ref = pair(torch.bfloat16, full_weights())
    x, psp, wts, real = scenario("thd_padded", torch.bfloat16)
    m, o, r = fwd_bwd(meg, x, psp, wts), gated_run(ours, x, psp, wts), gated_run(ref, x.double(), psp, wts)
    res["bf16_thd_padded"] = dict(ours_vs_fp64=errs(o, r, real), megatron_vs_fp64=errs(m, r, real),
                                  ours_gate_grads_vs_fp64=gate_errs(o, r, real),
                                  ours_pad_out_absmax=o[0][~real].abs().max().item())
    return res


def case_packed():
    """Ours alone, config.deterministic_mode=True: packed THD (with alignment padding, a zero-length
    sequence and a padding tail) equals each sequence run alone, bit for bit; outputs and gradients
    are bit-identical run to run; the forward+backward does no host sync; NaN in the padding rows of
    the input changes no real row and no parameter gradient; SBHD batch 3 equals its rows run one by
    one. fla-core and causal-conv1d are made unimportable first.

    Two schedules of the torch backend are checked (gdn_packed/torch_ref/chunk.py): the CPU one
    (chunks planned from cu_seqlens read on the host) and, inside no_host_sync, the one of CUDA
    tensors. They round differently by design (32- vs 64-row chunks), so run to run and packed vs
    alone are compared within each schedule.

    Bitwise packing needs sequences of >= 12 tokens: MKL's GEMM in Megatron's linear layers takes
    another path for 1-11 rows (not row-invariant in the last bit; our kernels are), so sequences
    that short are compared with a tolerance instead."""
    for name in ("fla", "causal_conv1d"):  # the block must run without them: make them unimportable
        sys.modules[name] = None
    from gdn_packed.megatron import GatedDeltaNet
    from gdn_packed.ops._common import device_schedule
    from gdn_packed.testing import no_host_sync
    res = {}
    ours = build(GatedDeltaNet, config(deterministic_mode=True), conv_bias=True)
    load(ours, full_weights(conv_bias=True))
    gen = torch.Generator().manual_seed(3)

    for tag, lengths in (("", [70, 12, 0, 64, 45]), ("short_", [70, 1, 0, 5, 45])):
        tail = 7
        cu, pad, rows, real = layout(lengths, ALIGN)
        rows += tail
        real = torch.cat([real, torch.zeros(tail, dtype=torch.bool)])
        x = torch.randn(rows, 1, HIDDEN, generator=gen)
        wts = torch.randn(x.shape, generator=gen)
        psp = thd_params(cu, pad)
        with no_host_sync():
            device_run = fwd_bwd(ours, x, psp, wts)
        res[tag + "host_sync_free"] = True
        with device_schedule():
            device_again = fwd_bwd(ours, x, psp, wts)
        host_run, host_again = fwd_bwd(ours, x, psp, wts), fwd_bwd(ours, x, psp, wts)
        res[tag + "run_to_run_bitwise"] = (_bitwise(device_run, device_again)
                                           and _bitwise(host_run, host_again))
        runs = (host_run, device_run)
        res[tag + "pad_out_zero"] = all(bool((out[~real] == 0).all()) for out, _, _ in runs)
        res[tag + "pad_dx_zero"] = all(bool((dx[~real] == 0).all()) for _, dx, _ in runs)
        res[tag + "finite"] = all(bool(torch.isfinite(out).all() and torch.isfinite(dx).all())
                                  for out, dx, _ in runs)

        # each sequence alone, as a one-sequence THD batch without padding, in either schedule
        alone = {}
        for sched, (out, dx, grads) in zip(("host", "device"), runs):
            with device_schedule() if sched == "device" else contextlib.nullcontext():
                alone[sched] = _alone(ours, x, wts, lengths, pad, out, dx, grads)
        pairs = [(run, alone[sched]) for sched, run in zip(("host", "device"), runs)]
        res[tag + "packed_vs_alone_out_bitwise"] = all(torch.equal(p[0][real], a[0][real]) for p, a in pairs)
        res[tag + "packed_vs_alone_dx_bitwise"] = all(torch.equal(p[1][real], a[1][real]) for p, a in pairs)
        res[tag + "packed_vs_alone_out_rel"] = max(rel(p[0][real], a[0][real]) for p, a in pairs)
        res[tag + "packed_vs_alone_dx_rel"] = max(rel(p[1][real], a[1][real]) for p, a in pairs)
        # parameter gradients are sums over tokens: same terms, another summation order
        res[tag + "packed_vs_alone_grads_rel"] = max(rel(p[2][n], a[2][n]) for p, a in pairs for n in p[2])

    res.update(_nan_padding(gen))

    # SBHD batch 3 == each batch row alone
    xb = torch.randn(50, 3, HIDDEN, generator=gen)
    wb = torch.randn(xb.shape, generator=gen)
    ob, db, _ = fwd_bwd(ours, xb, None, wb)
    rows_out = [fwd_bwd(ours, xb[:, j:j + 1], None, wb[:, j:j + 1]) for j in range(3)]
    res["sbhd_b3_vs_rows_out_rel"] = max(rel(ob[:, j:j + 1], rows_out[j][0]) for j in range(3))
    res["sbhd_b3_vs_rows_dx_rel"] = max(rel(db[:, j:j + 1], rows_out[j][1]) for j in range(3))
    # one SBHD row == the same sequence as THD
    ot, _, _ = fwd_bwd(ours, xb[:, :1], thd_params(torch.tensor([0, 50], dtype=torch.int32)),
                       wb[:, :1])
    res["sbhd_vs_thd_out_bitwise"] = torch.equal(rows_out[0][0], ot)
    res["float64_ops"] = _float64_ops(ours, xb, wb)
    res["ran_without_fla_and_causal_conv1d"] = not any(
        m.split(".")[0] in ("fla", "causal_conv1d") and mod is not None for m, mod in sys.modules.items())
    return res


def _bitwise(a, b):
    """Two fwd_bwd results (out, dx, {param: grad}) are bit-identical."""
    return (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            and all(torch.equal(a[2][n], b[2][n]) for n in a[2]))


def _alone(block, x, wts, lengths, pad, out, dx, grads):
    """(out, dx, summed param grads) of every sequence run alone as a one-sequence THD batch,
    placed at its storage rows (zeros elsewhere); shaped like the packed run's out, dx, grads."""
    alone_out, alone_dx = torch.zeros_like(out), torch.zeros_like(dx)
    alone_grads = {n: torch.zeros_like(g) for n, g in grads.items()}
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        s = int(pad[i])
        o, d, g = fwd_bwd(block, x[s:s + n], thd_params(torch.tensor([0, n], dtype=torch.int32)),
                          wts[s:s + n])
        alone_out[s:s + n], alone_dx[s:s + n] = o, d
        for k in g:
            alone_grads[k] += g[k]
    return alone_out, alone_dx, alone_grads


def _nan_padding(gen):
    """NaN in the padding rows (alignment gaps and a tail) of the block input, with the fused
    gated-RMSNorm out_norm and with an out_norm that is not fused (LayerNorm): every real row's
    output and input gradient and every parameter gradient is bit-identical to the clean run
    (so finite), padding rows of the output and input gradient are 0."""
    from gdn_packed.megatron import GatedDeltaNet
    res = {}
    cu, pad, rows, real = layout([70, 12, 0, 64, 45], ALIGN)
    real = torch.cat([real, torch.zeros(7, dtype=torch.bool)])
    x = torch.randn(real.shape[0], 1, HIDDEN, generator=gen)
    wts = torch.randn(x.shape, generator=gen)
    poisoned = x.masked_fill(~real[:, None, None], float("nan"))
    psp = thd_params(cu, pad)
    for tag, norm in (("fused", None), ("unfused", PlainLayerNorm)):
        block = build(GatedDeltaNet, config(), out_norm=norm, conv_bias=True)
        load(block, full_weights(conv_bias=True))
        (o, d, g), (po, pd, pg) = fwd_bwd(block, x, psp, wts), fwd_bwd(block, poisoned, psp, wts)
        res[f"nan_pad_{tag}_norm_fused"] = block.out_norm_fused
        res[f"nan_pad_{tag}_real_rows_bitwise"] = (torch.equal(po[real], o[real])
                                                  and torch.equal(pd[real], d[real]))
        res[f"nan_pad_{tag}_pad_rows_zero"] = bool((po[~real] == 0).all() and (pd[~real] == 0).all())
        res[f"nan_pad_{tag}_grads_finite"] = all(bool(torch.isfinite(t).all()) for t in pg.values())
        res[f"nan_pad_{tag}_grads_bitwise"] = all(torch.equal(pg[n], g[n]) for n in g)
    return res


def _float64_ops(block, x, wts):
    """Names of the ops of one fp32 forward+backward of `block` that take or make a float64 tensor
    (recorded at the dispatcher: the block's own ops, Megatron's linears, our custom ops' calls),
    and whether the backward was seen at all."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.f64, self.names = set(), set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.names.add(str(func))
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64
                   for t in tree_leaves((args, kwargs, out))):
                self.f64.add(str(func))
            return out
    log = Log()
    with log:
        fwd_bwd(block, x, None, wts)
    return {"float64": sorted(log.f64),
            "saw_backward": any("chunk_gdr_bwd" in n for n in log.names)}


class _FakeGroup:
    """A stand-in process group of a given size (for the CP refusal check)."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def case_module():
    """Construction contract: parameters, seeded init, state_dict and sharded_state_dict identical to
    Megatron's; clear errors for CP > 1, batch > 1 THD and non-SiLU configs; the spec helper."""
    import contextlib

    import megatron.core.ssm.gated_delta_net.common as meg_common
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN

    import gdn_packed.megatron.gdn as ours_mod
    from gdn_packed.megatron import GatedDeltaNet, use_packed_gdn
    res = {}

    # seeded initialisation (perform_initialization=True); the CUDA RNG tracker has no CPU state,
    # so both blocks draw from the CPU generator through a pass-through tracker
    class _CpuTracker:
        def fork(self, *a, **kw):
            return contextlib.nullcontext()
    meg_common.get_cuda_rng_tracker = ours_mod.get_cuda_rng_tracker = lambda *a, **kw: _CpuTracker()
    sds = {}
    for cls in (MegatronGDN, GatedDeltaNet):
        torch.manual_seed(123)
        m = build(cls, config(perform_initialization=True), conv_init=0.2, conv_bias=True,
                  A_init_range=(2, 8))
        sds[cls.__module__] = (m.state_dict(), [(n, tuple(p.shape), p.dtype) for n, p in
                                                m.named_parameters()], m)
    (msd, mparams, meg), (osd, oparams, ours) = sds.values()
    res["param_names_shapes_dtypes_equal"] = mparams == oparams
    res["state_dict_keys_equal"] = list(msd) == list(osd)
    res["seeded_init_bitwise"] = all(
        torch.equal(msd[k], osd[k]) if torch.is_tensor(msd[k]) else msd[k] == osd[k] for k in msd)
    res["state_dict_keys"] = list(osd)
    res["tp_attrs_equal"] = all(
        getattr(pm, a, None) == getattr(po, a, None)
        for (_, pm), (_, po) in zip(meg.named_parameters(), ours.named_parameters())
        for a in ("tensor_model_parallel", "partition_dim"))

    # sharded_state_dict: same keys and the same sharded tensors after the factories are built
    res["sharded_state_dict_equal"] = _sharded_view(meg) == _sharded_view(ours)
    res["sharded_keys"] = sorted(_sharded_view(ours))

    # errors
    err = _err
    res["gelu_error"] = err(lambda: build(GatedDeltaNet, config(activation_func=F.gelu)))
    res["unknown_keyword_error"] = err(lambda: build(GatedDeltaNet, config(), bogus_option=1))
    res["heads_tp_cp_error"] = err(lambda: build(GatedDeltaNet, config(), pgs(cp=_FakeGroup(4))))
    one_seq = thd_params(torch.tensor([0, 10], dtype=torch.int32))
    res["thd_batch2_error"] = err(lambda: ours(torch.randn(10, 2, HIDDEN), None,
                                               packed_seq_params=one_seq))
    res.update(_cu_seqlens_kv_errors(ours))
    res.update(_cp_layout_errors())

    # spec helper: Megatron's own spec builders with our block in place of theirs
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from gdn_packed.megatron import get_hybrid_stack_spec
    hybrid = get_hybrid_stack_spec()
    res["hybrid_spec_module"] = hybrid.submodules.gdn_layer.submodules.self_attention.module.__module__
    res["hybrid_spec_original_untouched"] = (
        hybrid_stack_spec.submodules.gdn_layer.submodules.self_attention.module is MegatronGDN)
    from megatron.core.models.backends import LocalSpecProvider
    # (without Transformer Engine installed, Megatron's default backend choice fails: pass one)
    gdn_spec = use_packed_gdn(get_gated_delta_net_module_spec(config(), LocalSpecProvider()))
    res["gdn_spec_module"] = gdn_spec.module.__module__
    res["gdn_spec_metainfo"] = gdn_spec.metainfo
    mlp_only = hybrid.submodules.mlp_layer
    res["no_gdn_spec_returned_equal"] = use_packed_gdn(mlp_only) == mlp_only
    res["no_gdn_strict_error"] = err(lambda: use_packed_gdn(mlp_only, strict=True))

    # integration: a Megatron TransformerLayer built from a spec with our block, THD input
    res.update(_transformer_layer_run())
    res.update(_zero_centered_out_norm())
    return res


def _err(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _cu_seqlens_kv_errors(block):
    """cu_seqlens_kv (or its padded form) different from cu_seqlens_q: a ValueError, as Megatron
    asserts; the same values in another tensor are accepted."""
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    x = torch.randn(10, 1, HIDDEN)

    def run(**kw):
        return block(x, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, **kw))
    return {"kv_values_error": _err(lambda: run(cu_seqlens_kv=torch.tensor([0, 5, 10], dtype=torch.int32))),
            "kv_shape_error": _err(lambda: run(cu_seqlens_kv=torch.tensor([0, 10], dtype=torch.int32))),
            "kv_padded_error": _err(lambda: run(cu_seqlens_q_padded=cu, cu_seqlens_kv=cu,
                                                cu_seqlens_kv_padded=torch.tensor([0, 8, 10], dtype=torch.int32))),
            "kv_equal_copy_ok": _err(lambda: run(cu_seqlens_kv=cu.clone().long())) is None}


def _cp_layout_errors():
    """Layout errors under context parallelism, raised before any communication (a stand-in CP group
    of size 2): SBHD length not a multiple of 2 x cp (a shape check, always), THD storage lengths
    not multiples of 2 x cp or offsets not spanning the input (value checks, when validating)."""
    from gdn_packed.megatron import GatedDeltaNet
    block = build(GatedDeltaNet, config(), pgs(cp=_FakeGroup(2)))
    load(block, full_weights())
    res = {"sbhd_cp_length_error": _err(lambda: block(torch.randn(7, 2, HIDDEN), None))}
    os.environ["GDN_PACKED_VALIDATE"] = "1"
    try:
        bad_len = thd_params(torch.tensor([0, 6, 16], dtype=torch.int32))          # 6 % 4 != 0
        res["thd_cp_length_error"] = _err(lambda: block(torch.randn(8, 1, HIDDEN), None,
                                                        packed_seq_params=bad_len))
        short = thd_params(torch.tensor([0, 8], dtype=torch.int32))                # spans 8 of 16
        res["thd_cp_total_error"] = _err(lambda: block(torch.randn(8, 1, HIDDEN), None,
                                                       packed_seq_params=short))
    finally:
        del os.environ["GDN_PACKED_VALIDATE"]
    return res


class TERMSNorm(torch.nn.Module):
    """Stand-in for Transformer Engine's RMSNorm (CUDA only, not installable here), built the way
    Megatron's TENorm builds it: same class name and module path, the attributes the block reads
    (weight, eps, zero_centered_gamma) and its formula y = x / rms(x) * w, w = 1 + weight when
    config.layernorm_zero_centered_gamma, in plain torch. Its forward is the unfused path."""

    def __init__(self, config, hidden_size, eps):
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        xf = x.float()
        w = self.weight.float() + 1 if self.zero_centered_gamma else self.weight.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)


TERMSNorm.__name__ = TERMSNorm.__qualname__ = "RMSNorm"
TERMSNorm.__module__ = "transformer_engine.pytorch.module.rmsnorm"


def zero_centered(sd):
    """The same weights for a zero-centred out_norm (its scale is 1 + weight)."""
    return {**sd, "out_norm.weight": sd["out_norm.weight"] - 1}


def _zero_centered_out_norm():
    """Qwen3.5's out_norm (layernorm_zero_centered_gamma=True, TE RMSNorm): the fused path is taken
    (the out_norm module is never called) and gives the outputs and gradients of the unfused path
    (out_norm(o) * silu(z), forced) and of the plain norm with weight 1 + weight."""
    import gdn_packed.megatron.gdn as ours_mod
    from gdn_packed.megatron import GatedDeltaNet
    sd = full_weights(conv_bias=True)
    x, psp, wts, real = scenario("thd_padded", torch.float32)
    zc = build(GatedDeltaNet, config(layernorm_zero_centered_gamma=True), out_norm=TERMSNorm, conv_bias=True)
    load(zc, zero_centered(sd))
    fused = fwd_bwd(zc, x, psp, wts)
    res = {"zc_out_norm_fused": zc.out_norm_fused, "zc_out_norm_calls_fused": zc.out_norm.calls}
    kind = ours_mod.fused_rmsnorm_kind
    ours_mod.fused_rmsnorm_kind = lambda norm: None
    try:
        unfused = fwd_bwd(zc, x, psp, wts)
    finally:
        ours_mod.fused_rmsnorm_kind = kind
    res["zc_out_norm_calls_unfused"] = zc.out_norm.calls
    plain = build(GatedDeltaNet, config(), conv_bias=True)
    load(plain, sd)
    plain_run = fwd_bwd(plain, x, psp, wts)
    for tag, other in (("unfused", unfused), ("plain", plain_run)):
        res[f"zc_vs_{tag}"] = {"out": rel(fused[0][real], other[0][real]), "dx": rel(fused[1][real], other[1][real]),
                               **{n: rel(fused[2][n], other[2][n]) for n in fused[2]}}
    res["zc_pad_out_zero"] = bool((fused[0][~real] == 0).all())
    return res


def _sharded_view(block):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    out = {}
    sharded = block.sharded_state_dict(prefix="layer.", metadata={"dp_cp_group": dist.group.WORLD})
    for key, t in sharded.items():
        items = t.build() if isinstance(t, ShardedTensorFactory) else [t]
        for sh in items:
            out[sh.key] = (type(sh).__name__, tuple(sh.global_shape), tuple(sh.global_offset),
                           tuple(getattr(sh, "local_shape", ())),
                           tuple(getattr(sh, "axis_fragmentations", ())), str(sh.replica_id),
                           str(getattr(sh, "dtype", "")))
    return out


def _transformer_layer_run():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from gdn_packed.megatron import GatedDeltaNet
    from megatron.core.models.backends import LocalSpecProvider
    cfg = config(hidden_dropout=0.0)
    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=LocalSpecProvider().layer_norm(rms_norm=True),
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=local_submodules()),
        self_attn_bda=get_bias_dropout_add))
    # the keywords Megatron-LM main's HybridStack passes when it builds a GDN layer
    # (megatron/core/models/hybrid/hybrid_block.py); TransformerLayer hands pp_layer_offset on
    layer = build_module(spec, config=cfg, layer_number=3, pg_collection=pgs(), add_layer_offset=False,
                         pp_layer_offset=2, name="decoder.layers.0")
    load(layer.self_attention, full_weights())   # (perform_initialization=False leaves them empty)
    with torch.no_grad():
        layer.input_layernorm.weight.fill_(1.0)
    cu, pad, rows, real = layout(LENGTHS_PADDED, ALIGN)
    x = torch.randn(rows, 1, HIDDEN, requires_grad=True)
    out = layer(x, attention_mask=None, packed_seq_params=thd_params(cu, pad))
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    # residual stream: padding rows pass through unchanged (our block adds exactly 0 there)
    return {"layer_pp_layer_offset": layer.self_attention.pp_layer_offset,
            "layer_number": layer.self_attention.layer_number,
            "layer_out_shape": list(out.shape),
            "layer_pad_rows_are_residual": torch.equal(out[~real], x[~real].detach()),
            "layer_grad_finite": bool(torch.isfinite(x.grad).all())}


# ------------------------------------------------------------------------------------------------
def _shard(sd, rank, tp):
    """Rank `rank`'s TP shard of full weights: per-section split of in_proj and conv1d (as
    Megatron's ColumnParallelLinear lays out [q k v z b a] per rank), dim-0 split of A_log/dt_bias,
    input-dim split of out_proj; out_norm replicated."""
    def part(t, dim=0):
        n = t.shape[dim] // tp
        return t.narrow(dim, rank * n, n)
    qk, v, hv = HK * DK, HV * DV, HV
    sec = lambda t, sizes: torch.cat([part(p) for p in torch.split(t, sizes)])  # noqa: E731
    out = {"dt_bias": part(sd["dt_bias"]), "A_log": part(sd["A_log"]),
           "in_proj.weight": sec(sd["in_proj.weight"], [qk, qk, v, v, hv, hv]),
           "conv1d.weight": sec(sd["conv1d.weight"], [qk, qk, v]),
           "out_norm.weight": sd["out_norm.weight"], "out_proj.weight": part(sd["out_proj.weight"], 1)}
    if "conv1d.bias" in sd:
        out["conv1d.bias"] = sec(sd["conv1d.bias"], [qk, qk, v])
    return out


def _tp_worker(rank, port, path):
    """One of two ranks: TP=1 (a one-rank group) and TP=2 of our block on the same weights and
    input: plain out_norm, plain + sequence parallel, and a zero-centred TE RMSNorm out_norm
    (Qwen3.5) without SP; rank 0 gathers the TP=2 results and writes the comparison to `path`."""
    setup(port, rank, 2)
    from megatron.core import parallel_state
    parallel_state._set_global_memory_buffer()  # the SP all-gather buffer of the parallel linears

    from gdn_packed.megatron import GatedDeltaNet
    solo = [dist.new_group([r]) for r in range(2)][rank]
    x, psp, wts, real = scenario("thd_padded", torch.float32)
    rows = x.shape[0]
    res = {}
    for key, sp, norm, sd, kw in (
            ("tp2", False, PlainRMSNorm, full_weights(conv_bias=True), {}),
            ("tp2_sp", True, PlainRMSNorm, full_weights(conv_bias=True), {}),
            ("tp2_zero_centered", False, TERMSNorm, zero_centered(full_weights(conv_bias=True)),
             dict(layernorm_zero_centered_gamma=True))):
        ref = build(GatedDeltaNet, config(**kw), pgs(tp=solo, cp=solo), norm, conv_bias=True)
        load(ref, sd)
        r_out, r_dx, r_g = fwd_bwd(ref, x, psp, wts)
        tp = build(GatedDeltaNet, config(tensor_model_parallel_size=2, sequence_parallel=sp, **kw),
                   pgs(cp=solo), norm, conv_bias=True)
        load(tp, _shard(sd, rank, 2))
        if sp:  # sequence parallel: each rank holds a contiguous slice of the rows
            n = rows // 2
            xs, ws = x[rank * n:(rank + 1) * n], wts[rank * n:(rank + 1) * n]
        else:
            xs, ws = x, wts
        out, dx, grads = fwd_bwd(tp, xs, psp, ws)
        if sp:
            out, dx = _gather_rows(out), _gather_rows(dx)
        # every rank's shard of every gradient, reassembled into full-size tensors
        full = {}
        for name, g in grads.items():
            parts = [torch.empty_like(g) for _ in range(2)]
            dist.all_gather(parts, g.contiguous())
            full[name] = parts
        if rank == 0:
            shards = [_shard(r_g, r, 2) for r in range(2)]
            res[key] = dict(out=rel(out, r_out), dx=rel(dx, r_dx),
                            grads={n: max(rel(full[n][r], shards[r][n]) for r in range(2))
                                   for n in full if n != "out_norm.weight"},
                            out_norm_grad=rel(full["out_norm.weight"][0], r_g["out_norm.weight"]),
                            out_norm_grad_same_on_ranks=torch.equal(*full["out_norm.weight"]),
                            out_norm_fused=tp.out_norm_fused,
                            pad_out_zero=bool((out[~real] == 0).all()))
    _finish(rank, path, res)


def _finish(rank, path, res):
    if rank == 0:
        with open(path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def _gather_rows(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


# --- context parallelism -------------------------------------------------------------------------
def cp_scenario(name):
    """(x, packed_seq_params or None, loss weights, real-row mask or None, storage offsets) for the
    CP checks: "thd_padded_tail" is THD with cu_seqlens_q_padded (lengths 70, 1, 64, 45 each padded
    to a multiple of 16) and a 16-row pad tail (a last sequence of 0 real tokens: Megatron needs
    the storage offsets to span every row); "sbhd_b2" is SBHD, 80 rows x batch 2."""
    if name == "sbhd_b2":
        x, psp, wts, real = scenario("sbhd_b2", torch.float32)
        return x, psp, wts, real, [0, x.shape[0]]
    cu, pad, rows, real = layout(LENGTHS_PADDED, ALIGN)
    cu = torch.cat([cu, cu[-1:]])
    pad = torch.cat([pad, pad[-1:] + ALIGN])
    real = torch.cat([real, torch.zeros(ALIGN, dtype=torch.bool)])
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows + ALIGN, 1, HIDDEN, generator=gen)
    wts = torch.randn(x.shape, generator=gen) * real[:, None, None]
    return x, thd_params(cu, pad), wts, real[:, None], pad.tolist()


def cp_rows(offsets, cp, rank):
    """The rows (natural order) that CP rank `rank` holds, in its local order: of every sequence's
    storage segment, chunks `rank` and 2 cp - 1 - `rank` of its 2 cp equal chunks (Megatron's
    attention load balancing), sequence after sequence."""
    rows = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        n = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            rows.extend(range(start + c * n, start + (c + 1) * n))
    return torch.tensor(rows, dtype=torch.long)


def run_sharded(block, x, psp, wts, rows, group_world):
    """fwd_bwd of `block` on this rank's `rows` of x; returns the output and input gradient
    reassembled in natural order from every rank (ranks holding the same rows agree), and the
    parameter gradients as this rank computed them."""
    out, dx, grads = fwd_bwd(block, x[rows], psp, wts[rows])
    ids = [torch.empty_like(rows) for _ in range(group_world)]
    dist.all_gather(ids, rows)
    full = []
    for t in (out, dx):
        parts = [torch.empty_like(t) for _ in range(group_world)]
        dist.all_gather(parts, t.contiguous())
        whole = torch.full((x.shape[0],) + tuple(t.shape[1:]), float("nan"), dtype=t.dtype)
        for i, part in zip(ids, parts):
            whole[i] = part
        full.append(whole)
    return full[0], full[1], grads


def _summed(grads, group):
    """Parameter gradients summed over `group` (what Megatron's DDP does over the CP ranks)."""
    out = {}
    for n, g in grads.items():
        g = g.clone()
        dist.all_reduce(g, group=group)
        out[n] = g
    return out


def _cp_worker(rank, port, path):
    """One of two ranks. On THD with cu_seqlens_q_padded and a pad tail, and on SBHD batch 2: ours at
    CP=2 against ours at CP=1 (each rank runs it whole) and against Megatron's block at CP=2 (fla-core
    under the interpreter) on the same weights and inputs, plus ours in float64 at CP=1 for the
    A_log / dt_bias gradients. Parameter gradients are summed over the CP ranks."""
    setup(port, rank, 2)
    import triton_shim  # noqa: F401
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN

    from gdn_packed.megatron import GatedDeltaNet
    solo = [dist.new_group([r]) for r in range(2)][rank]
    world = dist.group.WORLD
    sd = full_weights(conv_bias=True)
    res = {}
    for name in ("thd_padded_tail", "sbhd_b2"):
        x, psp, wts, real, offsets = cp_scenario(name)
        rows = cp_rows(offsets, 2, rank)
        one = build(GatedDeltaNet, config(), pgs(tp=solo, cp=solo), conv_bias=True)
        load(one, sd)
        r_out, r_dx, r_g = fwd_bwd(one, x, psp, wts)
        f64 = build(GatedDeltaNet, config(torch.float64), pgs(tp=solo, cp=solo), conv_bias=True)
        load(f64, {k: v.double() for k, v in sd.items()})
        d_out, d_dx, d_g = fwd_bwd(f64, x.double(), psp, wts)
        runs = {}
        for tag, cls in (("ours", GatedDeltaNet), ("megatron", MegatronGDN)):
            blk = build(cls, config(), pgs(tp=solo, cp=world), conv_bias=True)
            load(blk, sd)
            out, dx, grads = run_sharded(blk, x, psp, wts, rows, 2)
            runs[tag] = (out, dx, _summed(grads, world))
        if rank:
            continue
        (o_out, o_dx, o_g), (m_out, m_dx, m_g) = runs["ours"], runs["megatron"]
        r = res[name] = {}
        r["cp2_vs_cp1"] = dict(out=rel(on_real(o_out, real), on_real(r_out, real)),
                               dx=rel(on_real(o_dx, real), on_real(r_dx, real)),
                               grads={n: rel(o_g[n], r_g[n]) for n in r_g})
        r["cp2_vs_megatron_cp2"] = dict(out=rel(on_real(o_out, real), on_real(m_out, real)),
                                        dx=rel(on_real(o_dx, real), on_real(m_dx, real)),
                                        grads={n: rel(o_g[n], m_g[n]) for n in r_g})
        r["gate_param_grads_vs_fp64"] = {n: {"ours_cp2": rel(o_g[n], d_g[n]), "megatron_cp2": rel(m_g[n], d_g[n])}
                                         for n in ("A_log", "dt_bias")}
        r["finite"] = bool(torch.isfinite(on_real(o_out, real)).all() and torch.isfinite(on_real(o_dx, real)).all())
        if real is not None:
            r["pad_rows"] = int((~real).sum())
            r["pad_out_zero"] = bool((o_out[~real] == 0).all())
            r["pad_dx_zero"] = bool((o_dx[~real] == 0).all())
    _finish(rank, path, res)


def _cp_tp_worker(rank, port, path):
    """One of four ranks, CP=2 x TP=2 (TP groups {0,1}, {2,3}; CP groups {0,2}, {1,3}), without and
    with sequence parallelism, on THD with cu_seqlens_q_padded and a pad tail: ours against ours at
    CP=1 x TP=1 on the same weights and input. Gradients are summed over CP and compared shard by
    shard."""
    setup(port, rank, 4)
    use_heads(4, 8)
    from megatron.core import parallel_state
    parallel_state._set_global_memory_buffer()

    from gdn_packed.megatron import GatedDeltaNet
    solo = [dist.new_group([r]) for r in range(4)][rank]
    tp_group = [dist.new_group(g) for g in ([0, 1], [2, 3])][rank // 2]
    cp_group = [dist.new_group(g) for g in ([0, 2], [1, 3])][rank % 2]
    tp_rank, cp_rank = rank % 2, rank // 2
    sd = full_weights(conv_bias=True)
    x, psp, wts, real, offsets = cp_scenario("thd_padded_tail")
    one = build(GatedDeltaNet, config(), pgs(tp=solo, cp=solo), PlainRMSNorm, conv_bias=True)
    load(one, sd)
    r_out, r_dx, r_g = fwd_bwd(one, x, psp, wts)
    r_shard = _shard(r_g, tp_rank, 2)
    res = {}
    for sp in (False, True):
        blk = build(GatedDeltaNet, config(tensor_model_parallel_size=2, sequence_parallel=sp),
                    pgs(tp=tp_group, cp=cp_group), PlainRMSNorm, conv_bias=True)
        load(blk, _shard(sd, tp_rank, 2))
        rows = cp_rows(offsets, 2, cp_rank)
        if sp:  # then each TP rank holds a contiguous half of its CP rank's rows
            rows = rows.chunk(2)[tp_rank]
        out, dx, grads = run_sharded(blk, x, psp, wts, rows, 4)
        grads = _summed(grads, cp_group)
        errs = {n: rel(grads[n], r_shard[n]) for n in grads}
        all_errs = [None] * 4
        dist.all_gather_object(all_errs, errs)
        res["cp2_tp2_sp" if sp else "cp2_tp2"] = dict(
            out=rel(on_real(out, real), on_real(r_out, real)), dx=rel(on_real(dx, real), on_real(r_dx, real)),
            grads={n: max(e[n] for e in all_errs) for n in errs},
            pad_out_zero=bool((out[~real] == 0).all()), pad_dx_zero=bool((dx[~real] == 0).all()))
    _finish(rank, path, res)


def case_distributed(worker, nprocs, port):
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "result.json")
        mp.spawn(worker, args=(port, path), nprocs=nprocs, join=True)
        with open(path) as f:
            return json.load(f)


DISTRIBUTED = {"tp": (_tp_worker, 2), "cp": (_cp_worker, 2), "cp_tp": (_cp_tp_worker, 4)}


def main():
    case, port = sys.argv[1], int(sys.argv[2])
    if case in DISTRIBUTED:
        result = case_distributed(*DISTRIBUTED[case], port)
    else:
        setup(port)
        result = {"oracle": case_oracle, "packed": case_packed, "module": case_module}[case]()
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
