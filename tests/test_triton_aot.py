"""Ahead-of-time check of the Triton forward kernels for the H200 (sm_90), without a GPU.

In a subprocess without TRITON_INTERPRET (the interpreter replaces @triton.jit with something AOT
cannot compile), every kernel is compiled with every launch config that the dispatcher
(gdn_packed.triton.chunk) can choose, through triton.compile(ASTSource(...), target=GPUTarget("cuda",
90, 32)). Asserted per kernel: it compiles, shared memory <= 227 KB, no register spills
(`cuobjdump --dump-resource-usage` from Triton's own bin folder), and the kernels built around tl.dot
on bf16/fp16 operands contain warpgroup MMA (HGMMA in the SASS)."""
import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

SMEM_LIMIT = 227 * 1024
HOT = dict(H=16, HV=32)   # head counts only change index constants, not tiles or registers
USE_L2 = True             # the l2norm variant is a superset of the other's code


def _compile_all():
    """Runs in the subprocess: one JSON line per compiled kernel."""
    import re
    import tempfile

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gdn_packed.triton import chunk as C

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    target = GPUTarget("cuda", 90, 32)
    tname = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

    def build(fn, sig, consts, opts):
        signature = {name: ("constexpr" if name in consts else sig[name]) for name in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if signature[name].startswith("*")}
        k = triton.compile(ASTSource(fn, signature, consts, attrs), target=target, options=opts)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", f.name],
                                 capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-sass", f.name],
                                  capture_output=True, text=True, check=True).stdout
        regs = int(re.search(r"REG:(\d+)", res).group(1))
        spill = sum(int(x) for x in re.findall(r"(?:STACK|LOCAL):(\d+)", res))
        return dict(regs=regs, smem=k.metadata.shared, spill=spill, hgmma="HGMMA" in sass,
                    hmma="HMMA" in sass)

    def one(item):
        kind, dtype, K, V, cfg = item
        dt = tname[dtype]
        opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if kind == "prep":
            fn = C.chunk_prep_kernel
            tm = dt if cfg["SPLIT"] else "fp32"
            sig = dict(q=f"*{dt}", k=f"*{dt}", g="*fp32", beta="*fp32", table="*i32", t_out=f"*{tm}",
                       m_out=f"*{tm}", rn_out="*fp32", scale="fp32")
            consts = dict(HOT, K=K, BK=cfg["BK"], C=C.CHUNK, USE_L2=USE_L2, SPLIT=cfg["SPLIT"])
        else:
            fn = C.chunk_state_output_kernel
            tm = dt if cfg["SPLIT"] else "fp32"
            sig = dict(q=f"*{dt}", k=f"*{dt}", v=f"*{dt}", g="*fp32", beta="*fp32", table="*i32",
                       cu_chunks="*i32", t_in=f"*{tm}", m_in=f"*{tm}", rn_in="*fp32", h0="*fp32", o=f"*{dt}", ht="*fp32",
                       s_out="*fp32", vnew_out="*fp32", scale="fp32", T_rows="i32")
            consts = dict(HOT, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"], C=C.CHUNK, USE_L2=USE_L2, HAS_H0=True,
                          SPLIT=cfg["SPLIT"], STORE_STATES=False)
        row = dict(id=config_id(kind, dtype, K, V, cfg), kernel=fn.__name__, dtype=dt)
        try:
            row.update(build(fn, sig, consts, opts))
        except Exception as e:  # noqa: BLE001  (reported and asserted on by the test)
            row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        return json.dumps(row)

    # compiles are independent (each runs LLVM and ptxas): use the cores there are
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for line in pool.map(one, C.all_configs()):
            print(line, flush=True)


def config_id(kind, dtype, K, V, cfg):
    return (f"{kind}-{str(dtype)[6:]}-K{K}" + (f"-V{V}" if V else "") + f"-BK{cfg['BK']}"
            + (f"-BV{cfg['BV']}" if "BV" in cfg else "") + f"-w{cfg['num_warps']}-s{cfg['num_stages']}")


def _configs():
    try:
        from gdn_packed.triton.chunk import all_configs
    except ImportError:
        return []
    return [pytest.param(c, id=config_id(*c)) for c in all_configs()]


@functools.lru_cache(maxsize=None)
def _compiled():
    """Compile every config once, in a subprocess without the interpreter: {config id: result}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["id"]: r for r in map(json.loads, filter(lambda x: x.startswith("{"), proc.stdout.splitlines()))}


@pytest.mark.parametrize("config", _configs())
def test_kernel_compiles_for_sm90(config, report_table):
    pytest.importorskip("triton")
    r = _compiled()[config_id(*config)]
    title = "AOT sm_90: triton.compile + cuobjdump (regs, shared memory, spills, HGMMA)"
    name = f"{r['id']:52s}"
    if "error" in r:
        report_table(title, f"{name} FAILED {r['error'][-100:]}")
        pytest.fail(r["error"])
    report_table(title, f"{name} regs {r['regs']:3d}  smem {r['smem'] / 1024:6.1f} KB  spills {r['spill']:4d} B  "
                        f"HGMMA {'yes' if r['hgmma'] else 'no'}")
    assert r["smem"] <= SMEM_LIMIT, f"shared memory {r['smem']} B > {SMEM_LIMIT}"
    assert r["spill"] == 0, f"{r['spill']} B of register spills"
    if r["dtype"] != "fp32":       # both kernels are built around tl.dot on bf16/fp16 tiles
        assert r["hgmma"], "no HGMMA (warpgroup MMA) in the SASS"


if __name__ == "__main__":
    _compile_all()
