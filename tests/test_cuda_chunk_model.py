"""The sm_90a CUDA chunked forward in the sm_90 report (bench/sm90/cuda_chunk.py): compiled with nvcc
(the compile tests/test_build.py shares, cached by the csrc sources), its three loops found in the SASS
and simulated at the model's constants, the per-CTA combination of the warp-specialised roles, the op
body's torch operators with backend="cuda", and its row beside FLA's in the totals; the backward's reverse
dS pass (csrc/chunk_gdr_bwd_sm90.cu) the same way, in the backward of backend="cuda". No GPU needed."""
import math
import os
import re

import pytest

from bench.sm90 import cuda_chunk
from bench.sm90 import model as M

ANCHOR = (1, 32768, 16, 32, 128, 128)
RECORD = """
import json
from bench.sm90 import cuda_chunk
from bench.sm90.hopper import fake_hopper
from bench.sm90.launches import Recorder, _meta_inputs, _op_body
from bench.sm90.report import report
rec = Recorder(torch_ops=True)
with fake_hopper(), rec.active():
    cuda_chunk.record(rec, %r, "bf16", _meta_inputs, _op_body, modes=%r)
rows, totals, _ = report([("cuda", "case", %r, "bf16", rec.launches)])
print(json.dumps(dict(names=[lc.kernel for lc in rec.launches if hasattr(lc, "kernel")], rows=rows, totals=totals),
                 default=str))
"""
WHY = cuda_chunk.missing() or ("" if cuda_chunk.find_tool("cuobjdump") else "no cuobjdump: the SASS is not read")
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"the CUDA kernel cannot be compiled and read here: {WHY}")


@pytest.fixture(scope="module")
def facts():
    return {dt: cuda_chunk.facts(dt, M.CONSTANTS) for dt in cuda_chunk.DTYPES}


@pytest.mark.parametrize("dtype", cuda_chunk.DTYPES)
def test_the_three_roles_are_read_from_the_sass(facts, dtype):
    """state: 28 HGMMA in 3 waits a chunk; prep: 24 HGMMA in 5 waits a chunk it preps (the Grams 16, the
    doubling's blocks 4 of 64 x 16 and 4 of 64 x 32) and the diagonal blocks' 12 mma.sync (HMMA); the
    producer's loop holds the TMA loads. 168 launch registers, no spill; every simulated term positive."""
    f = facts[dtype]
    assert not f.error, f.error
    assert (f.regs, f.spill) == (168, 0)
    assert (f.loops["state"]["hgmma"], f.loops["state"]["waits"]) == (28, 3)
    assert (f.loops["prep"]["hgmma"], f.loops["prep"]["waits"]) == (24, 5)
    assert f.loops["state"]["shapes"] == {"64x128x16": 4, "64x64x16": 24}
    assert f.loops["prep"]["shapes"] == {"64x64x16": 16, "64x16x16": 4, "64x32x16": 4}
    assert f.loops["state"]["mma_cycles"] > 0 and f.loops["prep"]["mma_cycles"] > 0
    assert all(f.loops[r]["cycles"] > 0 and f.loops[r]["instr"] > 0 for r in ("state", "prep", "producer"))


def test_a_cta_takes_the_slowest_role(facts):
    """D(n) = max(n state, n (ldg + prep) / (stages - 1) (prep behind the k / q / v ring), n producer,
    issue, mma): linear in n, bounded by one term."""
    f = facts["bf16"]
    s, p, pr = f.loops["state"], f.loops["prep"], f.loops["producer"]
    d8, bound = cuda_chunk.cta_cycles(f, 8, M.CONSTANTS)
    assert math.isclose(d8, max(8 * s["cycles"], 8 * (M.CONSTANTS.lat.ldg + p["cycles"]) / 2, 8 * pr["cycles"],
                                8 * (s["instr"] + p["instr"] / 2 + pr["instr"]),
                                8 * (s["mma_cycles"] + p["mma_cycles"] / 2)))
    assert math.isclose(cuda_chunk.cta_cycles(f, 16, M.CONSTANTS)[0], 2 * d8)
    assert bound in ("state", "ring", "producer", "issue", "mma")


