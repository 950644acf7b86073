"""Ahead-of-time check of the Triton backward kernels for the H200 (sm_90), without a GPU.

In a subprocess without TRITON_INTERPRET, every backward kernel of chunk_bwd.py (dstate, grads,
finalize; the gating kernels of chunk_gate.py too; the forward prep/state kernels it also launches are
compiled by the forward's AOT test) is compiled with the launch config
that the dispatcher (gdn_packed.triton.chunk_bwd.bwd_configs) gives for each
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
DOT_KERNELS = ("chunk_bwd_dstate_kernel", "chunk_bwd_grads_kernel")


def _kernels(dt, K, V):
    """(kernel, pointer/scalar signature, constexprs, (num_warps, num_stages)) of every backward launch
    (l2norm and initial-state gradient on: the larger variants)."""
    import torch
    import triton

    from gdn_packed.triton import chunk_bwd as B

    dtype = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)[dt]
    cfg = B.bwd_configs(K, V, dtype)
    x, f = f"*{dt}", "*fp32"
    idx = dict(table="*i32", H="i32", HV="i32")
    d, gr, fin = cfg["dstate"], cfg["grads"], cfg["finalize"]
    f32 = dt == "fp32"
    return [
        (B.chunk_bwd_dstate_kernel,
         dict(q=x, k=x, do=x, gates=f, eg_last=f, ts=x, mm=x, dht=f, dsn=f, dxp=f, dv=x, dh0=f, dq=x, dk=x,
              dg=f, dbeta=f, cu_chunks="*i32", T_rows="i32", **idx),
         dict(K=K, V=V, C=B.CHUNK, BK=d["BK"], BV=d["BV"], HAS_DHT=True, F32=f32),
         (d["num_warps"], d["num_stages"])),
        (B.chunk_bwd_grads_kernel,
         dict(q=x, k=x, v=x, g=f, do=x, gates=f, eg_last=f, rn=f, ts=x, xp=x, st=f, dsn=f, dxp=f, dq=f, dk=f,
              dgam_part=f, dbeta_part=f, scale="fp32", T="i32", **idx),
         dict(K=K, V=V, C=B.CHUNK, BK=gr["BK"], BV=gr["BV"], USE_L2=True, F32=f32),
         (gr["num_warps"], gr["num_stages"])),
        (B.chunk_bwd_finalize_kernel,
         dict(q=x, k=x, dq_pre=f, dk_pre=f, rn=f, dgam_part=f, dbeta_part=f, dq=x, dk=x, dg=f, dbeta=f,
              T="i32", **idx),
         dict(K=K, C=B.CHUNK, BKP=fin["BKP"], NK=triton.cdiv(K, gr["BK"]), USE_L2=True),
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
