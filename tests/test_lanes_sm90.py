"""The sm_90a device policy's warp-cooperative code (DevPolicy in csrc/chunk_gdr_sm90_device.cuh: the
wgmma accumulator layout, quad_rows_add, add_row_sums, row_dot, add_diag, sum_rows / rev_sum / fwd_sum,
add_col_sums, vt's ldmatrix, store's and store_diag_block's stmatrix, prep's diagonal inverses in
registers: diag_inverse's mma.sync and movmatrix) compiled by g++ unchanged and run by 128 emulated threads, one warpgroup
(tests/lanes_sm90.cpp), against float64 math: once as it is, once under ThreadSanitizer (two lanes touching
the same shared word with no shuffle or barrier between them), and with deliberately broken copies of the
header, which must fail. The CUDA toolkit's headers are nvcc's own (nvcc --dryrun), the CuTe headers the
nvidia-cutlass wheel's."""
import os
import re
import shlex
import shutil
import subprocess

import pytest

from bench.sm90 import cuda_chunk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
SOURCE = os.path.join(ROOT, "tests", "lanes_sm90.cpp")
HEADER = "chunk_gdr_sm90_device.cuh"
SUMMARY = re.compile(r"^lanes_sm90: ok, (\d+) checks, (\d+) launches of 128 threads, (\d+) values$", re.M)


def cuda_includes(nvcc, tmp):
    """The include directories nvcc passes its host compiler (its INCLUDES and SYSTEM_INCLUDES)."""
    src = os.path.join(tmp, "probe.cu")
    open(src, "w").close()
    out = subprocess.run([nvcc, "--dryrun", "-c", src, "-o", os.path.join(tmp, "probe.o")], capture_output=True,
                         text=True, cwd=tmp)
    dirs = []
    for line in (out.stdout + out.stderr).splitlines():
        m = re.match(r"#\$ (SYSTEM_)?INCLUDES=(.*)", line)
        if m:
            words = shlex.split(m[2])
            dirs += [w[2:] for w in words if w.startswith("-I")]
            dirs += [b for a, b in zip(words, words[1:]) if a == "-isystem"]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    """(g++, include flags), or a skip naming what is missing."""
    gxx, nvcc, cutlass = shutil.which("g++"), cuda_chunk.find_tool("nvcc"), cuda_chunk.cutlass_include()
    if gxx is None:
        pytest.skip("g++ not found: the emulated warpgroup is not built")
    if cutlass is None:
        pytest.skip("no CuTe headers (the nvidia-cutlass wheel): the emulated warpgroup is not built")
    if nvcc is None:
        pytest.skip("no nvcc (the CUDA toolkit's headers): the emulated warpgroup is not built")
    cuda = cuda_includes(nvcc, str(tmp_path_factory.mktemp("nvcc_probe")))
    if not any(os.path.isfile(os.path.join(d, "cuda_bf16.h")) for d in cuda):
        pytest.fail(f"nvcc --dryrun named no include directory with cuda_bf16.h: {cuda}")
    return gxx, ["-isystem", cutlass] + [f for d in cuda for f in ("-isystem", d)]


def build(toolchain, out, csrc=CSRC, extra=()):
    gxx, includes = toolchain
    cmd = [gxx, "-std=c++20", "-O1", "-D_GLIBCXX_ASSERTIONS", "-DGDN_LANE_SHIM", "-pthread", "-Wall", "-Wextra",
           "-Wno-unknown-pragmas", "-Wno-deprecated-declarations", "-I", csrc, *includes, *extra, SOURCE, "-o", out]
    return subprocess.run(cmd, capture_output=True, text=True)


def run(exe):
    return subprocess.run([exe], capture_output=True, text=True, timeout=240)


def test_device_warp_code_matches_float64(toolchain, tmp_path):
    exe = str(tmp_path / "lanes")
    b = build(toolchain, exe)
    assert b.returncode == 0, b.stderr[-4000:]
    r = run(exe)
    assert r.returncode == 0 and SUMMARY.search(r.stdout), r.stdout[-4000:] + r.stderr[-2000:]
    checks, launches, values = map(int, SUMMARY.search(r.stdout).groups())
    assert checks >= 60 and launches >= checks and values > 80000