def test_estimate_schedules_the_ctas_on_the_sms(facts):
    """At the anchor 64 CTAs (2 V-blocks x 32 heads) fill 64 SMs once; at 4 x 8192, 256 CTAs take two
    rounds of 132: twice a CTA of a quarter of the chunks, i.e. about half the anchor's latency term."""
    f = facts["bf16"]
    a = cuda_chunk.estimate(f, ANCHOR, "bf16", M.CONSTANTS)
    b = cuda_chunk.estimate(f, (4, 8192, 16, 32, 128, 128), "bf16", M.CONSTANTS)
    assert a["ctas"] == 64 and b["ctas"] == 256
    d = cuda_chunk.cta_cycles(f, 512, M.CONSTANTS)[0] + M.CONSTANTS.lat.ldg + f.loops["prep"]["cycles"]
    assert math.isclose(a["t_lat"], d / M.CLOCK_HZ)     # + the fill: chunk 0 loaded and prepped
    assert 0.45 < b["t_lat"] / a["t_lat"] < 0.55
    # latency and max(bytes, shared memory) combined as the Triton kernels' at 1 CTA per SM (model.bounded)
    both = M.bounded({"latency": a["t_lat"], "bytes": a["t_mem"], "smem": a["t_smem"], "FLOPs": a["t_tc"]}, 1,
                     M.CONSTANTS)[0]
    assert a["est_s"] == both + M.CONSTANTS.launch_s
    assert both > max(a["t_lat"], a["t_mem"], a["t_smem"], a["t_tc"])


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_shared_memory_counts_every_role_and_the_tma_traffic(facts, phase):
    """A CTA's shared-memory cycles a chunk (smem_cycles): the warpgroup MMAs' operand reads are the tile
    program's, counted by hand at 128 bytes a cycle (forward state: [K; Q] 32 KB, Ts, M 8 KB each, K 16 KB;
    prep: the two Grams' A and B 64 KB, the two doubling levels' blocks' B operands 6 KB (16 x 16 x 4 and
    32 x 32 x 2 of fp16); the dS step 80 KB); the TMA
    bytes the model charges are the kernel's own expect-tx counts (the stage, and the forward's bulk copy
    to the peer: immediates in its SASS); every role's warps add wavefronts on top; and the term is those
    cycles of every CTA's chunks over the busy SMs (at the anchor 64 CTAs of 512 chunks on 64 SMs)."""
    f = facts["bf16"] if phase == "fwd" else cuda_chunk.facts("bf16", M.CONSTANTS, "bwd")
    mma = {"fwd": {"state": 64 * 1024 / 128, "prep": 70 * 1024 / 128}, "bwd": {"state": 80 * 1024 / 128}}[phase]
    assert {r: f.loops[r]["smem_mma"] for r in mma} == mma
    source, kernel, _ = cuda_chunk.KERNELS[phase]
    body = cuda_chunk._kernel_sass(cuda_chunk.build(source)["sass"], "bf16", kernel)
    counts = [cuda_chunk.STAGE_BYTES[phase]] + ([cuda_chunk.PEER_BYTES] if phase == "fwd" else [])
    assert all(re.search(rf"\b{hex(n)}\b", body) for n in counts), [hex(n) for n in counts]
    floor = mma["state"] + mma.get("prep", 0) / 2 + cuda_chunk.TMA_BYTES[phase] / 128
    assert cuda_chunk.smem_cycles(f, phase) > floor and all(x["smem"] > 0 for x in f.loops.values())
    est = (cuda_chunk.estimate if phase == "fwd" else cuda_chunk.bwd_estimate)(f, ANCHOR, "bf16", M.CONSTANTS)
    assert math.isclose(est["t_smem"], 512 * cuda_chunk.smem_cycles(f, phase) / M.CLOCK_HZ)


