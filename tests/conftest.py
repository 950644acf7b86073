"""Test session setup. Without a GPU the Triton kernels run under the Triton interpreter: the
environment variable must be set before anything imports triton, and tests/triton_shim.py then makes
the interpreter compute like compiled Triton (bf16 math, loop variables, single autotune config).

Lanes (markers registered in pyproject.toml; `make test` runs everything, `make test-fast` leaves the
four slow kinds out): `interpreter` (Triton kernels, ours or FLA's, under the interpreter), `aot` (sm_90
compiles of Triton and csrc/ kernels), `subprocess` (a fresh Python, a CLI or make run), `megatron`
(megatron-core's block as the oracle). mark_lanes below marks them: a test parametrized with
backend "triton" or named test_..._triton is `interpreter` by itself; whole modules and single
tests are listed in LANE_MARKS. A new module of slow tests gets a line there (or its own
`pytestmark = pytest.mark.<lane>`).

`--module-progress` (what `make test` passes) prints a line when each module finishes (its time and
outcomes) and one before each test of an `aot`, `megatron` or `subprocess` module starts, so a long
compile never leaves the terminal silent."""
import collections
import importlib.util
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        import triton_shim  # noqa: F401  (tests/ is on sys.path under pytest's rootdir conftest)

import pytest  # noqa: E402


@pytest.fixture
def sm90_toolchain():
    """For the sm_90 compile tests: skips, with the reason, where triton or its CUDA tools (ptxas,
    cuobjdump) are absent; fails where triton is installed but its CUDA backend cannot be imported, so
    that an ImportError never turns those tests into a silent skip."""
    from bench.sm90.toolchain import toolchain_missing
    why = toolchain_missing()
    if why and importlib.util.find_spec("triton") is not None and why.startswith("triton is not installed"):
        pytest.fail(f"triton is installed, yet: {why}")
    if why:
        pytest.skip(why)


_TABLES = {}
TABLES_ENV = "GDN_PACKED_TABLES"


@pytest.fixture
def report_table():
    """report_table(title, line): a line for a report table (kernel resources, errors against FLA).
    The tables go to .pytest_cache/d/gdn_packed/tables.txt; the terminal shows them with -v or
    GDN_PACKED_TABLES=1, otherwise one line that names the file."""
    return lambda title, line: _TABLES.setdefault(title, []).append(line)


def pytest_terminal_summary(terminalreporter, config):
    if not _TABLES:
        return
    text = "".join(f"== {title}\n" + "".join(line + "\n" for line in lines) + "\n"
                   for title, lines in _TABLES.items())
    cache = getattr(config, "cache", None)        # None with -p no:cacheprovider
    path = None
    if cache is not None:
        path = cache.mkdir("gdn_packed") / "tables.txt"
        path.write_text(text)
    if path is None or config.option.verbose > 0 or os.environ.get(TABLES_ENV, "0") not in ("", "0"):
        for title, lines in _TABLES.items():
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)
    else:
        terminalreporter.write_line(f"{len(_TABLES)} report table(s) in {path} (-v or {TABLES_ENV}=1 "
                                    "prints them)")


# ---- lanes ---------------------------------------------------------------------------------------
LANES = ("interpreter", "aot", "subprocess", "megatron")
# module, or module::test function, -> lanes
LANE_MARKS = {
    "test_sm90_aot.py": ("aot",),
    "test_sm90_report.py": ("aot",),
    "test_build.py": ("aot", "subprocess"),
    "test_megatron.py": ("megatron",),
    "test_gpu_check.py": ("subprocess", "interpreter"),
    "test_layers.py::test_example_trains_two_steps": ("subprocess",),
    "test_transformers_keywords.py::test_integration_imports_without_transformers_and_apply_says_what_to_install":
        ("subprocess",),
    "test_cuda_chunk.py::test_mirror_no_worse_than_fla": ("interpreter",),
    "test_chunk_gdr.py::test_no_worse_than_fla": ("interpreter",),
    "test_chunk_gdr.py::test_segmented_state_pass": ("interpreter",),
    "test_chunk_gdr.py::test_forward_keeps_segment_states_and_prep": ("interpreter",),
    "test_chunk_gdr.py::test_bounded_backward_in_head_slices": ("interpreter",),
    "test_chunk_gdr.py::test_triton_reads_views_of_a_fused_projection": ("interpreter",),
    "test_transformers.py::test_gpu_backends_keep_documents_apart_and_generate_the_same_tokens": ("interpreter",),
    "test_cuda_chunk.py::test_cuda_op_autograd_is_the_triton_backward": ("interpreter",),
}
# fixtures that start a subprocess (test_bench.py's end-to-end run of the CLI)
SUBPROCESS_FIXTURES = ("tiny_run",)


def lanes_of(item):
    """The lanes of a collected test (see the module docstring)."""
    module = os.path.basename(str(item.fspath))
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    lanes = set(LANE_MARKS.get(module, ())) | set(LANE_MARKS.get(f"{module}::{name}", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "triton" in params.values() or name.endswith("_triton"):
        lanes.add("interpreter")
    if set(SUBPROCESS_FIXTURES) & set(getattr(item, "fixturenames", ())):
        lanes.add("subprocess")
    return lanes


def pytest_collection_modifyitems(config, items):
    for item in items:
        for lane in sorted(lanes_of(item)):
            item.add_marker(getattr(pytest.mark, lane))


# ---- --module-progress ---------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--module-progress", action="store_true",
                     help="a line per finished test module (time, outcomes) and before each slow test")


_PROGRESS = {"module": None, "t0": 0.0, "start": 0.0, "counts": collections.Counter()}


def _progress_line(config, text):
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    if getattr(tr._tw, "width_of_current_line", 0):     # after -q's progress dots
        tr._tw.line()
    tr.write_line(text)


def _module_done(config):
    p = _PROGRESS
    if p["module"] is not None:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(p["counts"].items()))
        _progress_line(config, f"[{time.monotonic() - p['start']:6.0f} s] {p['module']}: {counts} in "
                               f"{time.monotonic() - p['t0']:.1f} s")
    p["counts"] = collections.Counter()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    config = item.config
    if not config.getoption("--module-progress"):
        return None
    p, module = _PROGRESS, item.nodeid.split("::")[0]
    if not p["start"]:
        p["start"] = time.monotonic()
    if module != p["module"]:
        _module_done(config)
        p["module"], p["t0"] = module, time.monotonic()
    if set(LANE_MARKS.get(os.path.basename(module), ())) & {"aot", "megatron", "subprocess"}:
        _progress_line(config, f"[{time.monotonic() - p['start']:6.0f} s]   {item.nodeid} ...")
    return None


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _PROGRESS["counts"][report.outcome] += 1


def pytest_sessionfinish(session):
    if session.config.getoption("--module-progress"):
        _module_done(session.config)