def test_device_warp_code_has_no_data_race(toolchain, tmp_path):
    exe = str(tmp_path / "lanes_tsan")
    b = build(toolchain, exe, extra=("-g", "-fsanitize=thread"))
    if b.returncode != 0 and "sanitize" in b.stderr:
        pytest.skip(f"g++ -fsanitize=thread does not build here: {b.stderr.strip().splitlines()[-1][:300]}")
    assert b.returncode == 0, b.stderr[-4000:]
    r = run(exe)
    if "FATAL: ThreadSanitizer" in r.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {r.stderr.strip().splitlines()[0][:300]}")
    assert "WARNING: ThreadSanitizer" not in r.stderr, r.stderr[-6000:]
    assert r.returncode == 0 and SUMMARY.search(r.stdout), r.stdout[-4000:] + r.stderr[-2000:]


# a broken copy of the header (old -> new, once) and what the run must then print
BREAKS = {
    "rev_sum's source lane from the caller's lane, not its row": (
        "const float a = __shfl_sync(0xffffffffu, after, r >> 1);",
        "const float a = __shfl_sync(0xffffffffu, after, lane);",
        r"FAIL sum_rows / rev_sum / fwd_sum .*: rev_sum\[\d+\] = "),
    "add_diag's lanes l % 4 == l / 4": (
        "if ((l & 3) != (l >> 3)) return;", "if ((l & 3) != (l >> 2)) return;", r"FAIL add_diag .*: rows\[\d+\] = "),
    "a lane of sum_rows returning before its shuffles": (
        "    float s = v.x + v.y;\n#pragma unroll\n    for (int m = 16;",
        "    float s = v.x + v.y;\n    if (lane == 7) return s;\n#pragma unroll\n    for (int m = 16;",
        r"FAIL sum_rows / rev_sum / fwd_sum .*: warp [01] \(lanes\): member 7 at __shfl_down_sync .* member 0 at "
        r"__shfl_xor_sync"),
    "stmatrix .trans with the 8-column chunks of a pair swapped": (
        "const uint32_t addr = dst + swz(8 * a + j, 2 * w + h);",
        "const uint32_t addr = dst + swz(8 * a + j, 2 * w + 1 - h);",
        r"FAIL store<bf16>, transposed .*: tile\(\d+, \d+\) = "),
    "a diagonal block's B operand with its two pieces of n-block 0 swapped": (
        "movmatrix_trans(a.r[0]), movmatrix_trans(a.r[1]), 0u,", "movmatrix_trans(a.r[1]), movmatrix_trans(a.r[0]), 0u,",
        r"FAIL diag_inverse / diag_frag .*: diag_inverse: thread \d+, d\[\d+\] = "),
    "store_diag_block's warps one block of columns off": (
        "stmatrix<U, R0 / 16, NB / 16>(f.d, dst.addr, transpose);", "stmatrix<U, R0 / 16 + 1, NB / 16>(f.d, dst.addr, transpose);",
        r"FAIL store_diag_block<fp16, 0, 16>, transposed .*: shared byte \d+ "),
    "warp w taking the diagonal block of warp w + 1": (
        "v = w == b ? f.d[8 * b + k] : v;", "v = (w + 1) % 4 == b ? f.d[8 * b + k] : v;",
        r"FAIL diag_inverse / diag_frag .*: diag_inverse: thread \d+, d\[\d+\] = "),
}


@pytest.mark.parametrize("what", list(BREAKS))
def test_a_broken_lane_map_fails(toolchain, tmp_path, what):
    old, new, want = BREAKS[what]
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    text = (csrc / HEADER).read_text()
    assert text.count(old) == 1, f"{HEADER} no longer holds {old!r}: update BREAKS"
    (csrc / HEADER).write_text(text.replace(old, new))
    exe = str(tmp_path / "lanes")
    b = build(toolchain, exe, csrc=str(csrc))
    assert b.returncode == 0, b.stderr[-4000:]
    r = run(exe)
    assert r.returncode == 1 and re.search(want, r.stdout), r.stdout[-4000:]