@pytest.mark.parametrize("dtype", cuda_chunk.DTYPES)
def test_prep_scratch_accesses_of_the_accumulator_layout_are_conflict_free(dtype):
    """Prep's 8-byte shared accesses (A / M's factors: decay2's pairs of insuf and dsum, rk's pairs) come
    from the wgmma accumulator layout, 8 rows a warp, and are conflict-free as banks.py resolves the lanes'
    addresses (bench/NOTES.md, "where the sm_90a forward's shared-memory time goes"; the diagonal blocks'
    a16 / t16 accesses among them were 4-way at 16-float rows, then conflict-free at 24, and are gone since
    the blocks are inverted in registers)."""
    from bench.sm90 import banks, sass
    prog = sass.program(cuda_chunk._kernel_sass(cuda_chunk.build()["sass"], dtype))
    first, last = cuda_chunk._role_loops(prog)["prep"]
    wf = banks.conflict_wavefronts(prog)
    wide = [i for i in range(first, last + 1) if prog[i].op.startswith(("LDS.64", "STS.64")) and i in wf]
    assert len(wide) >= 16                 # A / M's factor loads at least, resolved
    conflicted = [(hex(prog[i].addr), prog[i].op, wf[i]) for i in wide if wf[i] > sass.smem_wavefronts(prog[i].op)]
    assert not conflicted, conflicted


def test_shared_memory_by_source_line_adds_up_to_the_loops(facts):
    """`python -m bench kernels --cuda-lines` (cuda_chunk.smem_by_line): the forward's compile (its line
    table, kept with the cached compile), each role's loop wavefronts attributed to csrc lines, adding up to
    what the model counts for that loop (facts: the same compile); the lines are csrc's."""
    got = cuda_chunk.smem_by_line("fwd", "bf16")
    if "error" in got and got["error"].startswith("no "):
        pytest.skip(f"the line table cannot be read here: {got['error']}")
    assert "error" not in got, got
    csrc = {os.path.basename(p) for p in os.listdir(cuda_chunk.CSRC)}
    for role, rows in got.items():
        assert sum(w for _, _, w in rows) == facts["bf16"].loops[role]["smem"], role
        assert all(line and line.split(":")[0] in csrc for line, _, _ in rows), rows
    text = cuda_chunk.format_smem_by_line("fwd", "bf16", top=3)
    assert "prep: " in text and "chunk_gdr_sm90.cuh:" in text


