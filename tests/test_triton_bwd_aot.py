"""Ahead-of-time check of the Triton backward kernels for the H200 (sm_90), without a GPU.

In a subprocess without TRITON_INTERPRET, every backward kernel (the recompute is the forward's state
pass with STORE_STATES; the gating kernels of chunk_gate.py too) is compiled with the launch config
that the dispatcher (gdn_packed.triton.chunk_bwd.bwd_configs, chunk.state_config) gives for each
(dtype, K, V) below, through triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)).
Asserted per kernel: it compiles, shared memory <= 227 KB, HGMMA (warpgroup MMA) in the SASS of the
kernels built around bf16/fp16 dots, and no register spills (cuobjdump --dump-resource-usage
STACK/LOCAL)."""
import functools
import json
import os
import subprocess
import sys

import pytest

SMEM_LIMIT = 227 * 1024
HOT = dict(H=16, HV=32)
# (dtype, K, V): the hot shape (bf16; fp16 compiles to the same tiles), fp32 (tf32 dots, no planes),
# the largest head dims, non-power-of-2 ones (masked tiles), and, for every distinct launch config that
# bwd_configs can give a dot kernel, the largest (K, V) that gets it (as the forward's all_configs)
_PICKED = [("bf16", 128, 128), ("fp16", 128, 128), ("bf16", 256, 256), ("bf16", 64, 64),
           ("bf16", 48, 80), ("fp32", 64, 64), ("fp32", 128, 128), ("fp32", 256, 256)]


def _shapes():
    import torch

    from gdn_packed.triton.chunk_bwd import bwd_configs
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    seen, out = set(), list(_PICKED)
    dims = range(256, 0, -16)
    for dtype in name:
        for K in dims:
            for V in dims:
                for kern, cfg in bwd_configs(K, V, dtype).items():
                    key = (kern, dtype, tuple(sorted(cfg.items())))
                    if kern != "finalize" and key not in seen:
                        seen.add(key)
                        if (name[dtype], K, V) not in out:
                            out.append((name[dtype], K, V))
    return out


SHAPES = _shapes()
DOT_KERNELS = ("chunk_state_output_kernel[STORE_STATES]", "chunk_bwd_dstate_kernel", "chunk_bwd_dqk_kernel",
               "chunk_bwd_wy_kernel")


def _kernels(dt, K, V):
    """(kernel, pointer/scalar signature, constexprs, (num_warps, num_stages)) of every backward launch."""
    import torch
    import triton

    from gdn_packed.triton import chunk_bwd as B
    from gdn_packed.triton import chunk_bwd_state as S
    from gdn_packed.triton import chunk_fwd as F
    from gdn_packed.triton.chunk import CHUNK, prep_config, state_config

    dtype = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)[dt]
    cfg = B.bwd_configs(K, V, dtype)
    split = bool(prep_config(K, dtype)["SPLIT"])
    cc, f = (dt if split else "fp32"), "*fp32"
    x = f"*{dt}"
    idx = dict(table="*i32", cu_chunks="*i32")
    c = dict(K=K, V=V, C=CHUNK, USE_L2=True)
    nk = triton.cdiv(K, cfg["dqk"]["BK"])
    r = state_config(K, V, dtype)
    d, q, w, fin = cfg["dstate"], cfg["dqk"], cfg["wy"], cfg["finalize"]
    return [
        (F.chunk_state_output_kernel,
         dict(q=x, k=x, v=x, g=f, beta=f, t_in=f"*{cc}", m_in=f"*{cc}", rn_in=f, h0=f, o=x, ht=f,
              s_out=f, vnew_out=f, scale="fp32", T_rows="i32", **idx),
         dict(c, **HOT, BK=r["BK"], BV=r["BV"], HAS_H0=True, SPLIT=split, STORE_STATES=True),
         (r["num_warps"], r["num_stages"])),
        (S.chunk_bwd_dstate_kernel,
         dict(q=x, k=x, g=f, beta=f, do=x, t_in=f"*{cc}", m_in=f"*{cc}", rn_in=f, dht=f, dsn=f, dvn=f, dh0=f,
              scale="fp32", H="i32", HV="i32", **idx),
         dict(c, BK=d["BK"], BV=d["BV"], HAS_DHT=True, SPLIT=split), (d["num_warps"], d["num_stages"])),
        (B.chunk_bwd_dqk_kernel,
         dict(q=x, k=x, g=f, do=x, vnew=f, dvn=f, s_in=f, dsn=f, rn_in=f, dq_part=f, dk_part=f, dwp=f,
              dgam_part=f, table="*i32", scale="fp32", T="i32", H="i32", HV="i32"),
         dict(c, BK=q["BK"], BV=q["BV"], SPLIT=split), (q["num_warps"], q["num_stages"])),
        (B.chunk_bwd_wy_kernel,
         dict(k=x, v=x, g=f, beta=f, tm=f"*{cc}", rn_in=f, dvn=f, dwp=f, dk_part=f, dgam_part=f, dv=x, dbeta=f,
              dg=f, table="*i32", T="i32", H="i32", HV="i32"),
         dict(c, NK=nk, BK=w["BK"], BV=w["BV"], SPLIT=split), (w["num_warps"], w["num_stages"])),
        (B.chunk_bwd_qk_finalize_kernel,
         dict(q=x, k=x, dq_part=f, dk_part=f, real="*i8", dq=x, dk=x, dv=x, dg=f, dbeta=f, T="i32",
              H="i32", HV="i32"),
         dict(K=K, V=V, BT=fin["BT"], BKF=fin["BKF"], BVF=fin["BVF"], USE_L2=True),
         (fin["num_warps"], fin["num_stages"])),
    ] + (_gate_kernels(dt) if K == V == 128 else [])


