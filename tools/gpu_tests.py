"""pytest plugin: pick out the test suite's device tests, a per-test timeout, a per-test CSV.

Load it with `-p gpu_tests` (tools/ on sys.path). Options:
  --device-tests     keep only the device tests (below); the others are deselected
  --device-tests-sample  with --device-tests: only the first device test of each module (a smoke run)
  --autotune-first-config  every @triton.autotune keeps its first config (no tuning: the tests check
                     values, and fla-core's autotuning of each new shape would take most of the time)
  --test-timeout S   fail a test that runs longer than S seconds (SIGALRM in the main thread)
  --tests-csv PATH   one row per test: nodeid, outcome, seconds, CUDA allocations, Triton launches

A test is a *device test*, found without naming any test or kernel, when either
  - it carries a skipif whose reason speaks of a GPU or CUDA and whose condition is false here
    (a test that skips without a GPU and runs on this machine), or
  - its module decides something from the device at import time: a call of torch.cuda.is_available()
    or of gdn_packed._cext.cuda_available()/cuda_unavailable_reason() from the test module or a helper
    beside it, made while pytest imports that module (`DEV = "cuda" if torch.cuda.is_available()...`,
    skipif conditions). Such a module runs its backends (the Triton kernels included) on CUDA tensors
    where a GPU exists and on CPU tensors (Triton under the interpreter) where none does, so the same
    selection is made on a GPU machine and on a CPU-only one; tests it skips here are deselected.
The CSV says what each test really did: the CUDA caching allocator's allocation count and the number
of Triton kernel launches (compiled or interpreted) during the test's call.
"""
import csv
import functools
import os
import re
import signal
import sys

import pytest

GPU_WORDS = re.compile(r"\bGPUs?\b|\bCUDA (?:device|GPU)s?\b", re.IGNORECASE)
_state = {"module_dir": None, "probed": set(), "current": None, "launches": 0}


def pytest_addoption(parser):
    g = parser.getgroup("gpu_tests", "device tests (tools/gpu_tests.py)")
    g.addoption("--device-tests", action="store_true", help="keep only the device tests")
    g.addoption("--device-tests-sample", action="store_true",
                help="with --device-tests: keep only the first device test of each module")
    g.addoption("--autotune-first-config", action="store_true",
                help="every @triton.autotune keeps only its first config")
    g.addoption("--test-timeout", type=float, default=0.0, help="per-test timeout in seconds (0: none)")
    g.addoption("--tests-csv", default=None, help="write one row per test to this CSV file")


# ---- which modules consult the device at import time ---------------------------------------------
def _probe(fn):
    @functools.wraps(fn)
    def probed(*args, **kwargs):
        name, folder = _state["current"], _state["module_dir"]
        if name is not None:
            caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
            if os.path.dirname(caller) == folder:
                _state["probed"].add(name)
        return fn(*args, **kwargs)
    return probed


def _install_probes():
    import torch
    torch.cuda.is_available = _probe(torch.cuda.is_available)
    try:
        from gdn_packed import _cext
    except ImportError:
        return
    for name in ("cuda_available", "cuda_unavailable_reason"):
        if hasattr(_cext, name):
            setattr(_cext, name, _probe(getattr(_cext, name)))


def _count_triton_launches():
    """Wrap the launch entry of jitted (compiled) and interpreted Triton kernels with a counter."""
    try:
        from triton.runtime import jit
    except ImportError:
        return
    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    for cls in classes:
        run = cls.run

        def counted(self, *args, _run=run, **kwargs):
            _state["launches"] += 1
            return _run(self, *args, **kwargs)
        cls.run = counted


def pytest_configure(config):
    if config.getoption("--device-tests"):
        _install_probes()
    _count_triton_launches()
    if config.getoption("--autotune-first-config"):
        _autotune_first_config()