def _record(dims, modes):
    """The op body with backend="cuda" at dims recorded on meta tensors for `modes` (in a subprocess without
    TRITON_INTERPRET, as tests/test_sm90_report.py records, so that Triton launches are recorded, not
    interpreted): {names: the launches' kernels, rows, totals} of its report."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", RECORD % (dims, modes, dims)], env=env, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_report_rows_of_the_cuda_forward(facts):
    """The op body with backend="cuda" on meta tensors records its torch operators (the chunk table) and
    the kernel's launch (stubbed), as under autograd: at 4 x 8192 (256 CTAs) the fused kernel keeping its
    prep outputs, in its pair form on GVA pairs (16 / 32 heads: clusters of 4), else as itself (32 / 32); at
    the anchor (64 state CTAs: forward_kernel's "split"; 16 / 32 heads: GVA pairs) the split kernel's pair
    form, keeping its prep CTAs' outputs, and no Triton prep. Each kernel's row names its bound; K != 128 is
    a row with the reason."""
    pair = cuda_chunk.facts("bf16", M.CONSTANTS, "fwd_pair")
    for heads, kernel, phase, f, config in (((16, 32), cuda_chunk.PAIR_KERNEL, "fwd_pair", pair, "VB64 cluster4 s3 p4"),
                                            ((32, 32), cuda_chunk.KERNEL, "fwd", facts["bf16"], "VB64 cluster2 s3 p4")):
        dims = (4, 8192) + heads + (128, 128)
        out = _record(dims, ("fwd",))
        assert out["names"].count(kernel) == 1 and "chunk_fwd_prep_kernel" not in out["names"]
        assert out["names"][-1] == kernel and "torch aten" in " ".join(out["names"])
        (k,) = [r for r in out["rows"] if r["kernel"] == kernel]
        assert k["ctas"] == 256 and k["spill_b"] == 0 and k["est_us"] > 0 and not k["error"] and k["mode"] == "fwd"
        assert k["bound"] in ("latency", "bytes", "smem", "FLOPs") and k["smem_us"] > 0 and k["config"] == config
        assert k["lat_role"] in ("state", "ring", "producer", "issue", "mma")
        assert k["loop_hgmma"] == 28 + 24 / 2 and k["loop_waits"] == 3 + 5 / 2
        (t,) = out["totals"]
        assert t["impl"] == "cuda" and t["est_us"] >= k["est_us"]
        assert math.isclose(k["est_us"], 1e6 * cuda_chunk.estimate(f, dims, "bf16", M.CONSTANTS, True, phase)["est_s"],
                            abs_tol=0.1)
    f = facts["bf16"]
    with_kept, without = (cuda_chunk.estimate(f, ANCHOR, "bf16", M.CONSTANTS, kept) for kept in (True, False))
    assert with_kept["hbm_bytes"] > without["hbm_bytes"] and with_kept["est_s"] >= without["est_s"]
    # the pair form: each CTA loads one of the four k / q blocks a stage (8 KB a CTA and chunk less)
    e, ep = (cuda_chunk.estimate(x, (4, 8192, 16, 32, 128, 128), "bf16", M.CONSTANTS, True, ph)
             for x, ph in ((f, "fwd"), (pair, "fwd_pair")))
    assert e["hbm_bytes"] - ep["hbm_bytes"] == 256 * 128 * 64 * 64 * 2 and ep["est_s"] < e["est_s"]

    out = _record(ANCHOR, ("fwd",))
    names = out["names"]
    assert names.count(cuda_chunk.SPLIT_PAIR_KERNEL) == 1 and names[-1] == cuda_chunk.SPLIT_PAIR_KERNEL
    assert not {cuda_chunk.KERNEL, cuda_chunk.STATE_KERNEL, cuda_chunk.SPLIT_KERNEL, "chunk_fwd_prep_kernel"} & set(names)
    (k,) = [r for r in out["rows"] if r["kernel"] == cuda_chunk.SPLIT_PAIR_KERNEL]
    assert k["mode"] == "fwd" and k["ctas"] == 128 and k["spill_b"] == 0 and not k["error"]
    assert k["config"] == "VB64 cluster8 s3 p4" and k["grid"] == "8x16x1"
    split = cuda_chunk.facts("bf16", M.CONSTANTS, "fwd_split_pair")
    est = cuda_chunk.estimate(split, ANCHOR, "bf16", M.CONSTANTS, True, "fwd_split_pair")
    assert math.isclose(k["est_us"], 1e6 * est["est_s"], abs_tol=0.1)
    (t,) = out["totals"]
    assert t["est_us"] >= k["est_us"]
    other = cuda_chunk.row("K64", (1, 1024, 2, 4, 64, 64), "bf16", M.CONSTANTS)
    assert other["est_us"] == "" and "K = V = 128" in other["error"]
    assert not cuda_chunk.takes((1, 1024, 2, 4, 64, 64), "bf16") and not cuda_chunk.takes(ANCHOR, "fp32")


@pytest.mark.parametrize("phase", cuda_chunk.SPLIT)
@pytest.mark.parametrize("dtype", cuda_chunk.DTYPES)
def test_the_split_kernels_roles_and_estimate(facts, dtype, phase):
    """The split kernel (chunk_gdr_fwd_sm90_split_kernel): in its SASS the state-only kernel's state loop
    (28 HGMMA in 4 waits), the fused kernel's prep loop (24 in 5), the state CTA's producer (multicast TMA)
    and the prep CTA's (its own k, q: prep_producer); 168 launch registers, no spill. Its estimate at the
    anchor: 128 CTAs (a prep CTA beside each of the 64 state CTAs) in one wave; the fused kernel's FLOPs;
    its bytes the fused kernel's tiles and the prep CTAs' both K-halves of k and q for every other chunk
    (16 KB a state CTA and chunk; no Ts / M through memory); its chain no shorter than the state loop's
    chunks or the 4 prep warpgroups' turns (ldg + prep a chunk each); its shared memory the slower kind of
    CTA's: at least the state CTA's MMA operand reads and TMA bytes, and half the prep loop's operand reads
    (70 KB a prepped chunk) and its k, q loads and two copies out. Its pair form (GVA pairs, clusters of
    8): the same, but each state CTA loads one of the four k / q blocks a stage for the pair's four
    (8 KB a state CTA and chunk less)."""
    f = cuda_chunk.facts(dtype, M.CONSTANTS, phase)
    assert not f.error and (f.regs, f.spill) == (168, 0) and set(f.loops) == {"state", "prep", "producer", "prep_producer"}
    assert (f.loops["state"]["hgmma"], f.loops["state"]["waits"], f.loops["prep"]["hgmma"], f.loops["prep"]["waits"]) == \
        (28, 4, 24, 5)
    assert f.loops["producer"]["hgmma"] == f.loops["prep_producer"]["hgmma"] == 0
    e = cuda_chunk.estimate(f, ANCHOR, dtype, M.CONSTANTS, False, phase)
    ef = cuda_chunk.estimate(facts[dtype], ANCHOR, dtype, M.CONSTANTS, False)
    assert e["ctas"] == 128 and e["flops"] == ef["flops"]
    shared = 64 * 64 * 2 if phase == "fwd_split_pair" else 0
    assert e["hbm_bytes"] == ef["hbm_bytes"] + 64 * 512 * (64 * 128 * 2 - shared)
    n, lat = 512, M.CONSTANTS.lat
    d, bound = cuda_chunk.cta_cycles(f, n, M.CONSTANTS, phase)
    assert d >= n * f.loops["state"]["cycles"] and d >= n * (lat.ldg + f.loops["prep"]["cycles"]) / 4
    assert math.isclose(e["t_lat"], (d + lat.ldg + f.loops["prep"]["cycles"]) / M.CLOCK_HZ)   # one wave
    sm = cuda_chunk.smem_cycles(f, phase)
    assert sm >= 512 + cuda_chunk.TMA_BYTES[phase] / 128 and f.loops["prep"]["smem_mma"] == 560
    assert sm >= (560 + (4 * cuda_chunk.BLOCK + 2 * cuda_chunk.PEER_BYTES) / 128) / 2
    assert math.isclose(e["t_smem"], n * sm / M.CLOCK_HZ)


@pytest.mark.parametrize("dtype", cuda_chunk.DTYPES)
def test_the_state_only_kernels_roles_are_read_from_the_sass(facts, dtype):
    """The state-only kernel (chunk_gdr_fwd_sm90_state_kernel): the fused kernel's state loop (28 HGMMA in 3
    waits a chunk) and a producer loop holding the TMA loads, no prep loop; 168 launch registers, no
    spill, the fused kernel's shared memory; its state loop waits 4 times (the previous chunk's U^T M^T, issued
    first, is waited for on its own before its O is stored). Its estimate at the anchor: no prep FLOPs; its
    bytes read Ts or M (multicast), the gate rows and chunk decay of every chunk in place of g, beta; its
    ring the loads' with one step of slack (a stage is released a step later: O stored in the next step)."""
    f = cuda_chunk.facts(dtype, M.CONSTANTS, "fwd_state")
    assert not f.error, f.error
    assert f.spill == 0 and f.regs == facts[dtype].regs and f.smem == facts[dtype].smem
    assert set(f.loops) == {"state", "producer"}
    s = f.loops["state"]
    assert (s["hgmma"], s["waits"], s["shapes"]) == (28, 4, facts[dtype].loops["state"]["shapes"])
    d8, _ = cuda_chunk.cta_cycles(f, 8, M.CONSTANTS, "fwd_state")
    pr = f.loops["producer"]
    assert math.isclose(d8, max(8 * s["cycles"], 8 * M.CONSTANTS.lat.ldg / 1, 8 * pr["cycles"],
                                8 * (s["instr"] + pr["instr"]), 8 * s["mma_cycles"]))
    fused = cuda_chunk.estimate(facts[dtype], ANCHOR, dtype, M.CONSTANTS, False)
    est = cuda_chunk.estimate(f, ANCHOR, dtype, M.CONSTANTS, False, "fwd_state")
    C, n = 64, 32768 // 64
    assert math.isclose(fused["flops"] - est["flops"], 64 * n * (4 * C * C * 128 + 8 * C ** 3) / 2)
    per_cta_chunk = (est["hbm_bytes"] - fused["hbm_bytes"]) / (64 * n)
    assert per_cta_chunk == C * C * 2 + 4 * C * 4 + 4 - C * 4


