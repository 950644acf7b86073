"""One prepared device check for a lent GPU (an H200 for about 15 minutes): every step, in order, with
a time budget, results in one folder, a summary table printed last.

    python3 tools/gpu_check.py --out DIR          # on the GPU machine, from the repository root
    python3 tools/gpu_check.py --dry-run          # on a CPU: same steps, interpreter, tiny shapes
    make gpu-check [DRY_RUN=1] [OUT=DIR]          # the same through make

Steps (each a subprocess; step i is killed at the run's start + the sum of the budgets of steps 0..i,
so time an early step leaves is given to the later ones and the whole run ends inside the total):
  env        GPU, driver, python/torch/Triton/CUDA/nvcc/compute-sanitizer versions
  wheels     pip install --no-index the wheels in .whl/ (make gpu-wheels: fla-core) into a temp dir
  build      gdn_packed._C compiled there (setup.py build_ext --inplace); dry run: the _C here loads
  tests      the suite's device tests (tools/gpu_tests.py picks them without naming any) with a
             per-test timeout, 4 pytest-xdist workers where installed, every @triton.autotune on its
             first config (fla-core's tuning is not what the tests check); dry run: the first device
             test of each module
  sanitizer  the CUDA kernels (chunk table, conv fwd+bwd, recurrent, the sm_90a chunked forward with
             its backward: the Triton one with the sm_90a dS pass and chunk-parallel gradients; the
             sm_90a backward's dS pass against the Triton one) and one Triton
             chunked forward+backward, small packed cases, run
             plainly, under compute-sanitizer memcheck and racecheck; dry run: plainly, on CPU. On a
             GPU a probe first runs the sm_90a forward on one 64-token sequence with a timeout; if it
             hangs, _C is rebuilt with the barrier watchdog (GDN_PACKED_SM90_WATCHDOG) and the probe
             rerun: the lines of its trap name the stuck mbarrier waits; the later runs and steps then
             leave the forward out (HUNG_ENV)
  graph      CUDA-graph capture and replay of the chunked op's forward+backward over a packing, under
             torch.cuda.set_sync_debug_mode("error"), replay against eager on new data
  bench      python -m bench on the GPU suite's headline cases (one invocation each, merged);
             ours against fla-core where importable; dry run: a tiny CPU case
  profile    each kernel's device time (torch.profiler) at the sm_90 model's three shapes, ours-triton,
             ours-cuda (and ours-cuda-fused, ours-cuda-state where ours-cuda runs the split kernel) and
             fla, forward and backward: what `python -m bench kernels` estimates per kernel
  ncu        Nsight Compute on one launch of each of our chunk-parallel kernels, the state pass and the
             sm_90a forward and backward kernels at the anchor (memory throughput, stall reasons,
             occupancy); dry run: skipped
Files in --out (at most 8, one folder): summary.csv, summary.json, gpu_check.log (every step's
output), tests.csv (one row per test), bench.csv, bench.json, kernels.csv (one row per kernel),
ncu.csv. Exit status 0 when no step failed or
ran out of time (a step that cannot run here is 'skipped' with the reason).
"""
import argparse
import contextlib
import csv
import datetime as dt
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
WHEELS = os.path.join(ROOT, ".whl")

# (name, budget on the GPU, budget in a dry run), seconds; the GPU budgets add up to 9 minutes
# (a dry run needs ~45 s of CPU; its budgets leave room for a CPU shared with other jobs)
STEPS = [("env", 15, 30), ("wheels", 15, 10), ("build", 100, 30), ("tests", 150, 120),
         ("sanitizer", 60, 40), ("graph", 25, 40), ("bench", 80, 60), ("profile", 50, 60), ("ncu", 45, 30)]

# bench step: (scenario, modes), most important first (the anchor shape)
BENCH_JOBS = [("B1_T32768_H16x32_K128_V128", "fwd,fwdbwd"),
              ("QWEN3NEXT_PACK_L4096_MB2_DOC1000_H16x32_K128_V128", "fwd,fwdbwd"),
              ("N32_L1024_H16x32_K128_V128", "fwd,fwdbwd"),
              ("QWEN3NEXT_DECODE_N256_H16x32_K128_V128", "fwd"),
              ("B1_T32768_H16x32_K128_V128_D8192", "fwd,fwdbwd")]
DRY_BENCH_JOBS = [("TINY_PACK_L128_MB1_DOC40_H1x2_K32_V32", "fwd")]
GRACE_S = 3          # a process over its budget gets SIGINT this long before its deadline, then SIGKILL
# the sanitizer step's probe of the sm_90a forward (one 64-token sequence; it hung on an H200, 2026-12-04):
# its timeout, and the spin count of the watchdog build made when it hangs (GDN_PACKED_SM90_WATCHDOG:
# each stuck waiter prints at this many failed try_waits and traps at twice it; the probe's legitimate
# waits are microseconds, and what one failed try_wait takes - the hardware's suspend limit - is not
# known: a small count keeps the trap inside the rerun's timeout even at ~10 us a try_wait); HUNG_ENV=1 in
# the steps' environment after a hung probe: the cases and the bench step leave the sm_90a forward out
HUNG_ENV = "GDN_GPU_CHECK_CUDA_FORWARD_HUNG"
PROBE_S, WATCHDOG_SPINS = 25, 200000
OUT_FILES = ("summary.csv", "summary.json", "gpu_check.log", "tests.csv", "bench.csv", "bench.json", "kernels.csv",
             "ncu.csv")
# the ncu step: our chunk-parallel kernels (1.8-2.8x the model on the second H200 run, 2026-12-04), the
# sequential state pass for contrast (one launch of each in one forward+backward at the anchor), the
# sm_90a forward (the fused kernel 1.76x its model; at the anchor now the split kernel) and the sm_90a
# backward's kernels (the reverse dS pass; its form on GVA pairs and the chunk-parallel gradients, neither
# run on a GPU yet)
NCU_KERNELS = ("chunk_fwd_prep_kernel|chunk_fwd_state_kernel|chunk_bwd_p_kernel|chunk_bwd_dq_kernel|"
               "chunk_bwd_a_kernel|chunk_bwd_dk_kernel|chunk_bwd_finalize_kernel|chunk_gdr_fwd_sm90_kernel|"
               "chunk_gdr_fwd_sm90_pair_kernel|"
               "chunk_gdr_fwd_sm90_state_kernel|chunk_gdr_fwd_sm90_split_kernel|chunk_gdr_fwd_sm90_split_pair_kernel|"
               "chunk_gdr_bwd_sm90_kernel|chunk_gdr_bwd_sm90_pair_kernel|chunk_gdr_grads_sm90_kernel")
NCU_LAUNCHES = 15       # one of each above in one Triton forward + backward (the state kernel three times),
                        # then one cuda forward + backward: the split kernel (at the anchor's GVA pairs: its
                        # pair form), the recompute (the state kernel), the dS pass (at the anchor's GVA
                        # pairs: its pair form), the gradients, finalize
NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "LaunchStats", "Occupancy",
                "SchedulerStats")
# what the sections above do not break down (the second H200 session: prep, dq and dk had L1/TEX 50-77%
# busy, 3.4-4.3x the conflict-free shared-memory wavefronts the model counts): the shared wavefronts and
# bank conflicts by loads / stores, the instructions that made them, the global traffic through L1, and
# each stall reason per issued instruction
NCU_METRICS = tuple(
    [f"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{o}.sum" for o in ("ld", "st")]
    + [f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{o}.sum" for o in ("ld", "st")]
    + [f"smsp__sass_inst_executed_op_shared_{o}.sum" for o in ("ld", "st")]
    + ["smsp__sass_inst_executed_op_ldsm.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
       "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum"]
    + [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in (
        "barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "lg_throttle", "math_pipe_throttle",
        "wait", "membar", "not_selected", "dispatch_stall", "no_instruction", "branch_resolving", "sleeping",
        "tex_throttle", "drain", "misc", "selected")])


# ---------------------------------------------------------------------------------------- run steps
class Run:
    def __init__(self, out, dry, budgets, log):
        self.out, self.dry, self.log = out, dry, log
        self.t0 = time.monotonic()
        self.budgets = budgets
        self.total = sum(budgets.values())
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        paths = [ROOT, TOOLS] + [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env["PYTHONPATH"] = os.pathsep.join(paths)
        if dry:   # one CPU thread per process: on a busy shared CPU more threads only fight (bench/NOTES.md)
            self.env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                            MKL_NUM_THREADS="1")
        self.results = []
        self.deadline = self.t0

    def elapsed(self):
        return time.monotonic() - self.t0

    def left(self):
        return self.deadline - time.monotonic()

    def sh(self, cmd, *, env=None, timeout=None):
        """Run cmd (list) in its own process group, output to the log; (returncode or None on timeout,
        output text). Never runs past the current step's deadline."""
        limit = self.left() if timeout is None else min(timeout, self.left())
        self.log.write(f"\n$ {' '.join(cmd)}\n")
        self.log.flush()
        if limit <= 0.5:
            self.log.write("(not started: no time left in this step)\n")
            return None, ""
        try:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        except OSError as e:
            self.log.write(f"(could not start: {e})\n")
            return 127, str(e)
        try:
            out, _ = p.communicate(timeout=max(limit - GRACE_S, 0.5))
            rc = p.returncode
        except subprocess.TimeoutExpired:
            # SIGINT first (pytest then reports what ran), SIGKILL after the grace period
            os.killpg(p.pid, signal.SIGINT)
            try:
                out, _ = p.communicate(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
            out += f"\n(stopped after {limit:.0f} s: the step's time budget)\n"
            rc = None
        self.log.write(out)
        self.log.flush()
        return rc, out

    def py(self, *args, **kw):
        return self.sh([sys.executable] + list(args), **kw)

    def step(self, name, fn):
        start = self.elapsed()
        names = list(self.budgets)
        self.deadline = self.t0 + sum(self.budgets[n] for n in names[:names.index(name) + 1])
        self.log.write(f"\n{'=' * 30} step {name} (deadline {self.deadline - self.t0:.0f} s)\n")
        if self.left() <= 0.5:
            status, note, details = "skipped", "no time left", {}
        else:
            try:
                status, note, details = fn(self)
            except Exception as e:  # noqa: BLE001  (one broken step must not stop the others)
                status, note, details = "fail", f"{type(e).__name__}: {e}", {}
        if status != "timeout" and self.left() < 0:
            status, note = "timeout", note + " (over budget)"
        secs = self.elapsed() - start
        self.results.append({"step": name, "status": status, "seconds": round(secs, 1),
                             "budget_s": self.budgets[name], "note": note, "details": details})
        print(f"[{self.elapsed():6.1f} s] {name:<9} {status:<7} {secs:6.1f} s  {note}", flush=True)


def _first_line(text, pattern):
    m = re.search(pattern, text, re.MULTILINE)
    return m.group(1).strip() if m else ""


def _compute_sanitizer():
    return shutil.which("compute-sanitizer") or shutil.which("compute-sanitizer", path="/usr/local/cuda/bin") or ""


def step_env(r):
    info = {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "host_python": sys.version.split()[0], "dry_run": r.dry}
    probe = ("import json, platform, torch\n"
             "d = {'python': platform.python_version(), 'torch': torch.__version__,"
             " 'torch_cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available()}\n"
             "try:\n import triton; d['triton'] = triton.__version__\n"
             "except ImportError: d['triton'] = None\n"
             "if torch.cuda.is_available():\n"
             " p = torch.cuda.get_device_properties(0)\n"
             " d.update(gpu=p.name, capability='%d.%d' % (p.major, p.minor), sms=p.multi_processor_count,"
             " gpu_mem_gib=round(p.total_memory / 2**30, 1))\n"
             "print('ENV ' + json.dumps(d))\n")
    rc, out = r.py("-c", probe, timeout=60)
    if rc == 0:
        info.update(json.loads(_first_line(out, r"^ENV (.*)$")))
    smi = shutil.which("nvidia-smi")
    if smi:
        _, out = r.sh([smi, "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                       "--format=csv,noheader"], timeout=20)
        info["nvidia_smi"] = out.strip().splitlines()[0] if out.strip() else ""
        info["driver"] = info["nvidia_smi"].split(",")[1].strip() if info["nvidia_smi"].count(",") else ""
    nvcc = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))
    if nvcc:
        _, out = r.sh([nvcc, "--version"], timeout=20)
        info["nvcc"] = _first_line(out, r"release ([^,\n]+)")
    san = _compute_sanitizer()
    info["compute_sanitizer"] = san
    if san:
        _, out = r.sh([san, "--version"], timeout=20)
        info["compute_sanitizer_version"] = _first_line(out, r"Version ([^\n]+)")
    r.info = info
    line = (f"{info.get('gpu', 'no GPU')} | driver {info.get('driver', '-')} | python {info.get('python', '?')} "
            f"| torch {info.get('torch', '?')} (CUDA {info.get('torch_cuda')}) | triton {info.get('triton')} "
            f"| nvcc {info.get('nvcc', '-')}")
    if rc != 0:
        return "fail", "python cannot import torch: " + line, info
    if not r.dry and not info.get("cuda_available"):
        return "fail", "torch sees no GPU: " + line, info
    return "ok", line, info


def step_wheels(r):
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    if not wheels:
        return "skipped", "no wheels in .whl/ (make gpu-wheels prepares them): fla rows will be skipped", {}
    site = os.path.join(r.tmp, "site")
    rc, out = r.py("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--disable-pip-version-check", "--target", site, *wheels)
    if rc != 0:
        return ("timeout" if rc is None else "fail"), "pip install --no-index failed: " + out.strip()[-200:], {}
    r.env["PYTHONPATH"] += os.pathsep + site        # after the repo: the image's packages stay first
    names = [os.path.basename(w).split("-")[0] for w in wheels]
    rc, out = r.py("-c", "import fla; print('FLA', fla.__version__)", timeout=60)
    fla = _first_line(out, r"^FLA (.*)$")
    return "ok", f"installed {', '.join(names)}; fla {'importable: ' + fla if fla else 'NOT importable'}", \
        {"wheels": names, "fla": fla}


def step_build(r):
    check = ("from gdn_packed import _cext\n"
             "C = _cext.get_C() if _cext.built() else None\n"
             "print('BUILT', _cext.built(), getattr(C, 'cuda_archs', None), '|', _cext.cuda_available(), '|',"
             " _cext.cuda_unavailable_reason() or 'ok', '|',"
             " 'prep arrivals', getattr(C, 'sm90_prep_arrivals', None), '|',"   # 128: GDN_PACKED_SM90_PREP_ARRIVALS
             " 'sm_90a chunked kernels missing: ' + (getattr(C, 'chunk_gdr_fwd_sm90_missing', '') or 'none'))\n")
    if r.dry:
        rc, out = r.py("-c", check, timeout=60)
        line = _first_line(out, r"^BUILT (.*)$")
        return ("ok" if rc == 0 else "fail"), "dry run: no compile; the _C here: " + line, {"C": line}
    env = dict(r.env, GDN_PACKED_CUDA_ARCHS=os.environ.get("GDN_PACKED_CUDA_ARCHS", "80;90a"))
    rc, out = r.py("setup.py", "build_ext", "--inplace", env=env)
    if rc != 0:
        return ("timeout" if rc is None else "fail"), "setup.py build_ext failed: " + out.strip()[-200:], {}
    rc, out = r.py("-c", check, timeout=60)
    line = _first_line(out, r"^BUILT (.*)$")
    # without the CUTLASS headers (the nvidia-cutlass wheel: the wheels step) the sm_90a kernels are left out
    # and every check of them would skip: a failed build for this check
    ok = rc == 0 and line.startswith("True") and "| True |" in line and line.endswith("missing: none")
    return ("ok" if ok else "fail"), "built for " + env["GDN_PACKED_CUDA_ARCHS"] + ": " + line, {"C": line}


def step_tests(r):
    csv_path = os.path.join(r.out, "tests.csv")
    per_test = 60
    args = ["-m", "pytest", "-q", "-p", "gpu_tests", "--device-tests", "--test-timeout", str(per_test),
            "--tests-csv", csv_path, "-p", "no:cacheprovider", "-o", "addopts=", "tests"]
    if r.dry:   # a smoke sample; the bench CLI's tests are left to the bench step
        args[-1:] = ["--device-tests-sample", "--ignore", "tests/test_bench.py", "tests"]
    else:
        args[-1:] = ["--autotune-first-config", "tests"]
        if _has_module("xdist"):
            workers = str(max(1, min(8, (os.cpu_count() or 2) // 2)))
            args += ["-n", workers, "--dist", "loadfile"]   # one GPU, several processes: compile in parallel
    rc, out = r.py(*args)
    rows = _read_csv(csv_path)
    counts = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    cuda = sum(1 for row in rows if int(row["cuda_allocs"] or 0) > 0)
    trit = sum(1 for row in rows if int(row["triton_launches"] or 0) > 0)
    summary = _first_line(out, r"^=*\s*(\d+ (?:passed|failed|error|skipped).*?)\s*=*$") or "no pytest summary"
    note = f"{summary}; {cuda} used CUDA memory, {trit} launched Triton kernels"
    failed = [row["nodeid"] for row in rows if row["outcome"] in ("failed", "error")]
    details = {"counts": counts, "used_cuda": cuda, "launched_triton": trit, "failed": failed[:50]}
    for nodeid in failed[:15]:                     # the ids reach the output's tail; all are in tests.csv
        print(f"  tests: FAILED {nodeid}", flush=True)
    if rc is None:
        return "timeout", note, details
    if not r.dry and rows and cuda == 0:
        return "fail", note + " (no test touched the GPU)", details
    return ("ok" if rc == 0 else "fail"), note, details


def _forward_probe(r):
    """The sm_90a forward on one 64-token sequence in a child, PROBE_S at most: (hung, note, details).
    On a hang (the child timed out) _C is rebuilt with the barrier watchdog and the probe rerun: each
    mbarrier wait stuck for WATCHDOG_SPINS failed try_waits prints a GDN_SM90_WATCHDOG line (the call site,
    the chunk step, CTA, cluster rank, warp, barrier address, parity) and then traps; no line and a second
    timeout means the stuck wait is not an mbarrier's (a named or cluster barrier, setmaxnreg). The
    forward is then left out of the rest of the run (HUNG_ENV=1 in the steps' environment)."""
    res = os.path.join(r.tmp, "probe.json")
    rc, out = r.py(os.path.abspath(__file__), "case", "probe", "--json", res, timeout=PROBE_S)
    if rc is not None:
        d = _read_json(res)
        return False, "forward probe: " + (d.get("note") or _last_lines(out)), d
    d = {"hung": True}
    note = f"forward probe HUNG (no finish in {PROBE_S} s)"
    r.env[HUNG_ENV] = "1"
    env = dict(r.env, GDN_PACKED_SM90_WATCHDOG=str(WATCHDOG_SPINS),
               GDN_PACKED_CUDA_ARCHS=os.environ.get("GDN_PACKED_CUDA_ARCHS", "80;90a"))
    rc, out = r.py("setup.py", "build_ext", "--inplace", env=env)
    if rc != 0:
        d["watchdog_build"] = "out of time" if rc is None else _last_lines(out)
        return True, note + "; watchdog build " + ("out of time" if rc is None else "FAILED: " + _last_lines(out)), d
    rc, out = r.py(os.path.abspath(__file__), "case", "probe", "--json", res,
                   env=env, timeout=PROBE_S + 20)
    lines = sorted(set(re.findall(r"^GDN_SM90_WATCHDOG: .*$", out, re.MULTILINE)))
    d.update(watchdog_spins=WATCHDOG_SPINS, watchdog_rc=rc, watchdog_lines=lines[:64])
    for line in lines[:24]:                         # to the output's tail; all are in gpu_check.log
        print("  sanitizer: " + line, flush=True)
    if lines:
        sites = sorted({re.sub(r", it -?\d+:.*", "", x[len("GDN_SM90_WATCHDOG: "):]) for x in lines})
        return True, note + f"; watchdog build: {len(lines)} stuck waits: " + " | ".join(sites), d
    return True, note + ("; watchdog build hung too, no line: not an mbarrier wait (named / cluster barrier, "
                         "setmaxnreg)" if rc is None else f"; watchdog build: exit {rc}, no line: "
                         + _last_lines(out)), d


def step_sanitizer(r):
    details, notes = {}, []
    hung = False
    if not r.dry:
        hung, note, details["probe"] = _forward_probe(r)
        notes.append(note)
    res = os.path.join(r.tmp, "case.json")
    rc, out = r.py(os.path.abspath(__file__), "case", "sanitize", "--json", res)
    details["plain"] = _read_json(res)
    if rc is None:
        return "timeout", "; ".join(notes + ["out of time in the plain run (before the sanitizer)"]), details
    if rc != 0:
        return "fail", "; ".join(notes + ["the cases fail without the sanitizer: " + _last_lines(out)]), details
    notes.append("cases ran: " + ", ".join(details["plain"].get("ran", [])))
    skipped = details["plain"].get("skipped", [])
    if skipped:
        notes.append("not run: " + "; ".join(skipped))
    san = r.info.get("compute_sanitizer") or _compute_sanitizer()     # (found here too when --only leaves env out)
    if r.dry or not san:
        notes.append("compute-sanitizer " + ("not used in a dry run" if r.dry else "not found"))
        return ("ok" if r.dry else "fail"), "; ".join(notes), details
    status = "fail" if hung else "ok"
    for tool, extra, env in (("memcheck", ["--leak-check", "no"], {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}),
                             ("racecheck", ["--racecheck-report", "hazard"], {})):
        cmd = [san, "--tool", tool, *extra, "--error-exitcode", "9", "--print-limit", "20",
               sys.executable, os.path.abspath(__file__), "case", "sanitize"]
        rc, out = r.sh(cmd, env=dict(r.env, **env))
        summary = _first_line(out, r"((?:ERROR|RACECHECK) SUMMARY:[^\n]*)") or _last_lines(out, 1)
        details[tool] = {"rc": rc, "summary": summary}
        notes.append(f"{tool}: {summary}" if rc is not None else f"{tool}: out of time")
        if rc is None:
            status = "timeout"
        elif rc != 0 and status == "ok":
            status = "fail"
    return status, "; ".join(notes), details


def step_graph(r):
    res = os.path.join(r.tmp, "graph.json")
    rc, out = r.py(os.path.abspath(__file__), "case", "graph", "--json", res)
    d = _read_json(res)
    if rc is None:
        return "timeout", "out of time", d
    if rc != 0:
        return "fail", d.get("note") or _last_lines(out), d
    return d.get("status", "fail"), d.get("note", ""), d


def _gpu_providers(hung):
    """The providers timed on a GPU: ours-cuda left out after a hung probe of its forward."""
    return "ours-triton,fla" if hung else "ours-triton,ours-cuda,fla"


def step_bench(r):
    tmp = os.path.join(r.tmp, "bench")
    jobs = DRY_BENCH_JOBS if r.dry else BENCH_JOBS
    extra = (["--device", "cpu", "--repeats", "3", "--warmup", "0", "--budget-s", "1", "--providers", "ours-torch",
              "--no-memory"] if r.dry else ["--providers", _gpu_providers(r.env.get(HUNG_ENV) == "1")])
    done, notes = [], []
    for scenario, modes in jobs:
        rc, out = r.py("-m", "bench", "--scenarios", scenario, "--modes", modes, "--out",
                       os.path.join(tmp, scenario), *extra)
        state = "ok" if rc == 0 else ("out of time" if rc is None else f"exit {rc}")
        done.append((scenario, state))
        if rc is None:
            break
    rows, meta = [], {}
    for path in sorted(glob.glob(os.path.join(tmp, "*", "*.json"))):
        data = _read_json(path)
        rows += data.get("rows", [])
        meta = meta or data.get("meta", {})
    if rows:
        with open(os.path.join(r.out, "bench.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(r.out, "bench.json"), "w") as f:
            json.dump({"meta": dict(meta, suite="gpu_check"), "rows": rows}, f, indent=1)
    headline = _bench_headline(rows)
    bad = [f"{s}: {st}" for s, st in done if st != "ok"]
    failed_rows = sorted({f"{x['scenario']} {x['provider']} {x['mode']}" for x in rows if x.get("status") == "failed"})
    notes.append(f"{len(done)}/{len(jobs)} scenarios, {len(rows)} rows")
    if bad:
        notes.append("; ".join(bad))
    if failed_rows:
        notes.append("FAILED rows: " + "; ".join(failed_rows[:6]))
    status = "timeout" if any(st == "out of time" for _, st in done) else (
        "fail" if bad or failed_rows or not rows else "ok")
    return status, "; ".join(notes), {"jobs": done, "headline": headline}


def step_ncu(r):
    """Nsight Compute on one launch of each of NCU_KERNELS (ours-triton, the anchor, forward+backward):
    DRAM / L2 throughput and bytes, warp stall reasons, occupancy, as ncu's CSV (ncu.csv). ncu reads
    the counters on the Firecracker machines (--clock-control none: the clocks are left alone)."""
    if r.dry:
        return "skipped", "dry run: no ncu (nothing to profile on a CPU)", {}
    ncu = shutil.which("ncu") or shutil.which("ncu", path="/usr/local/cuda/bin")
    if not ncu:
        return "skipped", "ncu not found", {}
    cmd = [ncu, "--clock-control", "none", "--kernel-name", f"regex:{NCU_KERNELS}",
           "--launch-count", str(NCU_LAUNCHES), "--csv", "--page", "details"]
    for sec in NCU_SECTIONS:
        cmd += ["--section", sec]
    case = [sys.executable, os.path.abspath(__file__), "case", "ncu"]
    rc, out = r.sh(cmd + ["--metrics", ",".join(NCU_METRICS)] + case)
    dropped = rc not in (0, None) and re.search(r"metric", out, re.IGNORECASE)
    if dropped:     # a metric name this ncu does not know fails the whole run: again with the sections only
        rc, out = r.sh(cmd + case)
    rows = [line for line in out.splitlines() if line.startswith('"')]
    with open(os.path.join(r.out, "ncu.csv"), "w") as f:
        f.write("\n".join(rows) + "\n")
    kernels = sorted({m.group(1) for m in re.finditer(r'(chunk_\w+_kernel)', "\n".join(rows))})
    note = f"{len(rows)} ncu rows: {', '.join(kernels) or 'no kernel profiled'}"
    if dropped:
        note += "; NCU_METRICS refused (sections only)"
    if rc is None:
        return "timeout", note, {}
    return ("ok" if rc == 0 and rows else "fail"), note + ("" if rc == 0 else f"; exit {rc}: {_last_lines(out)}"), {}


def step_profile(r):
    res = os.path.join(r.tmp, "profile.json")
    rc, out = r.py(os.path.abspath(__file__), "case", "profile", "--json", res, "--csv",
                   os.path.join(r.out, "kernels.csv"))
    d = _read_json(res)
    ran = len(re.findall(r"^PROFILE \S+ \S+ \S+:", out, re.MULTILINE))
    if rc is None:
        return "timeout", f"out of time after {ran} (shape, provider, mode) profiled (kernels.csv keeps them)", d
    if rc != 0:
        return "fail", d.get("note") or _last_lines(out), d
    return d.get("status", "fail"), d.get("note", ""), d


def _bench_headline(rows):
    """[(scenario, mode, layout, {provider: p50 ms})] of the 'time' rows."""
    table = {}
    for x in rows:
        if x.get("metric") != "time" or x.get("status") != "ok" or x.get("p50") in (None, ""):
            continue
        key = (x["scenario"], x["mode"], x["layout"])
        table.setdefault(key, {})[x["provider"]] = round(float(x["p50"]) * 1e3, 3)
    return [[*k, v] for k, v in table.items()]


# ---------------------------------------------------------------------------------- the device cases
def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case_shape(dev, lengths, gaps):
    """(dtype, K = V, lengths, gaps, backend): bf16, K = 64 and the Triton backend on a GPU; on a CPU (a dry
    run) fp32, K = 16, short sequences and the torch backend, to keep the dry run short (the same
    layout: zero-length and single-token sequences, padding gaps)."""
    import torch
    if dev.type == "cuda":
        return torch.bfloat16, 64, lengths, gaps, "triton"
    return torch.float32, 16, [min(n, 9) for n in lengths], gaps, "torch"


def _packed_inputs(dev, dtype, lengths, gaps, H, HV, K, V, seed, requires_grad):
    from gdn_packed.testing import gdr_inputs, layout
    cu, cu_pad, rows = layout(lengths, gaps=gaps, tail=3)
    q, k, v, g, beta, h0 = gdr_inputs(rows, H, HV, K, V, dtype, N=len(lengths), seed=seed, initial_state=True,
                                      unit_k=False, device=dev)
    xs = [x.detach().requires_grad_(requires_grad) for x in (q, k, v, g, beta, h0)]
    return xs, cu.to(dev), cu_pad.to(dev), rows


def case_sanitize():
    """Small packed cases of every CUDA kernel and one Triton chunked forward+backward."""
    import torch
    import torch.nn.functional as F

    import gdn_packed
    from gdn_packed import _cext
    from gdn_packed.ops.chunk_table import build_chunk_table
    dev = _device()
    ran, skipped = [], []
    dtype, K, lengths, gaps, backend = _case_shape(dev, [1, 63, 130, 0, 65], [2, 0, 5, 1, 0])
    V = K
    (q, k, v, g, beta, h0), cu, cu_pad, rows = _packed_inputs(dev, dtype, lengths, gaps, 1, 2, K, V, 0, True)
    o, ht = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                                              use_qk_l2norm_in_kernel=True, backend=backend)
    grads = torch.autograd.grad((o.float().square().sum() + ht.square().sum()), (q, k, v, g, beta, h0))
    assert all(torch.isfinite(x).all() for x in (o, ht, *grads)), "non-finite Triton output or gradient"
    ran.append(f"{backend} chunk fwd+bwd")
    cuda_ok = dev.type == "cuda" and _cext.cuda_available()
    if not cuda_ok:
        skipped.append("CUDA kernels: " + (_cext.cuda_unavailable_reason() or "no GPU"))
    else:
        table, cu_chunks = build_chunk_table(cu, cu_pad, rows, 64)
        assert int(cu_chunks[-1]) <= table.shape[0]
        ran.append("chunk table")
        x = torch.randn(1, rows, 96, device=dev, dtype=dtype, requires_grad=True)
        w = torch.randn(96, 4, device=dev, dtype=dtype, requires_grad=True)
        y, _ = gdn_packed.causal_conv1d_varlen(x, w, activation="silu", cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                                               output_final_state=True, backend="cuda")
        dx, dw = torch.autograd.grad(y.float().square().sum(), (x, w))
        assert torch.isfinite(dx).all() and torch.isfinite(dw).all(), "non-finite conv gradient"
        ran.append("conv fwd+bwd")
        pool = torch.randn(6, 2, K, V, device=dev)
        idx = torch.tensor([4, -1, 0], device=dev)
        one = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=dev)
        qd, kd = torch.randn(1, 3, 1, K, device=dev, dtype=dtype), torch.randn(1, 3, 1, K, device=dev, dtype=dtype)
        vd = torch.randn(1, 3, 2, V, device=dev, dtype=dtype)
        gd, bd = F.logsigmoid(torch.randn(1, 3, 2, device=dev)), torch.rand(1, 3, 2, device=dev)
        od, _ = gdn_packed.fused_recurrent_gated_delta_rule(qd, kd, vd, gd, bd, cu_seqlens=one, initial_state=pool,
                                                            state_indices=idx, output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True, backend="cuda")
        assert torch.isfinite(od).all() and torch.isfinite(pool).all(), "non-finite recurrent output"
        ran.append("recurrent fwd (state pool)")
        ran += _case_cuda_chunk(dev, skipped)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"status": "ok", "ran": ran, "skipped": skipped}


def _cuda_forward_refusal(q, v, dev):
    """Why a case here leaves the sm_90a forward out (this run's probe hung: HUNG_ENV; or
    gdn_packed.cuda.chunk.refusal's reason), else None."""
    from gdn_packed.cuda.chunk import refusal
    return "it hung in this run's probe" if os.environ.get(HUNG_ENV) == "1" else refusal(q, v, dev)


def _case_cuda_chunk(dev, skipped):
    """On a small packing with zero-length, single-token and partial chunks and gaps (K = V = 128, bf16):
    the backward's sm_90a dS pass (on Triton prep), then, where refusal() lets it run and this run's probe
    did not hang (HUNG_ENV), the sm_90a chunked forward (backend="cuda") and the backward through it (its
    sm_90a dS pass and chunk-parallel gradients): finite, o within the bf16 budget of Triton's."""
    import torch

    import gdn_packed
    from gdn_packed.testing import rel_err
    (q, k, v, g, beta, h0), cu, cu_pad, _ = _packed_inputs(dev, torch.bfloat16, [1, 63, 130, 0, 65], [2, 0, 5, 1, 0],
                                                           1, 2, 128, 128, 3, True)
    from gdn_packed import _cext
    ran = []
    if hasattr(_cext.get_C(), "chunk_gdr_bwd_sm90"):     # the dS pass runs on Triton prep: not on the forward
        ran.append(_case_cuda_dstate(q, k, v, g, beta, cu, cu_pad))
    why = _cuda_forward_refusal(q, v, dev)
    if why is not None:
        skipped.append(f"cuda chunked forward: {why}")
        return ran
    outs = {}
    for backend, kernel in [("cuda", k) for k in ("fused", "split", "state")] + [("triton", None)]:
        with _forward_kernel(kernel):
            o, ht = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                                                      use_qk_l2norm_in_kernel=True, backend=backend)
            grads = torch.autograd.grad((o.float().square().sum() + ht.square().sum()), (q, k, v, g, beta, h0))
        assert all(torch.isfinite(x).all() for x in (o, ht, *grads)), f"non-finite {backend} output or gradient"
        outs[backend, kernel] = o.detach()
    for kernel, name in (("fused", "fused"), ("split", "split"), ("state", "Triton prep + state-only")):
        err = rel_err(outs["cuda", kernel], outs["triton", None].double())
        assert err <= 2e-2, f"cuda chunked forward ({name}) {err:.2e} from the Triton forward"
        ran.append(f"cuda chunk fwd (sm_90a, {name}) + Triton bwd (o {err:.1e} from triton)")
    return ran


def _forced_forward(call, kernel):
    """call (a bench.gdr provider) with backend='cuda''s forward kernel `kernel` forced."""
    def run(*args, **kw):
        with _forward_kernel(kernel):
            return call(*args, **kw)
    return run


def _picks_split(N, H, HV, dev):
    """Whether backend='cuda' runs the split forward kernel for N sequences of H / HV heads on dev (either
    form: as its clusters fit there)."""
    from gdn_packed.cuda.chunk import _kernel
    return _kernel(dev, N, H, HV, None)[0] == "split"


@contextlib.contextmanager
def _forward_kernel(kernel):
    """backend="cuda"'s forward kernel forced for the block (one of gdn_packed.cuda.chunk.KERNELS); None:
    as gdn_packed.cuda.chunk.forward_kernel picks."""
    from gdn_packed.cuda import chunk as cuda_chunk
    real = cuda_chunk.forward_kernel
    if kernel is not None:
        cuda_chunk.forward_kernel = lambda *a: kernel
    try:
        yield
    finally:
        cuda_chunk.forward_kernel = real


def _case_cuda_dstate(q, k, v, g, beta, cu, cu_pad):
    """The backward's sm_90a reverse dS pass (csrc/chunk_gdr_bwd_sm90.cu) and the Triton pass it replaces
    on the same Triton prep: finite, dv and dh0 within the bf16 gradient budget of each other."""
    import torch

    from gdn_packed.cuda.chunk import chunk_bwd_dstate_cuda
    from gdn_packed.ops.chunk_table import make_chunk_table
    from gdn_packed.testing import rel_err
    from gdn_packed.triton.chunk import _rows, chunk_bwd_dstate, chunk_fwd_prep
    from gdn_packed.triton.configs import bwd_configs
    q, k, v, g, beta = (x.detach()[0] for x in (q, k, v, g, beta))
    (T, H, K), HV, N = q.shape, v.shape[1], cu.numel() - 1
    table, cc = make_chunk_table(cu, cu_pad, T, 64)
    q, k, v, g, beta, r = _rows(q, k, v, g, beta)
    prep = chunk_fwd_prep(q, k, g, beta, table, HV, K ** -0.5, True, r)
    do, dht = torch.randn_like(v), torch.randn(N, HV, K, K, device=q.device)
    outs = []
    for run in ("cuda", "triton"):
        o = dict(dsn=torch.empty(table.shape[0], HV, K, K, dtype=q.dtype, device=q.device),
                 dxp=torch.empty(table.shape[0], HV, K, 64, dtype=q.dtype, device=q.device),
                 dv=torch.empty_like(v), dh0=torch.empty_like(dht), dq=torch.empty_like(q), dk=torch.empty_like(k),
                 dg=torch.empty_like(g), dbeta=torch.empty_like(beta))
        if run == "cuda":
            chunk_bwd_dstate_cuda(q, k, do, table, cc, prep, dht, **o)
        else:
            chunk_bwd_dstate(q, k, do, table, cc, prep, r, dht, **o, cfg=bwd_configs(K, K, q.dtype)["dstate"])
        assert torch.isfinite(o["dv"]).all() and torch.isfinite(o["dh0"]).all(), f"non-finite {run} dS pass"
        outs.append(o)
    errs = {n: rel_err(outs[0][n], outs[1][n].double()) for n in ("dv", "dh0")}
    assert max(errs.values()) <= 2.5e-2, f"cuda dS pass from the Triton one: {errs}"
    return f"cuda dS pass (sm_90a) vs Triton's (dv {errs['dv']:.1e}, dh0 {errs['dh0']:.1e})"


PROFILE_SHAPES = [("1x32768", [32768]), ("4x8192", [8192] * 4), ("32x1024", [1024] * 32)]


def case_profile(csv_path=None, providers=None, shapes=None):
    """Each kernel's device time, per call of the chunked op, at the sm_90 model's three shapes (bf16,
    16/32 heads, K = V = 128): ours-triton, ours-cuda, ours-cuda-fused and ours-cuda-state (backend='cuda'
    with the fused forward kernel, or Triton prep and the state-only one, forced, at the shapes where
    forward_kernel picks the split kernel for ours-cuda: the comparison that sets its rule) and fla, forward (no grad) and backward (the
    autograd backward alone, from a kept graph), under torch.profiler: 2 warm-up calls, 3 profiled,
    each kernel's time / 3; the configs FLA's autotuner chose (autotuned_configs) in the result. Rows go to csv_path as each (shape, provider, mode) finishes (an out-of-time
    stop keeps what ran); a '(all kernels)' row per (shape, provider, mode) holds their sum and the
    call's wall time between CUDA events (its gaps are launch and host time; below the sum where kernels
    overlap: ours-cuda's backward runs its recompute beside its dS pass on a side stream, each then
    slower than alone, and its wall time is the figure to compare). Dry run: ours-torch on a
    tiny shape, CPU self times."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench import gdr
    from bench.common import Skip, grad_fn
    dev = _device()
    gpu = dev.type == "cuda"
    if gpu:
        os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"   # FLA's own kernels, not FlashQLA's
        shapes = [x for x in PROFILE_SHAPES if shapes is None or x[0] in shapes.split(",")]
        hung = os.environ.get(HUNG_ENV) == "1"
        providers = (providers or _gpu_providers(hung).replace("ours-cuda", "ours-cuda,ours-cuda-fused,ours-cuda-state")
                     ).split(",")
        H, HV, K = 16, 32, 128
        dtype, activity, kind = torch.bfloat16, ProfilerActivity.CUDA, torch.autograd.DeviceType.CUDA
    else:
        shapes, providers, (H, HV, K) = [("1x96", [96])], ["ours-torch"], (1, 2, 32)
        dtype, activity, kind = torch.float32, ProfilerActivity.CPU, torch.autograd.DeviceType.CPU
    calls = {"ours-triton": gdr.ours("triton"), "ours-cuda": gdr.ours("cuda"), "fla": gdr.fla,
             "ours-torch": gdr.ours("torch"), "ours-cuda-fused": _forced_forward(gdr.ours("cuda"), "fused"),
             "ours-cuda-state": _forced_forward(gdr.ours("cuda"), "state")}
    fields = ["shape", "provider", "mode", "kernel", "calls", "us"]
    f = open(csv_path or os.devnull, "w", newline="")
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    done, failed, skipped = [], [], []
    for shape, lengths in shapes:
        for name in providers:
            if name in ("ours-cuda-fused", "ours-cuda-state") and not _picks_split(len(lengths), H, HV, dev):
                continue                          # (ours-cuda runs the fused kernel there)
            try:
                xs, cu = gdr.make_inputs(H, HV, K, K, lengths, dtype, dev, requires_grad=True)
                call = calls[name]

                def fwd():
                    with torch.no_grad():
                        return call(*xs, cu)
                bwd, _ = grad_fn(lambda: call(*xs, cu), xs)
                for mode, fn in (("fwd", fwd), ("bwd", bwd)):
                    for _ in range(2):
                        fn()
                    if gpu:
                        torch.cuda.synchronize()
                        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    t0 = time.perf_counter()
                    with profile(activities=[activity]) as prof:
                        if gpu:
                            ev[0].record()
                        for _ in range(3):
                            fn()
                        if gpu:
                            ev[1].record()
                            torch.cuda.synchronize()
                    wall_us = (ev[0].elapsed_time(ev[1]) * 1e3 if gpu else (time.perf_counter() - t0) * 1e6) / 3
                    rows = []
                    for e in prof.key_averages():
                        us = getattr(e, "self_device_time_total", None) if gpu else e.self_cpu_time_total
                        if us is None:
                            us = getattr(e, "self_cuda_time_total", 0)
                        if e.device_type == kind and us > 0:
                            rows.append(dict(shape=shape, provider=name, mode=mode, kernel=e.key,
                                             calls=round(e.count / 3, 2), us=round(us / 3, 1)))
                    rows.sort(key=lambda x: -x["us"])
                    total = sum(x["us"] for x in rows)
                    w.writerows(rows + [dict(shape=shape, provider=name, mode=mode, kernel="(all kernels)",
                                             calls=round(sum(x["calls"] for x in rows), 2), us=round(total, 1)),
                                        dict(shape=shape, provider=name, mode=mode, kernel="(wall, CUDA events)",
                                             calls=1, us=round(wall_us, 1))])
                    f.flush()
                    done.append(f"{shape} {name} {mode} {total / 1e3:.3f} ms")
                    print(f"PROFILE {shape} {name} {mode}: kernels {total / 1e3:.3f} ms, wall {wall_us / 1e3:.3f} ms",
                          flush=True)
                del xs, cu
            except Skip as e:
                skipped.append(f"{shape} {name}: {e}")
                print("PROFILE SKIPPED " + skipped[-1], flush=True)
            except Exception as e:  # noqa: BLE001  (one provider's failure must not hide the others)
                failed.append(f"{shape} {name}: {type(e).__name__}: {str(e)[:120]}")
                print("PROFILE FAILED " + failed[-1], flush=True)
            if gpu:
                torch.cuda.empty_cache()
    f.close()
    fla_configs = autotuned_configs()
    for kernel, cfgs in fla_configs.items():
        print(f"PROFILE FLA CONFIG {kernel}: {' | '.join(cfgs)}", flush=True)
    note = f"{len(done)} (shape, provider, mode) profiled" + ("; FAILED: " + "; ".join(failed) if failed else "")
    if skipped:
        note += "; skipped: " + "; ".join(skipped)
    return {"status": "fail" if failed or not done else "ok", "ran": done, "failed": failed, "skipped": skipped,
            "fla_configs": fla_configs, "note": note}


def autotuned_configs(prefix="fla."):
    """{kernel name: sorted [config text]} of every triton Autotuner found in the modules whose name starts
    with `prefix`, from its cache (tuning key -> chosen Config): which configs FLA's autotuner ran, which
    the sm_90 model has to choose blind (bench/NOTES.md, "The model after the H200")."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return {}
    out = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith(prefix) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, Autotuner) and getattr(obj, "cache", None):
                fn = getattr(obj, "base_fn", None) or getattr(obj, "fn", None)
                kernel = getattr(fn, "__name__", repr(fn))
                out.setdefault(kernel, set()).update(str(c) for c in obj.cache.values())
    return {k: sorted(v) for k, v in sorted(out.items())}


def case_probe():
    """The sm_90a chunked forward's probe (gdn_packed.testing.cuda_forward_probe: the launch that hung
    on an H200; tests/test_cuda_chunk_gpu.py runs the same)."""
    from gdn_packed import _cext
    from gdn_packed.testing import cuda_forward_probe
    t0 = time.perf_counter()
    cuda_forward_probe()
    spins = getattr(_cext.get_C(), "sm90_watchdog", 0)
    return {"status": "ok", "note": f"finished in {time.perf_counter() - t0:.3f} s"
                                    + (f" (watchdog build, {spins} spins)" if spins else "")}


def case_graph():
    """Capture the chunked op's forward+backward over a packing in a CUDA graph; replay it on new data
    and compare with eager; syncs are errors throughout (torch.cuda.set_sync_debug_mode)."""
    import torch

    import gdn_packed
    from gdn_packed.testing import real_rows, rel_err
    dev = _device()
    dtype, K, lengths, gaps, backend = _case_shape(dev, [300, 1, 0, 64, 129], [0, 3, 0, 7, 0])
    V = K
    xs, cu, cu_pad, rows = _packed_inputs(dev, dtype, lengths, gaps, 2, 4, K, V, 1, True)
    do = torch.randn(1, rows, 4, V, device=dev, dtype=dtype)

    def step():
        o, ht = gdn_packed.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_padded=cu_pad,
                                                  use_qk_l2norm_in_kernel=True, backend=backend)
        grads = torch.autograd.grad((o * do).float().sum() + ht.sum(), xs)
        return (o, ht, *grads)

    def refill(seed):
        new, *_ = _packed_inputs(dev, dtype, lengths, gaps, 2, 4, K, V, seed, False)
        with torch.no_grad():
            for x, n in zip(xs, new):
                x.copy_(n)

    if dev.type != "cuda":
        eager = step()
        ok = all(bool(torch.isfinite(t).all()) for t in eager)
        return {"status": "skipped" if ok else "fail",
                "note": f"no CUDA: capture not checked; eager forward+backward ran ({backend} backend)"
                        + ("" if ok else ", NON-FINITE output")}
    # syncs are errors while the op runs: warm-up, capture, replay, eager (input refills and the
    # comparisons, which read values back, stay outside)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with _sync_errors(torch):
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static = step()
    refill(7)
    with _sync_errors(torch):
        graph.replay()
        replay = [t.clone() for t in static]
        eager = step()
    torch.cuda.synchronize()
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errs = {n: rel_err(a, b) for n, a, b in zip(names, replay, eager)}
    pad = ~real_rows(cu.cpu(), cu_pad.cpu(), rows).to(dev)
    pad_zero = bool((replay[0][0, pad] == 0).all())
    worst = max(errs.values())
    ok = worst <= 1e-3 and pad_zero
    note = (f"replay vs eager on new data: max rel err {worst:.1e} ({max(errs, key=errs.get)}); padding rows "
            f"{'exactly 0' if pad_zero else 'NOT 0'}; no host sync under set_sync_debug_mode('error')")
    return {"status": "ok" if ok else "fail", "note": note, "rel_err": errs}


@contextlib.contextmanager
def _sync_errors(torch):
    """torch.cuda.set_sync_debug_mode('error') inside the block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def case_ncu():
    """One ours-triton forward+backward at the anchor (bf16, 16/32 heads, K = V = 128) for ncu, then one
    ours-cuda forward+backward where the sm_90a forward may run (the fused kernel ran at 1.76x its model on
    the H200: which of its roles waits; at the anchor backend="cuda" now runs the split kernel, and its
    backward the sm_90a dS pass and chunk-parallel gradients)."""
    import torch

    from bench import gdr
    xs, cu = gdr.make_inputs(16, 32, 128, 128, [32768], torch.bfloat16, _device(), requires_grad=True)
    o = gdr.ours("triton")(*xs, cu)
    torch.autograd.grad(o, xs, torch.randn_like(o))
    torch.cuda.synchronize()
    if _cuda_forward_refusal(xs[0], xs[2], xs[0].device) is None:
        o = gdr.ours("cuda")(*xs, cu)
        torch.autograd.grad(o, xs, torch.randn_like(o))
        torch.cuda.synchronize()
    return {"status": "ok"}


CASES = {"probe": case_probe, "sanitize": case_sanitize, "graph": case_graph, "profile": case_profile, "ncu": case_ncu}


def run_case(name, json_path, **profile_args):
    try:
        res = CASES[name](**(profile_args if name == "profile" else {}))
        rc = 0 if res.get("status") in ("ok", "skipped") else 1
    except Exception as e:  # noqa: BLE001  (the message goes to the step's note)
        res, rc = {"status": "fail", "note": f"{type(e).__name__}: {e}"}, 1
        import traceback
        traceback.print_exc()
    print("CASE " + json.dumps(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f)
    return rc


# ------------------------------------------------------------------------------------------- helpers
def _has_module(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def _read_csv(path):
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _last_lines(text, n=3):
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])[-300:]


def summary_table(results, info, total_s, budget_s, dry):
    head = (f"gpu_check {'DRY RUN ' if dry else ''}{info.get('date_utc', '')} UTC | {info.get('gpu', 'no GPU')} | "
            f"driver {info.get('driver', '-')} | torch {info.get('torch', '?')} | triton {info.get('triton', '?')} "
            f"| nvcc {info.get('nvcc', '-')}")
    lines = [head, f"{'step':<10}{'status':<9}{'seconds':>8}{'budget':>8}  note"]
    for x in results:
        lines.append(f"{x['step']:<10}{x['status']:<9}{x['seconds']:>8.1f}{x['budget_s']:>8}  {x['note']}")
    bench = next((x for x in results if x["step"] == "bench"), None)
    for scen, mode, lay, times in (bench or {}).get("details", {}).get("headline", []):
        ours = {p: t for p, t in times.items() if p.startswith("ours")}
        cells = ", ".join(f"{p} {t:.3f} ms" for p, t in sorted(times.items()))
        fla = times.get("fla")
        ratio = f"  (fla / best ours = {fla / min(ours.values()):.2f}x)" if fla and ours else ""
        lines.append(f"  bench {scen} {mode} {lay}: {cells}{ratio}")
    overall = "ok" if all(x["status"] in ("ok", "skipped") for x in results) else "FAIL"
    lines.append(f"{'total':<10}{overall:<9}{total_s:>8.1f}{budget_s:>8}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU: interpreter, tiny shapes, no compile")
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="results folder (default $OUT, else bench/results/local/gpu_check_<time>)")
    ap.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    ap.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS",
                    help="override one step's budget (repeatable)")
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["case"]:
        cp = argparse.ArgumentParser(prog="gpu_check.py case")
        cp.add_argument("name", choices=sorted(CASES))
        cp.add_argument("--json", default=None)
        cp.add_argument("--csv", default=None, help="profile: the per-kernel rows")
        cp.add_argument("--providers", default=None, help="profile: comma-separated (default: all three)")
        cp.add_argument("--shapes", default=None, help="profile: comma-separated, e.g. 1x32768,4x8192")
        a = cp.parse_args(argv[1:])
        return run_case(a.name, a.json, csv_path=a.csv, providers=a.providers, shapes=a.shapes)
    args = ap.parse_args(argv)
    names = [s for s, *_ in STEPS]
    only = names if args.only is None else [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in names]
    if bad:
        ap.error(f"--only: unknown step(s) {', '.join(bad)}; steps: {', '.join(names)}")
    budgets = {s: (dry if args.dry_run else gpu) for s, gpu, dry in STEPS if s in only}
    for item in args.budget:
        step, _, secs = item.partition("=")
        if step not in budgets:
            ap.error(f"--budget {item!r}: the step must be one of {', '.join(budgets)}")
        try:
            budgets[step] = float(secs)
        except ValueError:
            ap.error(f"--budget {item!r}: SECONDS must be a number")
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    out = args.out or os.path.join(ROOT, "bench", "results", "local", f"gpu_check_{stamp}")
    os.makedirs(out, exist_ok=True)
    for name in OUT_FILES:                       # a stale file from an earlier run must not be read back
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    fns = {"env": step_env, "wheels": step_wheels, "build": step_build, "tests": step_tests,
           "sanitizer": step_sanitizer, "graph": step_graph, "bench": step_bench,
           "profile": step_profile, "ncu": step_ncu}
    print(f"gpu_check: {'DRY RUN, ' if args.dry_run else ''}steps {', '.join(budgets)}; total budget "
          f"{sum(budgets.values()):.0f} s; results in {out}", flush=True)
    with open(os.path.join(out, "gpu_check.log"), "w") as log, tempfile.TemporaryDirectory() as tmp:
        r = Run(out, args.dry_run, budgets, log)
        r.tmp, r.info = tmp, {}
        for name in budgets:
            r.step(name, fns[name])
        total = r.elapsed()
    info = r.info
    fields = ["step", "status", "seconds", "budget_s", "note"]
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields + ["gpu", "driver", "torch", "triton", "nvcc", "date_utc"],
                           extrasaction="ignore")
        w.writeheader()
        for x in r.results:
            w.writerow(dict(x, **{k: info.get(k, "") for k in ("gpu", "driver", "torch", "triton", "nvcc",
                                                                "date_utc")}))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"env": info, "steps": r.results, "total_s": round(total, 1),
                   "budget_s": sum(budgets.values())}, f, indent=1)
    print("\n" + summary_table(r.results, info, total, sum(budgets.values()), args.dry_run), flush=True)
    return 0 if all(x["status"] in ("ok", "skipped") for x in r.results) else 1


if __name__ == "__main__":
    sys.exit(main())