def _gate_kernels(dt):
    """The gating kernels (raw a, b in dtype dt; independent of K and V), with the launcher's config."""
    from gdn_packed.triton import chunk_gate as G

    c = G._gate_config(HOT["HV"])
    x, f = f"*{dt}", "*fp32"
    return [(G.chunk_gate_fwd_kernel, dict(a=x, b=x, A_log=f, dt_bias=f, g=f, beta=f, T="i32", HV="i32"),
             c, (4, 3)),
            (G.chunk_gate_bwd_kernel, dict(a=x, b=x, A_log=f, dt_bias=f, dg=f, dbeta=f, da=f, db=f,
                                           dA_log_part=f, ddt_bias_part=f, T="i32", HV="i32"), c, (4, 3))]


def _compile_all():
    """Runs in the subprocess: one JSON line per compiled kernel."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    target = GPUTarget("cuda", 90, 32)
    for dt, K, V in SHAPES:
        for fn, sig, consts, (nw, ns) in _kernels(dt, K, V):
            name = fn.__name__ + ("[STORE_STATES]" if consts.get("STORE_STATES") else "")
            row = dict(kernel=name, dtype=dt, K=K, V=V, num_warps=nw, num_stages=ns,
                       blocks={k: v for k, v in consts.items() if k.startswith("B")})
            try:
                signature = {n: ("constexpr" if n in consts else sig[n]) for n in fn.arg_names}
                attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                         if signature[n].startswith("*")}
                k = triton.compile(ASTSource(fn, signature, consts, attrs), target=target,
                                   options=dict(num_warps=nw, num_stages=ns))
                with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
                    fh.write(k.asm["cubin"])
                    fh.flush()
                    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage",
                                          fh.name], capture_output=True, text=True, check=True).stdout
                    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-sass", fh.name],
                                          capture_output=True, text=True, check=True).stdout
                row.update(regs=int(re.search(r"REG:(\d+)", res).group(1)), smem=k.metadata.shared,
                           spill=sum(int(v) for v in re.findall(r"(?:STACK|LOCAL):(\d+)", res)),
                           hgmma="HGMMA" in sass)
            except Exception as e:  # noqa: BLE001  (reported and asserted on by the tests)
                row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
            print(json.dumps(row), flush=True)


@functools.lru_cache(maxsize=None)
def compiled():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == sum(len(_kernels(*shape)) for shape in SHAPES), proc.stdout[-2000:]
    return rows


def _name(r):
    b = " ".join(f"{k}{v}" for k, v in r["blocks"].items())
    return (f"{r['kernel']:38s} {r['dtype']} K{r['K']:<3} V{r['V']:<3} {b:16s} "
            f"w{r['num_warps']} s{r['num_stages']}")


def test_backward_kernels_compile_for_sm90(report_table):
    bad = []
    for r in compiled():
        if "error" in r:
            bad.append(f"{_name(r)}: {r['error']}")
            report_table("AOT sm_90, backward kernels", f"{_name(r)}  FAILED {r['error'][:80]}")
            continue
        report_table("AOT sm_90, backward kernels",
                     f"{_name(r)}  regs {r['regs']:3d}  smem {r['smem'] / 1024:6.1f} KB  "
                     f"spill {r['spill']:5d} B  HGMMA {'yes' if r['hgmma'] else 'no'}")
        if r["smem"] > SMEM_LIMIT:
            bad.append(f"{_name(r)}: shared memory {r['smem']} B > {SMEM_LIMIT}")
        if r["kernel"] in DOT_KERNELS and r["dtype"] != "fp32" and not r["hgmma"]:
            bad.append(f"{_name(r)}: no HGMMA (warpgroup MMA) in the SASS")
    assert not bad, "\n".join(bad)


def test_no_register_spills():
    """No spills in any backward kernel config (fp32 K > 128 included: the state passes hold the
    state as two K-halves there)."""
    spills = [f"{_name(r)}: {r['spill']} B" for r in compiled() if r.get("spill")]
    assert not spills, "\n".join(spills)


if __name__ == "__main__":
    _compile_all()