# ---- the backward's reverse dS pass (csrc/chunk_gdr_bwd_sm90.cu) ---------------------------------------

@pytest.mark.parametrize("phase", ["bwd", "bwd_pair"])
@pytest.mark.parametrize("dtype", cuda_chunk.DTYPES)
def test_the_dstate_kernels_roles_are_read_from_the_sass(dtype, phase):
    """The dS warpgroup's loop (the "state" role) of both forms (clusters of 2, of 4 on GVA pairs): 28 HGMMA
    (16 x 64x64x16, 12 x 64x128x16) in 3 waits a chunk; the producer's loop holds the TMA loads; no spill;
    D(n) the slowest of its terms."""
    f = cuda_chunk.facts(dtype, M.CONSTANTS, phase)
    assert not f.error, f.error
    assert f.spill == 0 and f.regs <= 255 and set(f.loops) == {"state", "producer"}
    s, pr = f.loops["state"], f.loops["producer"]
    assert (s["hgmma"], s["waits"], s["shapes"]) == (28, 3, {"64x64x16": 16, "64x128x16": 12})
    assert s["mma_cycles"] > 0 and s["cycles"] > 0 and pr["cycles"] > 0
    d8, bound = cuda_chunk.cta_cycles(f, 8, M.CONSTANTS)
    assert math.isclose(d8, max(8 * s["cycles"], 8 * M.CONSTANTS.lat.ldg / 2, 8 * pr["cycles"],
                                8 * (s["instr"] + pr["instr"]), 8 * s["mma_cycles"]))
    assert bound in ("state", "ring", "producer", "issue", "mma")




