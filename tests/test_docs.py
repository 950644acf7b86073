"""What a new user reads: help() of every public op documents each of its arguments and what
backend="auto" picks, and a missing optional dependency gets a message that says what to do."""
import inspect
import re
import sys

import pytest
import torch

import gdn_packed

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
