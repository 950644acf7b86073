"""tools/gpu_check.py (the prepared check for a lent GPU) and tools/gpu_tests.py (its pytest plugin),
run on this CPU: `make gpu-check DRY_RUN=1` passes and prints the summary table last, a step over its
budget is killed and reported, the plugin picks device tests by what they do and times tests out."""
import csv
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
STEPS = ["env", "wheels", "build", "tests", "sanitizer", "graph", "bench", "profile", "ncu"]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TOOLS]), PYTHONUNBUFFERED="1")
    env.update(extra)
    env.pop("OUT", None)
    return env


def _table(stdout):
    """The summary table: the lines from the 'step status seconds' header to the 'total' line."""
    lines = stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("step ") and "status" in line)
    rows = {}
    for line in lines[start + 1:]:
        parts = line.split()
        if parts and not line.startswith(" "):
            rows[parts[0]] = parts[1]
    return lines, start, rows


def test_make_gpu_check_dry_run_passes_and_prints_the_summary_last(tmp_path):
    out = tmp_path / "out"
    python = sys.executable
    t0 = time.monotonic()
    p = subprocess.run(["make", "-s", "gpu-check", "DRY_RUN=1", f"OUT={out}", f"GPU_PY={python}"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=400)
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    lines, start, rows = _table(p.stdout)
    assert "DRY RUN" in lines[start - 1]
    assert list(rows) == STEPS + ["total"], rows
    assert all(rows[s] in ("ok", "skipped") for s in STEPS) and rows["total"] == "ok", rows
    assert lines[-1].startswith("total"), "the summary table is printed last"
    # what comes back from the GPU machine: at most 8 plain files in one folder
    files = sorted(os.listdir(out))
    assert set(files) == {"summary.csv", "summary.json", "gpu_check.log", "tests.csv", "bench.csv", "bench.json",
                          "kernels.csv"}
    with open(out / "kernels.csv", newline="") as f:      # the profile step: per-kernel rows and totals
        krows = list(csv.DictReader(f))
    assert {r["mode"] for r in krows} == {"fwd", "bwd"} and any(r["kernel"] == "(all kernels)" for r in krows)
    assert all(float(r["us"]) > 0 for r in krows), krows
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == STEPS
    # within its budget, and the steps' times no more than the run's (the budget, 420 s, is not bounded by the
    # wall time: `budget_s < wall + 400` failed on a dry run of 19 s)
    assert summary["total_s"] <= summary["budget_s"] and summary["total_s"] <= wall + 1
    assert summary["env"]["torch"] and summary["env"]["dry_run"] is True
    with open(out / "summary.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == STEPS
    with open(out / "tests.csv", newline="") as f:
        tests = list(csv.DictReader(f))
    assert tests and all(t["outcome"] == "passed" for t in tests), tests
    assert any(int(t["triton_launches"]) > 0 for t in tests), "the sample ran no Triton kernel"
    with open(out / "bench.csv", newline="") as f:
        bench = list(csv.DictReader(f))
    assert any(b["metric"] == "time" and b["status"] == "ok" for b in bench)


def test_a_step_over_its_budget_is_killed_and_reported(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_check.py"), "--dry-run", "--only", "tests",
                        "--budget", "tests=2", "--out", str(tmp_path)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - t0
    assert p.returncode == 1, p.stdout + p.stderr
    lines, _, rows = _table(p.stdout)
    assert rows == {"tests": "timeout", "total": "FAIL"}, p.stdout
    assert lines[-1].startswith("total")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"][0]["seconds"] < 2 + 3, summary     # killed at its deadline, not left to finish
    assert wall < 2 + 20
    assert "stopped after 2 s" in (tmp_path / "gpu_check.log").read_text()


def test_bad_arguments_name_the_valid_choices(tmp_path):
    script = os.path.join(TOOLS, "gpu_check.py")
    p = subprocess.run([sys.executable, script, "--only", "tests,nope", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=_env(), timeout=60)
    assert p.returncode == 2 and "unknown step(s) nope" in p.stderr and "sanitizer" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, script, "--budget", "tests=soon", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=_env(), timeout=60)
    assert p.returncode == 2 and "SECONDS must be a number" in p.stderr, p.stderr


def test_a_hung_forward_probe_rebuilds_with_the_watchdog_and_names_the_barrier(monkeypatch):
    """The sanitizer step's probe of the sm_90a forward, its processes faked: a timeout, then _C rebuilt
    with GDN_PACKED_SM90_WATCHDOG and the probe rerun; the stuck waits' lines reach the note, and the
    forward is left out of the later runs."""
    monkeypatch.syspath_prepend(TOOLS)
    import gpu_check

    calls = []
    line = ("GDN_SM90_WATCHDOG: fwd state, prepped[it % 4]: Ts/M/gates by the peer prep's bulk copy, it 1: "
            "block (1,0,0) cluster rank 1 thread 256 warp 8 lanes 0xffffffff: mbarrier smem 0x37408 parity 0 "
            "not complete after 200000 try_waits (31.2 ms)")

    def py(*args, env=None, timeout=None):
        calls.append((args, dict(env or r.env)))
        if args[-1] == "--inplace":
            return 0, "built"
        return (None, "") if len(calls) == 1 else (1, line + "\nRuntimeError: CUDA error: unspecified launch failure")

    r = gpu_check.Run("/nonexistent", False, {"sanitizer": 60}, open(os.devnull, "w"))
    r.tmp, r.env = "/nonexistent", {}
    monkeypatch.setattr(r, "py", py)
    hung, note, d = gpu_check._forward_probe(r)
    assert hung and "HUNG" in note and "1 stuck waits: fwd state, prepped[it % 4]" in note, note
    assert d["watchdog_lines"] == [line]
    assert calls[1][1]["GDN_PACKED_SM90_WATCHDOG"] == str(gpu_check.WATCHDOG_SPINS)
    assert r.env[gpu_check.HUNG_ENV] == "1"                     # the later steps leave the forward out
    assert gpu_check._gpu_providers(True) == "ours-triton,fla"


def test_profile_records_the_configs_flas_autotuner_chose(monkeypatch):
    """autotuned_configs: every triton Autotuner in an fla.* module, its cache's chosen configs by kernel
    (what the sm_90 model otherwise has to guess); modules outside the prefix are not read."""
    triton = pytest.importorskip("triton")
    import types

    from triton.runtime.autotuner import Autotuner
    monkeypatch.syspath_prepend(TOOLS)
    import gpu_check

    def kernel_h():
        pass
    at = Autotuner.__new__(Autotuner)
    at.fn, at.base_fn = kernel_h, kernel_h
    at.cache = {(16, 32, "bf16"): triton.Config({"BV": 64}, num_warps=4, num_stages=3),
                (16, 32, "fp32"): triton.Config({"BV": 32}, num_warps=2, num_stages=2)}
    mod, other = types.ModuleType("fla.fake_chunk"), types.ModuleType("notfla.fake")
    mod.kernel_h, other.kernel_h = at, at
    monkeypatch.setitem(sys.modules, "fla.fake_chunk", mod)
    monkeypatch.setitem(sys.modules, "notfla.fake", other)
    got = gpu_check.autotuned_configs("fla.fake")
    assert list(got) == ["kernel_h"] and len(got["kernel_h"]) == 2
    assert any("BV: 64" in c and "num_warps: 4" in c for c in got["kernel_h"]), got
    assert gpu_check.autotuned_configs("notfla.") == got and gpu_check.autotuned_configs("nothing.") == {}


# ---- the plugin, on a small suite of its own -------------------------------------------------------------
SUITE = {
    "test_devicey.py": """
        import torch
        DEV = "cuda" if torch.cuda.is_available() else "cpu"

        def test_uses_dev():
            assert torch.ones(2, device=DEV).sum() == 2

        def test_sleeps():
            import time
            time.sleep(5)
    """,
    "test_plain.py": """
        import pytest, torch

        def test_cpu_only():
            assert torch.ones(2).sum() == 2

        @pytest.mark.skipif(False, reason="needs a GPU")
        def test_gpu_reason_runs_here():
            pass

        @pytest.mark.skipif(True, reason="needs a GPU")
        def test_skipped_here():
            pass

        @pytest.mark.skipif(False, reason="nvcc not found (PATH, /usr/local/cuda/bin)")
        def test_path_is_not_a_gpu_reason():
            pass
    """,
    "helper_probe.py": """
        import torch
        ON_GPU = torch.cuda.is_available()
    """,
    "test_via_helper.py": """
        import helper_probe

        def test_helper():
            assert helper_probe.ON_GPU in (True, False)
    """,
}


@pytest.fixture
def suite(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return tmp_path


def _pytest(suite, *args):
    env = _env(PYTHONPATH=os.pathsep.join([TOOLS, str(suite)]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_tests", "-p", "no:cacheprovider",
                           "-q", *args], cwd=suite, env=env, capture_output=True, text=True, timeout=120)


def test_plugin_keeps_the_device_tests_only(suite):
    p = _pytest(suite, "--device-tests", "--collect-only")
    got = sorted(line for line in p.stdout.splitlines() if "::" in line)
    assert got == ["test_devicey.py::test_sleeps", "test_devicey.py::test_uses_dev",
                   "test_plain.py::test_gpu_reason_runs_here", "test_via_helper.py::test_helper"], p.stdout
    p = _pytest(suite, "--device-tests", "--device-tests-sample", "--collect-only")
    got = sorted(line for line in p.stdout.splitlines() if "::" in line)
    assert got == ["test_devicey.py::test_uses_dev", "test_plain.py::test_gpu_reason_runs_here",
                   "test_via_helper.py::test_helper"], p.stdout


def test_plugin_times_a_test_out_and_writes_one_row_per_test(suite):
    p = _pytest(suite, "--device-tests", "--test-timeout", "1", "--tests-csv", "t.csv")
    assert p.returncode == 1 and "1 failed, 3 passed" in p.stdout, p.stdout
    with open(suite / "t.csv", newline="") as f:
        rows = {r["nodeid"]: r for r in csv.DictReader(f)}
    assert rows["test_devicey.py::test_sleeps"]["outcome"] == "failed"
    assert "TestTimeout" in rows["test_devicey.py::test_sleeps"]["message"]
    assert float(rows["test_devicey.py::test_sleeps"]["seconds"]) < 4, "the 5 s sleep was not cut at 1 s"
    assert rows["test_devicey.py::test_uses_dev"]["outcome"] == "passed"
    assert set(rows) == {"test_devicey.py::test_sleeps", "test_devicey.py::test_uses_dev",
                         "test_plain.py::test_gpu_reason_runs_here", "test_via_helper.py::test_helper"}


def test_forced_forward_forces_its_kernel_for_its_call_only(monkeypatch):
    """The profile's ours-cuda-fused / ours-cuda-state providers: the call sees
    gdn_packed.cuda.chunk.forward_kernel answer the forced kernel, and the rule is back as it was after
    the call, also when the call raises."""
    monkeypatch.syspath_prepend(TOOLS)
    import gpu_check

    from gdn_packed.cuda import chunk as cuda_chunk
    rule = cuda_chunk.forward_kernel
    seen = []

    def call(x):
        seen.append(cuda_chunk.forward_kernel(1, 32, 132))
        if x == "raise":
            raise ValueError("from the call")
        return x

    fused = gpu_check._forced_forward(call, "fused")
    assert fused("ok") == "ok" and seen == ["fused"] and cuda_chunk.forward_kernel is rule
    with pytest.raises(ValueError, match="from the call"):
        fused("raise")
    assert seen == ["fused", "fused"] and cuda_chunk.forward_kernel is rule and rule(1, 32, 132) == "split"
    assert gpu_check._forced_forward(call, "state")("ok") == "ok" and seen[-1] == "state"


def test_ncu_profiles_every_sm90_kernel(monkeypatch):
    """The ncu step's kernel filter names every sm_90a kernel the cuda backend can run (the model's KERNELS:
    the forward's fused kernel and its pair form, state-only, split and its pair form at the anchor; the
    backward's dS pass, its pair form, and the chunk-parallel gradients), not only the Triton ones."""
    import re
    monkeypatch.syspath_prepend(TOOLS)
    import gpu_check

    from bench.sm90 import cuda_chunk
    names = {kernel for _, kernel, _ in cuda_chunk.KERNELS.values()}
    assert len(names) == 8
    for name in names:
        assert any(re.fullmatch(k, name) for k in gpu_check.NCU_KERNELS.split("|")), name