def test_report_rows_of_the_cuda_backward():
    """The backward of backend="cuda" recorded on meta tensors (in a subprocess without TRITON_INTERPRET,
    as tests/test_sm90_report.py records): the Triton backward's launches on the prep outputs the forward
    kept (no prep launch; the recompute from the kept entering states of its segments: no pass A, no
    combine) with its dS pass (pass A, combine, pass) replaced by one sm_90a kernel launch (its form on GVA
    pairs: the anchor's 16 / 32 heads) and its P, dq, A and dk kernels by another (the finalize kernel
    stays), each row naming its bound; the tiles the dS pass moves at the anchor: 2.19 GB (bench/NOTES.md's
    count) less the 8 KB of k / q a chunk that each CTA's pair partner loads for it; the gradient
    kernel's: a CTA per (chunk slot, qk head), 8192, each its q, k, row factors, per value head and V-block
    a stage, dq / dk and the shares out: 2.743 GB."""
    out = _record(ANCHOR, ("bwd",))
    names = out["names"]
    assert names.count(cuda_chunk.BWD_PAIR_KERNEL) == 1 and "chunk_bwd_dstate_kernel" not in names
    assert cuda_chunk.BWD_KERNEL not in names
    assert "chunk_fwd_prep_kernel" not in names         # on the prep outputs the forward kept
    # the recompute from the states entering the segments the forward kept (3 at the anchor): no pass A, no
    # combine
    assert names.count("chunk_fwd_state_kernel") == 1 and "chunk_combine_kernel" not in names
    assert names.count(cuda_chunk.GRADS_KERNEL) == 1 and names.count("chunk_bwd_finalize_kernel") == 1
    assert not {"chunk_bwd_p_kernel", "chunk_bwd_dq_kernel", "chunk_bwd_a_kernel", "chunk_bwd_dk_kernel"} & set(names)
    (k,) = [r for r in out["rows"] if r["kernel"] == cuda_chunk.BWD_PAIR_KERNEL]
    assert k["mode"] == "bwd" and k["ctas"] == 64 and k["spill_b"] == 0 and k["est_us"] > 0 and not k["error"]
    assert k["bound"] in ("latency", "bytes", "smem", "FLOPs") and k["loop_hgmma"] == 28
    assert math.isclose(k["hbm_gb"], 2.194 - 64 * 512 * 8192 / 1e9, rel_tol=0.01)
    (gr,) = [r for r in out["rows"] if r["kernel"] == cuda_chunk.GRADS_KERNEL]
    assert gr["mode"] == "bwd" and gr["ctas"] == 16 * 512 and gr["spill_b"] == 0 and not gr["error"]
    assert gr["bound"] in ("latency", "bytes", "smem", "FLOPs") and gr["loop_hgmma"] == 24 + 16
    per_cta = cuda_chunk.GRADS_TILE_BYTES + 2 * 2 * cuda_chunk.GRADS_STAGE_BYTES + 2 * 64 * 128 * 2 + 3 * 2 * 64 * 4
    assert math.isclose(gr["hbm_gb"], 16 * 512 * per_cta / 1e9, rel_tol=1e-3) and math.isclose(gr["hbm_gb"], 2.743,
                                                                                                rel_tol=1e-3)
    (t,) = out["totals"]
    assert t["impl"] == "cuda" and t["est_us"] > k["est_us"] + gr["est_us"]
    # the recompute runs beside the dS pass (gdn_packed._runtime.fork): a lane each, the recompute on the
    # 68 SMs the dS pass's 64 CTAs leave; the total takes the two lanes at once (model.lanes), less than
    # one after the other and more than the dS pass alone
    (rc,) = [r for r in out["rows"] if r["kernel"] == "chunk_fwd_state_kernel"]
    assert k["lane"] == "1 main" and rc["lane"] == "1 side" and rc["lane_sms"] == 132 - 64
    assert rc["est_us"] > rc["alone_us"] and all(r["lane"] == "" for r in out["rows"] if r not in (k, rc))
    (lanes,) = t["lanes"]
    assert lanes["main"] == [cuda_chunk.BWD_PAIR_KERNEL] and lanes["side"] == ["chunk_fwd_state_kernel"]
    assert k["est_us"] < lanes["est_us"] < lanes["sequence_us"] == pytest.approx(k["est_us"] + rc["alone_us"])
    rest = sum(r["est_us"] for r in out["rows"] if not r["lane"])
    assert t["est_us"] == pytest.approx(rest + lanes["est_us"], abs=0.2)


