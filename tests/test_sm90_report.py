"""`python -m bench kernels`: the static sm_90 report (bench/sm90/).

The end-to-end test runs the CLI on a small shape (our kernels only: seconds per compile) in a
subprocess without TRITON_INTERPRET; the others check the readers and the model on known inputs."""
import json
import os
import subprocess
import sys

import pytest

from bench.sm90 import model as M
from bench.sm90 import sass as S
from bench.sm90 import ttir as IR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


RECORD = """
import json, torch
from bench.sm90 import launches
rec = launches.Recorder()
with launches.fake_hopper(), rec.active():
    launches.record_ours(rec, (1, 128, 2, 4, 64, 64), torch.bfloat16, ("fwd", "bwd"))
print(json.dumps([[lc.phase, lc.kernel] for lc in rec.launches]))
"""


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "bench", "kernels", *args], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_small_shape_report_lists_every_launch(tmp_path, sm90_toolchain):
    out = tmp_path / "r.json"
    proc = _run_cli("--shape", "1,128,2,4,64,64", "--dtype", "bf16", "--no-fla", "--json", str(out),
                    "--csv", str(tmp_path / "r.csv"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    # the launches the launchers record at this shape (outside the interpreter), each one row
    launched = subprocess.run([sys.executable, "-c", RECORD], env=_env(), cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert [[r["mode"], r["kernel"]] for r in rows] == json.loads(launched.stdout.splitlines()[-1])
    for r in rows:
        assert not r["error"], r
        assert 0 < r["regs"] <= 255 and r["smem_kb"] <= 227 and r["ctas_per_sm"] >= 1, r
        assert r["est_us"] > 0 and r["hbm_gb"] > 0, r
    loops = [r for r in rows if r["loop_hgmma"] != ""]
    assert loops, "no kernel with a sequential chunk loop holding HGMMA was found"
    assert all(r["loop_instr"] > r["loop_hgmma"] > 0 for r in loops)
    assert {t["mode"] for t in data["totals"]} == {"fwd", "bwd"}
    assert "MODEL ESTIMATE" in proc.stdout and (tmp_path / "r.csv").read_text().startswith("impl,")


def test_bad_shape_is_a_usage_error():
    proc = _run_cli("--shape", "1,128,3,4,64,64", timeout=120)
    assert proc.returncode == 2 and "HV a multiple of H" in proc.stderr


TTIR = """
  tt.func public @k(%x: !tt.ptr<bf16>, %n: i32, %c: !tt.ptr<i32>) {
    %c0_i32 = arith.constant 0 : i32
    %c1_i32 = arith.constant 1 : i32
    %c32_i32 = arith.constant 32 : i32
    %c-1_i32 = arith.constant -1 : i32
    %0 = arith.muli %n, %c32_i32 : i32
    %1 = tt.load %c : !tt.ptr<i32>
    scf.for %i = %c0_i32 to %0 step %c32_i32  : i32 {
      %a = tt.load %p : tensor<64x32x!tt.ptr<bf16>>
      %d = tt.dot %a, %b, %acc, inputPrecision = tf32 : tensor<64x32xbf16> * tensor<32x16xbf16> -> tensor<64x16xf32>
    }
    scf.for %j = %c0_i32 to %1 step %c1_i32  : i32 {
      %e = tt.dot %u, %w, %acc, inputPrecision = tf32x3 : tensor<64x64xf32> * tensor<64x16xf32> -> tensor<64x16xf32>
      tt.store %q, %e : tensor<64x16x!tt.ptr<f32>>
    }
    scf.for %j2 = %c0_i32 to %1 step %c1_i32  : i32 {
      tt.store %q, %e : tensor<64x16x!tt.ptr<f32>>
    }
    scf.for %j3 = %c-1_i32 to %n step %c1_i32  : i32 {
      tt.store %q, %e : tensor<64x16x!tt.ptr<f32>>
    }
    tt.return
  }
"""


def test_ttir_reader_counts_tiles_and_trips():
    r = IR.read_ttir(TTIR, {"n": 3}, seq_chunks=5)
    # loop 1: 3 trips (n x 32 / 32) of a 64x32 bf16 load and a 64x16x32 dot; loop 2: data-dependent
    # with a dot, 5 trips; loop 3: data-dependent without a dot, 0 trips; loop 4: -1 to n, n + 1 trips
    assert r["ld"] == 4 + 3 * 64 * 32 * 2
    assert r["st"] == (5 + 4) * 64 * 16 * 4
    assert r["flops"] == 3 * 2 * 64 * 16 * 32 + 5 * 2 * 64 * 16 * 64
    assert r["seq_loop"] and r["seq_trips"] == 5
    assert sorted(set(r["dots"])) == [("bf16", "bf16", "tf32"), ("f32", "f32", "tf32x3")]


def test_constant_trip_loop_is_not_the_chunk_loop():
    text = TTIR.replace("%0 step %c32_i32", "%c32_i32 step %c1_i32").split("    scf.for %j =")[0] + "  }"
    r = IR.read_ttir(text, {"n": 3}, seq_chunks=5)
    assert not r["seq_loop"] and r["flops"] == 32 * 2 * 64 * 16 * 32


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], RZ ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0050*/                   F2FP.BF16.F32.PACK_AB R3, R4, R5 ;
        /*0060*/                   NOP ;
        /*0070*/              @P0 BRA 0x10 ;
        /*0080*/                   EXIT ;
"""


def test_sass_loop_counts_one_iteration():
    loop = S.sass_loop(S.sass_instructions(SASS))
    assert loop == dict(hgmma=2, hmma=0, mma_cycles=16 + 32, instr=6, waits=1, bars=1, f2fp=1)


def test_sass_loop_skips_out_of_line_waits():
    # a try-wait retry stub after the last EXIT branches back into the loop: not the loop itself
    sass = SASS.replace("        /*0080*/                   EXIT ;", """        /*0080*/                   EXIT ;
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R5+URZ], R4 ;
        /*00a0*/              @!P0 BRA 0x90 ;
        /*00b0*/                   BRA 0x20 ;""")
    loop = S.sass_loop(S.sass_instructions(sass))
    assert loop == dict(hgmma=2, hmma=0, mma_cycles=16 + 32, instr=6, waits=1, bars=1, f2fp=1)


def test_sass_loop_of_mma_sync_kernels():
    sass = SASS.replace("HGMMA.64x32x16.F32.BF16", "HMMA.16816.F32.BF16").replace("HGMMA.64x64x16.F32.BF16",
                                                                                  "HMMA.16816.F32.BF16")
    loop = S.sass_loop(S.sass_instructions(sass))
    assert loop["hgmma"] == 0 and loop["hmma"] == 2 and loop["mma_cycles"] == 16


@pytest.mark.parametrize("regs, smem, warps, want", [
    (213, 152576, 4, 1),      # forward state pass at the anchor today: shared memory bound
    (155, 111 * 1024, 4, 2),  # the no-split figure: 2 CTAs
    (255, 8192, 4, 2),        # registers bound: 256 x 128 threads = 32K of 64K
    (32, 0, 8, 8),            # warps bound: 64 / 8
    (128, 232.5 * 1024, 4, 0),  # more shared memory than an SM has
])
def test_ctas_per_sm(regs, smem, warps, want):
    assert M.ctas_per_sm(regs, smem, warps) == want


def test_calibrate_hits_the_target():
    kappa = M.calibrate(lambda k: 1e-4 + 1e-4 * k)
    assert abs(1e-4 + 1e-4 * kappa - M.FLA_FWD_ANCHOR_S) < 1e-9


def test_batched_dot_counts_its_batch():
    """A 3D (batched) tt.dot, [B, M, K] x [B, K, N], is 2 B M N K FLOPs and reads its operand types."""
    line = ("    %d = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<4x16x8xf32> * tensor<4x8x32xf32> "
            "-> tensor<4x16x32xf32>")
    text = "module {\n  tt.func public @k() {\n" + line + "\n    tt.return\n  }\n}\n"
    r = IR.read_ttir(text, {}, seq_chunks=1)
    assert r["flops"] == 2 * 4 * 16 * 32 * 8 and r["dots"] == [("f32", "f32", "tf32")]
