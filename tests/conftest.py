"""Test session setup. Without a GPU the Triton kernels run under the Triton interpreter: the
environment variable must be set before anything imports triton, and tests/triton_shim.py then makes
the interpreter compute like compiled Triton (bf16 math, loop variables, single autotune config)."""
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

_TABLES = {}


@pytest.fixture
def report_table():
    """report_table(title, line): a line for a table printed at the end of the pytest run."""
    return lambda title, line: _TABLES.setdefault(title, []).append(line)


def pytest_terminal_summary(terminalreporter):
    for title, lines in _TABLES.items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