@pytest.mark.parametrize("dtype", cuda_chunk.DTYPES)
def test_grads_facts_from_the_sass(dtype):
    """The chunk-parallel gradient kernel's loops found in its SASS (_grads_roles): the dq side's value-head
    loop (24 HGMMA 64x64x16 in 4 waits with its V-block loop once: the simulator runs that twice, a head's
    V-blocks), the dk side's (16 in 3, its K-half loop inside), the producer's, and each side's start (its
    Gram: 8 HGMMA 64x64x16 in 1 wait) and end (the final products: the dq side's 8 HGMMA 64x128x16, the dk
    side's 16, each in 1 wait) (_grads_regions); no spill; its estimate's terms: each side's path (start, G
    value heads of its loop, end), the tensor pipe's sum over both sides, and the largest of them bounds a
    CTA."""
    f = cuda_chunk.facts(dtype, M.CONSTANTS, "grads")
    assert not f.error, f.error
    assert f.spill == 0 and f.regs == 168
    assert set(f.loops) == {"dq", "dk", "producer", *cuda_chunk.GRADS_REGIONS}
    dq, dk, pr = f.loops["dq"], f.loops["dk"], f.loops["producer"]
    assert (dq["hgmma"], dq["waits"], dk["hgmma"], dk["waits"]) == (24, 4, 16, 3)
    ends = {r: (f.loops[r]["hgmma"], f.loops[r]["waits"], f.loops[r]["mma_cycles"]) for r in cuda_chunk.GRADS_REGIONS}
    assert ends == {"dq_pre": (8, 1, 8 * 32), "dk_pre": (8, 1, 8 * 32), "dq_tail": (8, 1, 8 * 64),
                    "dk_tail": (16, 1, 16 * 64)}, ends
    # per value head, both V-blocks: the dq side 2 x 24 HGMMA, the dk side 2 x (12 + 2 x 4), 32 cycles each
    assert (dq["mma_cycles"], dk["mma_cycles"]) == (2 * 24 * 32, 2 * 20 * 32)
    assert pr["cycles"] > 0 and dq["cycles"] > dq["mma_cycles"] and dk["cycles"] > dk["mma_cycles"]
    est = cuda_chunk.grads_estimate(f, ANCHOR, dtype, M.CONSTANTS)
    G = ANCHOR[3] // ANCHOR[2]
    lp = f.loops
    paths = [lp[s + "_pre"]["cycles"] + G * lp[s]["cycles"] + lp[s + "_tail"]["cycles"] for s in ("dq", "dk")]
    assert est["ctas"] == 16 * 512 and est["step"] >= max(paths) > G * max(dq["cycles"], dk["cycles"])
    assert est["step"] >= G * (dq["mma_cycles"] + dk["mma_cycles"]) + sum(e[2] for e in ends.values())
    assert est["lat_bound"] in ("dq", "dk", "producer", "mma", "issue") and est["est_s"] > 0