def _autotune_first_config():
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return
    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, *args, **kwargs: prune(self, *args, **kwargs)[:1]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    if isinstance(collector, pytest.Module):
        _state["current"] = collector.nodeid
        _state["module_dir"] = os.path.dirname(os.path.abspath(str(collector.path)))
    yield
    _state["current"] = None


def _skip_state(item):
    """(skipped here, some skipif reason names a GPU/CUDA)."""
    skipped, gpu_reason = False, False
    for m in item.iter_markers("skipif"):
        cond = m.args[0] if m.args else m.kwargs.get("condition", True)
        reason = str(m.kwargs.get("reason", ""))
        if isinstance(cond, str):        # string conditions are evaluated by pytest itself: treat as unknown
            cond = False
        skipped = skipped or bool(cond)
        gpu_reason = gpu_reason or (not cond and bool(GPU_WORDS.search(reason)))
    skipped = skipped or any(True for _ in item.iter_markers("skip"))
    return skipped, gpu_reason


def is_device_test(item):
    skipped, gpu_reason = _skip_state(item)
    if skipped:
        return False
    return gpu_reason or _module_id(item) in _state["probed"]


def _module_id(item):
    mod = item.getparent(pytest.Module)
    return None if mod is None else mod.nodeid


def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("--device-tests"):
        return
    keep = [it for it in items if is_device_test(it)]
    if config.getoption("--device-tests-sample"):
        firsts = {}
        for it in keep:
            firsts.setdefault(_module_id(it), it)
        keep = list(firsts.values())
    kept = set(id(it) for it in keep)
    drop = [it for it in items if id(it) not in kept]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


# ---- per-test timeout and what each test did -----------------------------------------------------
class TestTimeout(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("--test-timeout")
    use_alarm = limit > 0 and hasattr(signal, "SIGALRM")
    if use_alarm:
        def expire(signum, frame):
            raise TestTimeout(f"test ran longer than --test-timeout={limit:g} s")
        old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, limit)
    allocs0, launches0 = _cuda_allocations(), _state["launches"]
    try:
        yield
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        item.user_properties.append(("cuda_allocs", _cuda_allocations() - allocs0))
        item.user_properties.append(("triton_launches", _state["launches"] - launches0))


def _cuda_allocations():
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))


_rows = {}
_csv = {}
FIELDS = ["nodeid", "outcome", "seconds", "cuda_allocs", "triton_launches", "message"]


def pytest_sessionstart(session):
    """Open the CSV at the start (the controller, not xdist workers), so a run killed at its time
    budget still leaves a row for every test that finished."""
    path = session.config.getoption("--tests-csv")
    if path and not hasattr(session.config, "workerinput"):
        f = open(path, "w", newline="")
        _csv["file"], _csv["writer"] = f, csv.DictWriter(f, fieldnames=FIELDS)
        _csv["writer"].writeheader()
        f.flush()


def pytest_runtest_logreport(report):
    row = _rows.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "", "seconds": 0.0,
                                           "cuda_allocs": 0, "triton_launches": 0, "message": ""})
    row["seconds"] = round(row["seconds"] + report.duration, 3)
    props = dict(report.user_properties)
    row["cuda_allocs"] = max(row["cuda_allocs"], int(props.get("cuda_allocs", 0)))
    row["triton_launches"] = max(row["triton_launches"], int(props.get("triton_launches", 0)))
    if report.when == "call" or report.outcome != "passed":
        if not (row["outcome"] in ("failed", "error") and report.when == "teardown"):
            row["outcome"] = ("error" if report.failed and report.when != "call" else report.outcome)
        if report.failed or report.skipped:
            text = report.longreprtext.strip().splitlines()
            row["message"] = (text[-1] if text else "")[:300]
    if report.when == "teardown" and "writer" in _csv:
        _csv["writer"].writerow(_rows.pop(report.nodeid))
        _csv["file"].flush()


def pytest_sessionfinish(session):
    if "file" in _csv:
        _csv["writer"].writerows(_rows.values())     # tests without a teardown report (interrupted)
        _csv["file"].close()
        _csv.clear()
