"""The sm_90a backward's reverse dS pass (csrc/chunk_gdr_bwd_sm90.cu) through its host mirror: the kernel's
chunk walk (a sequence's chunk slots from the last), its step (csrc/chunk_gdr_sm90.cuh dstate_step: the
products with plain loops in place of wgmma, the operands rounded as the device rounds them) and its
padding rows, on CPU tensors, K = V = 128 (the kernel's only head size), GVA 2, l2norm, dht:
  - on every packing of gdn_packed.testing.PACKINGS, fed Triton prep's outputs (formed here in float64
    from their definitions: prep_inputs; test_prep_inputs_are_triton_preps holds them to Triton prep's
    layout), its outputs against the float64 per-token recurrence run chunk by chunk from the last
    (chunk_walk_reference): dSn^T (the gradient of the state leaving every chunk), dv, dh0, and
    dX'^T = dv / beta on live rows (0 on a partial chunk's dead ones); fp32 (no rounding in the mirror)
    within 1e-5, bf16 / fp16 within the gradient budget;
  - every padding row of dv, dq, dk, dg, dbeta exactly 0, their real rows (the later Triton kernels')
    and the slots outside the sequences untouched;
  - bf16 dv and dh0 no worse than 1.1x FLA's (fla-core, the oracle) on the same inputs.
What the mirror cannot check (fragment layouts, swizzles, barriers across the cluster, TMA stores):
docs/DESIGN.md section 10; tests/test_cuda_chunk_gpu.py runs the device kernel."""
import functools

import pytest
import torch

from gdn_packed import _cext
from gdn_packed.testing import (BUDGETS, DTYPE_ID, PACKINGS, case_id, gdr_inputs, real_rows, reference_gdr,
                                rel_err)

if not _cext.built() or not hasattr(_cext.get_C(), "chunk_gdr_bwd_sm90_host"):
    why = _cext.cuda_unavailable_reason() if not _cext.built() else _cext.get_C().chunk_gdr_fwd_sm90_missing
    pytest.skip(f"gdn_packed._C has no sm_90a chunked kernel here: {why}", allow_module_level=True)

from gdn_packed.cuda.chunk import chunk_bwd_dstate_cuda  # noqa: E402
from gdn_packed.ops.chunk_table import make_chunk_table  # noqa: E402
from gdn_packed.triton.chunk import Prep  # noqa: E402

H, HV, K, C = 1, 2, 128, 64
SCALE = K ** -0.5
IDS = [case_id(p, f"H{H}x{HV}", f"K{K}") for p in PACKINGS]


def slots(table, cu_chunks):
    """(sequence, slot, start row, length) of every chunk slot of a sequence, in table order."""
    cc = cu_chunks.tolist()
    return [(n, j, int(table[j, 2]), int(table[j, 3])) for n in range(len(cc) - 1) for j in range(cc[n], cc[n + 1])]


