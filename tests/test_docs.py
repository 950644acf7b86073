"""What a new user reads: every doc path the repository cites exists in it, and every code path the docs
cite (docs/DESIGN.md, README.md, bench/NOTES.md), help() of every public
op documents each of its arguments and what backend="auto" picks, and a missing optional dependency
gets a message that says what to do."""
import glob
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import gdn_packed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a path ending in .md that is not part of a URL or of a longer path (relative, ./ ../ or absolute)
DOC_PATH = re.compile(r"(?<![\w/.:-])((?:/|\.{1,2}/)?(?:[\w.-]+/)*[\w.-]+\.md)\b")
SKIP_DIRS = {".git", ".venv", "build", "__pycache__", ".pytest_cache"}


def repo_files():
    """Files of the repository: tracked and untracked-but-not-ignored (a walk when git is absent)."""
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                          capture_output=True)
    if proc.returncode == 0:
        return [p for p in proc.stdout.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))]
    return [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, files in os.walk(ROOT)
            if not dirs.__setitem__(slice(None), [x for x in dirs if x not in SKIP_DIRS and
                                                  not x.endswith(".egg-info")]) for f in files]


def doc_references():
    """(file, line number, cited path) for every .md path cited in a text file of the repository."""
    for rel in repo_files():
        try:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue                                   # binary (e.g. the built _C)
        for n, line in enumerate(text.splitlines(), 1):
            for m in DOC_PATH.finditer(line):
                yield rel, n, m[1]


def test_every_cited_doc_path_exists_in_the_repo():
    refs = list(doc_references())
    assert any(path == "docs/DESIGN.md" for _, _, path in refs)
    root = os.path.realpath(ROOT)
    missing = []
    for rel, n, path in refs:
        here = os.path.dirname(os.path.join(root, rel))
        candidates = [path] if os.path.isabs(path) else [os.path.join(here, path), os.path.join(root, path)]
        found = [c for c in map(os.path.realpath, candidates) if os.path.isfile(c)]
        if not any(c.startswith(root + os.sep) for c in found):
            missing.append(f"{rel}:{n}: {path}")
    assert not missing, "doc paths cited but not in the repository:\n" + "\n".join(missing)


# code paths cited in the docs a reader follows: `gdn_packed/x.py`, `csrc/x.cu`, `tests/x.py`, short forms
# of package paths (`triton/chunk.py`, `ops/_common.py`), `module.function` (`ops/_common.new_output`) and
# `file.py:function`, directories (`torch_ref/`), globs and brace lists (`bench/results/sm90_group.{txt,csv}`)
CODE_DOCS = ("docs/DESIGN.md", "README.md", "bench/NOTES.md")
CODE_PATH = re.compile(r"(?<![\w/.:@-])((?:\.?[\w-]+/)+[\w.*{},-]*(?::\w+)?)")
# cited on purpose, not files of this repository
NOT_IN_REPO = {"megatron/bridge/peft/lora_layers.py": "a file of Megatron-Bridge",
               "gdn_packed/_C": "the extension module that set-up builds from csrc/"}


def _expand(path):
    """A path with {a,b} brace lists -> every spelled-out path."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m[1].split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])]


def _ignored(path):
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def _resolves(path, bases):
    """Whether a cited path names something here: a file or directory, a glob match, a module with the
    cited attribute (`ops/_common.new_output`, `triton/chunk.py:kept_shape`) or the stem of files."""
    path, _, attr = path.partition(":")
    for base in bases:
        full = os.path.join(base, path)
        if glob.glob(full) or (not path.endswith("/") and glob.glob(full + "*")):
            if not attr:
                return True
            return any(attr in open(f, encoding="utf-8").read() for f in glob.glob(full) if os.path.isfile(f))
        head, _, tail = path.rpartition("/")
        stem, dot, attr2 = tail.partition(".")
        module = os.path.join(base, head, stem + ".py")
        if dot and not attr and os.path.isfile(module):
            return attr2.split(".")[0] in open(module, encoding="utf-8").read()
    return False


def code_path_references():
    """(doc, line number, cited path, bases to resolve it against) for every code path cited in
    CODE_DOCS: tokens whose first directory is one of the repository's top-level directories, the
    citing doc's directory's or the package's (gdn_packed/)."""
    top = lambda d: {e for e in os.listdir(d) if os.path.isdir(os.path.join(d, e))}   # noqa: E731
    for doc in CODE_DOCS:
        bases = [ROOT, os.path.dirname(os.path.join(ROOT, doc)), os.path.join(ROOT, "gdn_packed")]
        roots = set().union(*(top(b) for b in bases)) - SKIP_DIRS
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for m in CODE_PATH.finditer(line):
                    path = m[1].rstrip(".,;)")
                    if path.split("/")[0] in roots and path not in NOT_IN_REPO:
                        yield doc, n, path, bases


