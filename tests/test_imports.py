"""The import graph of the repository has no cycle: gdn_packed, bench (its package and the sm_90 tools),
tools/, tests/ and examples/. Read from the source (ast, every import statement, including those inside
functions), not from what happens to be imported at runtime, so a lazy import that hides a cycle is found
as well."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "gdn_packed"
# the places Python code lives; a directory with __init__.py is a package (dotted names from the repo
# root), the others (tools/, tests/, examples/) put their files on sys.path as top-level modules
CODE_DIRS = ("gdn_packed", "bench", "tools", "tests", "examples")
SKIP = {"__pycache__", ".venv", "build"}


def _module_name(path, root):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node, module, is_package, known):
    """The absolute names of the modules one import statement imports: `from a import b` imports
    the module a.b when that is a module, else the name b of module a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]


def _files(root):
    """{module name: path} of the .py files under root: dotted from root's parent when root is a
    package, else each file a top-level module (a script directory on sys.path)."""
    if (root / "__init__.py").is_file():
        return {_module_name(p, root): p for p in root.rglob("*.py") if not SKIP & set(p.parts)}
    return {p.stem: p for p in root.glob("*.py")}


def import_graph(*roots):
    """{module: set of the walked modules it imports}, from every .py file under the roots (default:
    the package gdn_packed alone)."""
    files = {}
    for root in roots or (PKG,):
        files.update(_files(root))
    known = set(files) | {"gdn_packed._C"}     # the compiled extension (csrc/), built or not: a leaf
    graph = {}
    for module, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _resolve(node, module, path.name == "__init__.py", known):
                    if name in files and name != module:
                        deps.add(name)
        graph[module] = deps
    return graph


def repo_graph():
    """The import graph of every code directory of the repository (CODE_DIRS) and its top-level files
    (setup.py)."""
    return import_graph(REPO, *(REPO / d for d in CODE_DIRS if (REPO / d).is_dir()))


def find_cycle(graph):
    """One cycle as a list of modules [a, b, ..., a], or None. Importing a package's submodule runs
    the package's __init__ first, but that edge is Python's, not a module's own import: only the
    imports written in the files count."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_gdn_packed_imports_have_no_cycle():
    graph = import_graph()
    assert "gdn_packed.segments" in graph and "gdn_packed.ops.chunk_gdr" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_anywhere_in_the_repository():
    """bench/ (bench/cli.py <-> bench/plot.py was one, through UsageError), tools/, tests/ and
    examples/ too, and the edges between them (bench and tools import gdn_packed, tests import all)."""
    graph = repo_graph()
    assert {"bench.cli", "bench.plot", "bench.common", "gpu_check", "gpu_tests", "conftest",
            "test_imports", "setup"} <= set(graph)
    assert "gdn_packed.testing" in graph["gpu_check"] and "bench.cli" in graph["test_bench"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_segment_checks_have_one_owner():
    graph = import_graph()
    assert "gdn_packed.packing" not in graph["gdn_packed._validate"]
    assert graph["gdn_packed._validate"] == set(), "_validate imports no gdn_packed module"
    assert "gdn_packed.packing" not in graph["gdn_packed.torch_ref.conv1d"]


def test_kernels_never_import_ops():
    """Dependencies point one way (docs/DESIGN.md section 5): the kernels' host code (torch_ref/,
    triton/, cuda/) and segments.py take what they need of the run from gdn_packed._runtime, never
    from gdn_packed.ops (torch_ref/chunk.py imported ops._common before)."""
    graph = import_graph()
    kernels = [m for m in graph if m.startswith(("gdn_packed.torch_ref", "gdn_packed.triton", "gdn_packed.cuda"))]
    assert "gdn_packed.torch_ref.chunk" in kernels and "gdn_packed.cuda.launch" in kernels
    for m in kernels + ["gdn_packed.segments", "gdn_packed._runtime"]:
        assert not [d for d in graph[m] if d.startswith("gdn_packed.ops")], f"{m} imports {sorted(graph[m])}"


@pytest.mark.parametrize("lazy", [False, True], ids=["top-level", "lazy"])
def test_the_walk_finds_a_cycle(tmp_path, lazy):
    """The walk sees a cycle written the way _validate <-> packing was (one side imports inside a
    function), and one written with top-level imports."""
    pkg = tmp_path / "gdn_packed"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from gdn_packed import packing\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "packing.py").write_text("from gdn_packed._validate import check\n")
    body = ("def check():\n    from gdn_packed.packing import validate\n" if lazy else
            "from . import packing\n\ndef check():\n    pass\n")
    (pkg / "_validate.py").write_text(body)
    (pkg / "ops" / "table.py").write_text("from ..packing import x\n")
    graph = import_graph(pkg)
    assert graph["gdn_packed.ops.table"] == {"gdn_packed.packing"}
    cycle = find_cycle(graph)
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["gdn_packed._validate", "gdn_packed.packing"]


def test_dispatch_table_names_real_functions():
    """Every "module:function" of the one dispatch table imports (lazily, on first use) and is a
    function; gdn_packed.ops.BACKENDS lists exactly the table's backends, in its order."""
    from gdn_packed.ops import BACKENDS
    from gdn_packed.ops._dispatch import TABLE, kernel

    assert BACKENDS == {op: tuple(impls) for op, impls in TABLE.items()}
    for op, impls in TABLE.items():
        for backend, parts in impls.items():
            assert "fwd" in parts
            for part in parts:
                assert callable(kernel(op, backend, part)), (op, backend, part)
    with pytest.raises(NotImplementedError, match="available: cuda, torch"):
        kernel("causal_conv1d_varlen", "triton", "fwd")


def test_resolve_backend_refuse_is_an_error_when_asked_and_skipped_by_auto():
    """One rule for "this backend does not take this input": asked by name it raises the refusal;
    "auto" passes over it to torch. (A CUDA device object needs no GPU to resolve.)"""
    import torch

    from gdn_packed.ops._common import refuse_float64, resolve_backend

    cuda = torch.device("cuda")
    x64, x32 = torch.zeros(1, dtype=torch.float64), torch.zeros(1)
    have = ("triton", "torch")
    assert resolve_backend("auto", cuda, have=have, refuse=refuse_float64(x64)) == "torch"
    assert resolve_backend("triton", cuda, have=have, refuse=refuse_float64(x32)) == "triton"
    assert resolve_backend("auto", cuda, have=have, refuse=refuse_float64(x32)) == "triton"
    with pytest.raises(TypeError, match="float64"):
        resolve_backend("triton", cuda, have=have, refuse=refuse_float64(x64))
    assert resolve_backend("torch", cuda, have=have, refuse=lambda b: ValueError("never for torch")) == "torch"
