"""Test session setup. Without a GPU the Triton kernels run under the Triton interpreter: the
environment variable must be set before anything imports triton, and tests/triton_shim.py then makes
the interpreter compute like compiled Triton (bf16 math, loop variables, single autotune config)."""
import importlib.util
import os

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