def test_every_cited_code_path_exists():
    """A path named in docs/DESIGN.md, README.md or bench/NOTES.md is a file or directory of the
    repository (an ignored one, e.g. bench/results/local/, is not checked): renamed or removed
    files show up here, not in a reader's shell."""
    refs = list(code_path_references())
    cited = {path for _, _, path, _ in refs}
    assert {"triton/chunk.py:kept_shape", "csrc/bindings.cpp", "tests/test_isolation.py"} <= cited, sorted(cited)
    missing = [f"{doc}:{n}: {path}" for doc, n, path, bases in refs
               if not all(_ignored(p) or _resolves(p, bases) for p in _expand(path))]
    assert not missing, "code paths cited but not in the repository:\n" + "\n".join(missing)


def test_the_code_path_check_can_fail():
    """The resolver tells a real path from a stale one (so the test above can fail)."""
    bases = [ROOT, os.path.join(ROOT, "gdn_packed")]
    assert _resolves("triton/chunk.py", bases) and _resolves("ops/_common.new_output", bases)
    assert _resolves("triton/chunk.py:kept_shape", bases) and _resolves("torch_ref/", bases)
    assert not _resolves("triton/segments.py", bases) and not _resolves("ops/_common.no_such_helper", bases)
    assert not _resolves("triton/chunk.py:no_such_function", bases)
    assert _expand("bench/results/sm90_group.{txt,csv}") == ["bench/results/sm90_group.txt",
                                                           "bench/results/sm90_group.csv"]


PUBLIC_OPS = [gdn_packed.chunk_gated_delta_rule, gdn_packed.fused_recurrent_gated_delta_rule,
              gdn_packed.causal_conv1d_varlen, gdn_packed.gated_rmsnorm]


def test_every_public_op_is_exported():
    for op in PUBLIC_OPS:
        assert op.__name__ in gdn_packed.__all__


@pytest.mark.parametrize("op", PUBLIC_OPS, ids=lambda op: op.__name__)
def test_help_documents_every_argument(op):
    doc = inspect.getdoc(op)
    documented = set(re.findall(r"^ {4}(\w+(?:, \w+)*):", doc, flags=re.M))
    names = {n for entry in documented for n in entry.split(", ")}
    missing = [p for p in inspect.signature(op).parameters if p not in names]
    assert not missing, f"{op.__name__}'s docstring has no 'name:' entry under Args for {missing}"


@pytest.mark.parametrize("op", PUBLIC_OPS, ids=lambda op: op.__name__)
def test_help_says_what_auto_picks_on_cpu_and_cuda(op):
    backend = re.search(r"^ {4}backend:(.*?)(?=^ {4}\w+:|\Z)", inspect.getdoc(op), flags=re.M | re.S)
    assert backend, f"{op.__name__}: no backend entry"
    text = " ".join(backend.group(1).split())
    assert '"auto"' in text and "CUDA tensors" in text and "CPU tensors" in text, text
    for name in ("torch", "triton", "cuda"):
        assert f'"{name}"' in text, f"{op.__name__}: backend {name!r} not described"


def test_triton_backend_without_triton_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)           # `import triton` raises ImportError
    q = k = torch.randn(1, 4, 1, 8)
    v = torch.randn(1, 4, 1, 8)
    g, beta = torch.zeros(1, 4, 1), torch.ones(1, 4, 1)
    with pytest.raises(RuntimeError) as e:
        gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, backend="triton")
    assert "pip install 'gdn_packed[triton]'" in str(e.value) and "backend='torch'" in str(e.value)


def test_lane_marks_name_tests_that_exist():
    """tests/conftest.py's LANE_MARKS (what `make test-fast` leaves out, README "Commands") names
    modules and test functions that exist: a renamed slow test must not drop into the fast lane."""
    import ast as _ast

    from conftest import LANE_MARKS, LANES
    for key, lanes in LANE_MARKS.items():
        module, _, name = key.partition("::")
        path = os.path.join(ROOT, "tests", module)
        assert os.path.isfile(path), key
        assert set(lanes) <= set(LANES), key
        if name:
            tree = _ast.parse(open(path, encoding="utf-8").read())
            assert name in {n.name for n in _ast.walk(tree) if isinstance(n, _ast.FunctionDef)}, key