def prep_inputs(q, k, g, beta, table, cu_chunks, l2norm, dtype):
    """What Triton prep writes per chunk slot and value head (gdn_packed/triton/chunk.py Prep), from the
    definitions (chunk_gdr_sm90.cuh) in float64: gates [NC, HV, 5, C] fp32 (beta, e^gam rk, scale e^gam rq,
    w rk, beta e^gam rk; 0 on dead rows), eg_last [NC, HV] fp32, Ts = (I + A)^-1 - I and M [NC, HV, C, C]
    rounded to `dtype`; slots outside the sequences NaN (never read)."""
    NC, G = table.shape[0], HV // H
    nan = float("nan")
    gates = torch.full((NC, HV, 5, C), nan, dtype=torch.float64)
    eg_last = torch.full((NC, HV), nan, dtype=torch.float64)
    ts, mm = (torch.full((NC, HV, C, C), nan, dtype=torch.float64) for _ in range(2))
    eye = torch.eye(C, dtype=torch.float64)
    for _, j, start, n in slots(table, cu_chunks):
        rows = slice(start, start + n)
        for hv in range(HV):
            qq, kk = (torch.zeros(C, K, dtype=torch.float64) for _ in range(2))
            qq[:n], kk[:n] = q[rows, hv // G].double(), k[rows, hv // G].double()
            gg, bb = torch.zeros(C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
            gg[:n], bb[:n] = g[rows, hv].double(), beta[rows, hv].double()
            live = torch.arange(C) < n
            rk = torch.where(live, (kk * kk).sum(-1).add(1e-6).rsqrt(), 0.0) if l2norm else live.double()
            rq = torch.where(live, (qq * qq).sum(-1).add(1e-6).rsqrt(), 0.0) if l2norm else live.double()
            gam = gg.cumsum(0)
            E = torch.where(torch.ones(C, C).tril().bool(), (gam[:, None] - gam[None, :]).exp(), 0.0)
            A = (bb * rk)[:, None] * E * rk[None, :] * (kk @ kk.T)
            Tm = torch.linalg.inv(eye + A.tril(-1))
            ts[j, hv], mm[j, hv] = Tm - eye, SCALE * rq[:, None] * E * rk[None, :] * (qq @ kk.T)
            eg = gam.exp()
            gates[j, hv] = torch.stack([bb, eg * rk, SCALE * eg * rq, (gam[-1] - gam).exp() * rk, bb * eg * rk])
            eg_last[j, hv] = gam[-1].exp()
    f = torch.float32
    return Prep(gates=gates.to(f), eg_last=eg_last.to(f), rn=None, ts=ts.to(dtype), mm=mm.to(dtype))


def chunk_walk_reference(q, k, do, g, beta, dht, table, cu_chunks, N):
    """The float64 per-token recurrence (gdn_packed.testing.reference_gdr) run chunk by chunk from each
    sequence's last: the gradient entering a chunk (w.r.t. its initial state) and of its v, by autograd,
    given do on its rows and the gradient leaving it. The loss is linear in (initial state, v), so these
    do not depend on the forward's values (every chunk starts from 0 here). Returns dsn [NC, HV, V, K]
    (the gradient leaving each slot, transposed; NaN outside the sequences), dv [T, HV, V] (0 on padding
    rows), dh0 [N, HV, K, V]."""
    NC, T = table.shape[0], q.shape[0]
    dsn = torch.full((NC, HV, K, K), float("nan"), dtype=torch.float64)
    dv = torch.zeros(T, HV, K, dtype=torch.float64)
    dS = dht.double().clone()
    for n, j, start, length in reversed(slots(table, cu_chunks)):
        rows = slice(start, start + length)
        dsn[j] = dS[n].transpose(-1, -2)
        h0 = torch.zeros(1, HV, K, K, dtype=torch.float64, requires_grad=True)
        v = torch.zeros(1, length, HV, K, dtype=torch.float64, requires_grad=True)
        o, fs = reference_gdr(q[None, rows].double(), k[None, rows].double(), v, g[None, rows].double(),
                              beta[None, rows].double(), scale=SCALE, initial_state=h0,
                              use_qk_l2norm_in_kernel=True)
        dh, dvc = torch.autograd.grad([o, fs], [h0, v], [do[None, rows].double(), dS[n:n + 1]])
        dS[n], dv[rows] = dh[0], dvc[0]
    return dsn, dv, dS


@functools.lru_cache(maxsize=None)
def case(pi, dtype):
    """Inputs of packing pi, the mirror's outputs (every output NaN-poisoned first) and the reference."""
    p = PACKINGS[pi]
    cu, cu_pad, rows = p.layout()
    N = len(p.lengths)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, K, dtype, N=N, initial_state=True, unit_k=False, seed=pi)
    q, k, g, beta = q[0], k[0], g[0], beta[0]
    gen = torch.Generator().manual_seed(100 + pi)
    do, dht = torch.randn(rows, HV, K, generator=gen).to(dtype), torch.randn(N, HV, K, K, generator=gen) * 0.1
    table, cc = make_chunk_table(cu, cu_pad, rows, C)
    prep = prep_inputs(q, k, g, beta, table, cc, True, dtype)
    NC = table.shape[0]
    nan = lambda *s, dt=dtype: torch.full(s, float("nan"), dtype=dt)  # noqa: E731
    out = dict(dsn=nan(NC, HV, K, K), dxp=nan(NC, HV, K, C), dv=nan(rows, HV, K), dh0=nan(N, HV, K, K, dt=torch.float32),
               dq=nan(rows, H, K), dk=nan(rows, H, K), dg=nan(rows, HV, dt=torch.float32),
               dbeta=nan(rows, HV, dt=torch.float32))
    chunk_bwd_dstate_cuda(q, k, do, table, cc, prep, dht, **out, host=True)
    ref = chunk_walk_reference(q, k, do, g, beta, dht, table, cc, N)
    return dict(q=q, k=k, g=g, beta=beta, do=do, h0=h0, dht=dht, cu=cu, table=table, cc=cc,
                pad=~real_rows(cu, cu_pad, rows)), out, ref


def live_mask(table, cc, NC):
    """[NC, C] bool: the live rows of the sequences' chunk slots; [NC] bool: the slots of a sequence."""
    live, used = torch.zeros(NC, C, dtype=torch.bool), torch.zeros(NC, dtype=torch.bool)
    for _, j, _, length in slots(table, cc):
        live[j, :length], used[j] = True, True
    return live, used


# fp32 and bf16 on every packing, fp16 (the same step with another rounding) on three
CASES = [pytest.param(pi, dt, id=f"{IDS[pi]}-{DTYPE_ID[dt]}") for dt in (torch.float32, torch.bfloat16)
         for pi in range(len(PACKINGS))] + [pytest.param(pi, torch.float16, id=f"{IDS[pi]}-fp16") for pi in (1, 2, 7)]


@pytest.mark.parametrize("pi, dtype", CASES)
def test_mirror_matches_float64_chunk_walk(pi, dtype):
    x, out, (rdsn, rdv, rdh0) = case(pi, dtype)
    b = BUDGETS[dtype]["grad"]
    live, used = live_mask(x["table"], x["cc"], rdsn.shape[0])
    err = dict(dsn=rel_err(out["dsn"][used], rdsn[used]), dv=rel_err(out["dv"], rdv), dh0=rel_err(out["dh0"], rdh0))
    # dX'^T [slot, hv, v, c] = dv[row c] / beta (the rows of every slot, gathered)
    rows = torch.tensor([start + c for _, j, start, length in slots(x["table"], x["cc"]) for c in range(length)],
                        dtype=torch.long)
    got = out["dxp"].permute(0, 3, 1, 2)[live]                                          # [live rows, HV, V]
    err["dxp"] = rel_err(got, rdv[rows] / x["beta"][rows, :, None].double())
    assert all(e <= b for e in err.values()), err
    assert (out["dxp"].permute(0, 3, 1, 2)[used[:, None] & ~live] == 0).all()          # dead rows of a chunk
    assert torch.isfinite(out["dsn"][used]).all() and torch.isfinite(out["dh0"]).all()


@pytest.mark.parametrize("pi", [1, 2, 3, 5, 6, 8], ids=[IDS[i] for i in (1, 2, 3, 5, 6, 8)])
def test_mirror_writes_padding_rows_only(pi):
    """dv: every row (padding 0); dq, dk, dg, dbeta: exactly 0 on every padding row, the real rows (the
    later Triton kernels') untouched, as the slots of dsn, dxp outside the sequences."""
    x, out, _ = case(pi, torch.bfloat16)
    pad = x["pad"]
    assert (out["dv"][pad] == 0).all() and not out["dv"].isnan().any()
    for name in ("dq", "dk", "dg", "dbeta"):
        assert (out[name][pad] == 0).all() and out[name][~pad].isnan().all(), name
    _, used = live_mask(x["table"], x["cc"], out["dsn"].shape[0])
    assert out["dsn"][~used].isnan().all() and out["dxp"][~used].isnan().all()


def test_prep_inputs_are_triton_preps():
    """The mirror's inputs as Triton prep writes them (gdn_packed.triton.chunk.chunk_fwd_prep under the
    interpreter; its layouts are the ones the kernel reads): gates, eg_last, Ts, M of a packing with a
    partial chunk and gaps, fp32, within fp32 rounding."""
    from gdn_packed.ops._common import triton_usable
    from gdn_packed.triton.chunk import _rows, chunk_fwd_prep
    if triton_usable(torch.device("cpu")):
        pytest.skip(f"Triton prep cannot run here: {triton_usable(torch.device('cpu'))}")
    p = PACKINGS[2]
    cu, cu_pad, rows = p.layout()
    q, k, v, g, beta, _ = gdr_inputs(rows, H, HV, K, K, torch.float32, N=len(p.lengths), unit_k=False, seed=2)
    table, cc = make_chunk_table(cu, cu_pad, rows, C)
    qq, kk, _, gg, bb, r = _rows(q[0], k[0], v[0], g[0], beta[0])
    got = chunk_fwd_prep(qq, kk, gg, bb, table, HV, SCALE, True, r)
    want = prep_inputs(q[0], k[0], g[0], beta[0], table, cc, True, torch.float32)
    _, used = live_mask(table, cc, table.shape[0])
    for name in ("gates", "eg_last", "ts", "mm"):
        assert rel_err(getattr(got, name)[used], getattr(want, name)[used].double()) <= 1e-5, name


def dstate_pass(packing, dtype, seed, impl, device="cuda", pairs=None):
    """The reverse dS pass of `impl` ("cuda": the sm_90a kernel, in its form on GVA pairs or not by `pairs`
    (None: chunk_bwd_dstate_cuda's choice), "mirror": its host mirror, "triton":
    gdn_packed.triton.chunk.chunk_bwd_dstate, the pass it replaces) on Triton prep's outputs of one
    packing's inputs (prep on `device`), every output NaN-poisoned first: {name: CPU tensor}, the chunk
    slots of the sequences and the padding rows."""
    from gdn_packed.triton.chunk import _rows, chunk_bwd_dstate, chunk_fwd_prep
    from gdn_packed.triton.configs import bwd_configs
    cu, cu_pad, rows = packing.layout()
    x = gdr_inputs(rows, H, HV, K, K, dtype, N=len(packing.lengths), unit_k=False, seed=seed)
    pad = ~real_rows(cu, cu_pad, rows)
    q, k, v, g, beta = (t[0].to(device) for t in x[:5])
    N = len(packing.lengths)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(rows, HV, K, generator=gen).to(dtype).to(device)
    dht = (torch.randn(N, HV, K, K, generator=gen) * 0.1).to(device)
    table, cc = make_chunk_table(cu.to(device), None if cu_pad is None else cu_pad.to(device), rows, C)
    q, k, v, g, beta, r = _rows(q, k, v, g, beta)
    prep = chunk_fwd_prep(q, k, g, beta, table, HV, SCALE, True, r)
    NC = table.shape[0]
    nan = lambda *s, dt=dtype: torch.full(s, float("nan"), dtype=dt, device=device)  # noqa: E731
    out = dict(dsn=nan(NC, HV, K, K), dxp=nan(NC, HV, K, C), dv=nan(rows, HV, K),
               dh0=nan(N, HV, K, K, dt=torch.float32), dq=nan(rows, H, K), dk=nan(rows, H, K),
               dg=nan(rows, HV, dt=torch.float32), dbeta=nan(rows, HV, dt=torch.float32))
    if impl == "triton":
        chunk_bwd_dstate(q, k, do, table, cc, prep, r, dht, **out, cfg=bwd_configs(K, K, dtype)["dstate"])
    elif impl == "cuda":
        chunk_bwd_dstate_cuda(q, k, do, table, cc, prep, dht, **out, pairs=pairs)
    else:
        cpu = {n: t.cpu() for n, t in out.items()}
        chunk_bwd_dstate_cuda(q.cpu(), k.cpu(), do.cpu(), table.cpu(), cc.cpu(),
                              Prep(*(None if t is None else t.cpu() for t in prep)), dht.cpu(), **cpu, host=True)
        out = cpu
    return {n: t.cpu() for n, t in out.items()}, live_mask(table.cpu(), cc.cpu(), NC)[1], pad


def assert_dstate_close(a, b, used, pad, tol):
    """Outputs of two dS passes: dsn, dxp on the sequences' slots, dv, dh0 within rel. `tol`; the padding
    rows exactly 0 in both, the real rows of dq, dk, dg, dbeta untouched (NaN) in both."""
    pick = lambda o, n: o[n][used] if n in ("dsn", "dxp") else o[n]  # noqa: E731
    errs = {n: rel_err(pick(a, n), pick(b, n).double()) for n in ("dsn", "dxp", "dv", "dh0")}
    assert all(e <= tol for e in errs.values()), errs
    for o in (a, b):
        assert (o["dv"][pad] == 0).all() and not o["dv"].isnan().any()
        for n in ("dq", "dk", "dg", "dbeta"):
            assert (o[n][pad] == 0).all() and o[n][~pad].isnan().all(), n
    return errs


@pytest.mark.parametrize("pi", [2, 3, 4, 6], ids=[IDS[i] for i in (2, 3, 4, 6)])
def test_mirror_matches_the_triton_pass_it_replaces(pi):
    """The mirror and gdn_packed.triton.chunk.chunk_bwd_dstate (under the interpreter; fp16: the
    interpreter's bf16 arithmetic is not that of compiled code) on the same Triton prep: the same
    products rounded at the same points, so within 1e-4; both write the same padding rows and nothing
    else of dq, dk, dg, dbeta. (tests/test_cuda_chunk_gpu.py runs the device kernel against both.)"""
    from gdn_packed.ops._common import triton_usable
    if triton_usable(torch.device("cpu")):
        pytest.skip(f"the Triton pass cannot run here: {triton_usable(torch.device('cpu'))}")
    tri, used, pad = dstate_pass(PACKINGS[pi], torch.float16, pi, "triton", device="cpu")
    mir, _, _ = dstate_pass(PACKINGS[pi], torch.float16, pi, "mirror", device="cpu")
    assert_dstate_close(mir, tri, used, pad, 1e-4)


@pytest.mark.parametrize("pi", [0, 2], ids=[IDS[0], IDS[2]])
def test_mirror_no_worse_than_fla(pi, report_table):
    """bf16 dv and dh0 (final gradients) against FLA's chunk_gated_delta_rule backward on the same inputs."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core (the FLA comparison's oracle) "
                              "is not installed")
    x, out, (_, rdv, rdh0) = case(pi, torch.bfloat16)
    real = ~x["pad"]
    lv = [t[real][None].detach().clone().requires_grad_(True) for t in (x["q"], x["k"])]
    v = torch.zeros(1, int(real.sum()), HV, K, dtype=torch.bfloat16, requires_grad=True)
    h0 = x["h0"].clone().requires_grad_(True)
    fo, ffs = fla.chunk_gated_delta_rule(*lv, v, x["g"][real][None], x["beta"][real][None], scale=SCALE,
                                         initial_state=h0, output_final_state=True, cu_seqlens=x["cu"].long(),
                                         use_qk_l2norm_in_kernel=True)
    fdv, fdh0 = torch.autograd.grad([fo, ffs], [v, h0], [x["do"][real][None], x["dht"]])
    ours = dict(dv=rel_err(out["dv"][real], rdv[real]), dh0=rel_err(out["dh0"], rdh0))
    theirs = dict(dv=rel_err(fdv[0], rdv[real]), dh0=rel_err(fdh0, rdh0))
    report_table("cuda dS pass (host mirror) vs FLA 0.6.0, bf16, rel. error (ours / FLA)",
                 f"{IDS[pi]:40s} " + "  ".join(f"{n} {ours[n]:.2e}/{theirs[n]:.2e}" for n in ours))
    worse = {n: (ours[n], theirs[n]) for n in ours if ours[n] > 1.1 * theirs[n]}
    assert not worse, worse


def _entry_args(T=5, N=1):
    """A complete, valid argument set of _C.chunk_gdr_bwd_sm90_host (float32: the mirror), and the tensors."""
    cu = torch.tensor([0, T], dtype=torch.int32)
    table, cc = make_chunk_table(cu, None, T, C)
    NC, z = table.shape[0], torch.zeros
    ts = dict(q=z(T, H, K), k=z(T, H, K), do=z(T, HV, K), gates=z(NC, HV, 5, C), eg_last=z(NC, HV),
              ts=z(NC, HV, C, C), mm=z(NC, HV, C, C), table=table, cu_chunks=cc, dht=z(N, HV, K, K),
              dsn=z(NC, HV, K, K), dxp=z(NC, HV, K, C), dv=z(T, HV, K), dh0=z(N, HV, K, K), dq=z(T, H, K),
              dk=z(T, H, K), dg=z(T, HV), dbeta=z(T, HV))
    args = {n: t.data_ptr() for n, t in ts.items()}
    args.update(N=N, T=T, H=H, HV=HV, K=K, V=K, NC=NC, chunk_size=C, dtype=0, gate_dtype=0, pairs=False)
    return args, ts


def test_entry_point_names_its_arguments():
    """_C.chunk_gdr_bwd_sm90(_host) takes the declared keywords only; a required pointer passed as None is
    a ValueError naming it before anything runs (dht is optional); shapes it does not take are refused."""
    C_ = _cext.get_C()
    args, keep = _entry_args()
    doc = "chunk_gdr_bwd_sm90_host(*, " + ", ".join(args) + ")"
    assert doc in C_.chunk_gdr_bwd_sm90_host.__doc__.splitlines()
    C_.chunk_gdr_bwd_sm90_host(**args)
    C_.chunk_gdr_bwd_sm90_host(**dict(args, dht=None))
    for name in [n for n in args if isinstance(args[n], int) and n in keep and n != "dht"]:
        with pytest.raises(ValueError, match=f"^chunk_gdr_bwd_sm90_host\\(\\): argument '{name}' "):
            C_.chunk_gdr_bwd_sm90_host(**dict(args, **{name: None}))
    C_.chunk_gdr_bwd_sm90_host(**dict(args, pairs=True))          # (HV / H = 2: value heads that pair)
    for bad, words in ((dict(K=64), "K and V must be 128"), (dict(chunk_size=32), "chunk_size must be 64"),
                       (dict(H=2, HV=3), "sizes out of range"), (dict(gate_dtype=7), "gate_dtype"),
                       (dict(HV=1, pairs=True), "pairs needs an even number of value heads a qk head")):
        with pytest.raises(ValueError, match=words):
            C_.chunk_gdr_bwd_sm90_host(**dict(args, **bad))


def test_launcher_checks_its_tensors():
    """gdn_packed.cuda.chunk.chunk_bwd_dstate_cuda: a tensor of the wrong shape or dtype is an error naming
    it; float32 is the host mirror's only."""
    _, ts = _entry_args()
    prep = Prep(gates=ts["gates"], eg_last=ts["eg_last"], rn=None, ts=ts["ts"], mm=ts["mm"])
    names = ("dht", "dsn", "dxp", "dv", "dh0", "dq", "dk", "dg", "dbeta")
    kw = {n: ts[n] for n in names}
    chunk_bwd_dstate_cuda(ts["q"], ts["k"], ts["do"], ts["table"], ts["cu_chunks"], prep, **kw, host=True)
    with pytest.raises(ValueError, match="dsn"):
        chunk_bwd_dstate_cuda(ts["q"], ts["k"], ts["do"], ts["table"], ts["cu_chunks"], prep,
                              **dict(kw, dsn=ts["dsn"][:, :1]), host=True)
    with pytest.raises(TypeError, match="do must have dtype"):
        chunk_bwd_dstate_cuda(ts["q"], ts["k"], ts["do"].bfloat16(), ts["table"], ts["cu_chunks"], prep, **kw,
                              host=True)
    with pytest.raises(TypeError, match="q must have dtype"):
        chunk_bwd_dstate_cuda(ts["q"], ts["k"], ts["do"], ts["table"], ts["cu_chunks"], prep, **kw)


@pytest.mark.parametrize("H, HV, want", [(1, 2, True), (2, 2, False), (2, 6, False), (1, 4, True), (3, 3, False)])
def test_launcher_pairs_value_heads_where_they_pair(monkeypatch, H, HV, want):
    """chunk_bwd_dstate_cuda asks the entry point for its form on GVA pairs (clusters of 4 sharing k / q)
    exactly where gva_pairs says the value heads pair (an even number a qk head), which is also the rule the
    sm_90 report's model records (bench/sm90/cuda_chunk.py: record); `pairs` passed overrides it."""
    from gdn_packed.cuda import chunk as cuda_chunk
    seen = []
    monkeypatch.setattr(cuda_chunk, "launch", lambda entry, device, **kw: seen.append((entry, kw["pairs"])))
    T, N = 5, 1
    cu = torch.tensor([0, T], dtype=torch.int32)
    table, cc = make_chunk_table(cu, None, T, C)
    NC, z, dt = table.shape[0], torch.zeros, torch.bfloat16
    prep = Prep(gates=z(NC, HV, 5, C), eg_last=z(NC, HV), rn=None, ts=z(NC, HV, C, C, dtype=dt),
                mm=z(NC, HV, C, C, dtype=dt))
    args = (z(T, H, K, dtype=dt), z(T, H, K, dtype=dt), z(T, HV, K, dtype=dt), table, cc, prep, None)
    outs = dict(dsn=z(NC, HV, K, K, dtype=dt), dxp=z(NC, HV, K, C, dtype=dt), dv=z(T, HV, K, dtype=dt),
                dh0=z(N, HV, K, K), dq=z(T, H, K, dtype=dt), dk=z(T, H, K, dtype=dt), dg=z(T, HV), dbeta=z(T, HV))
    assert cuda_chunk.gva_pairs(H, HV) == want
    chunk_bwd_dstate_cuda(*args, **outs)
    chunk_bwd_dstate_cuda(*args, **outs, pairs=False)
    assert seen == [("chunk_gdr_bwd_sm90", want), ("chunk_gdr_bwd_sm90", False)]
