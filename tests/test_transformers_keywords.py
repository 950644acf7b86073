"""The FLA-compatible signature of the public gated-delta-rule ops (issue 27, part 3): the keywords FLA
(fla-core 0.6.0) and transformers' calls pass beside ours, and the integration's import without
transformers. Needs neither transformers nor fla-core."""
import subprocess
import sys

import pytest
import torch

import gdn_packed
from gdn_packed.testing import gdr_inputs

OPS = {"chunk": gdn_packed.chunk_gated_delta_rule, "recurrent": gdn_packed.fused_recurrent_gated_delta_rule}
# transformers' GatedDeltaNet layer calls the op like this (its **kwargs: use_cache, the flash keywords)
TRANSFORMERS_CALL = dict(use_cache=True, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                         num_items_in_batch=None, output_attentions=False)
IGNORED = dict(head_first=False, state_v_first=False, transpose_state_layout=False, allow_neg_eigval=False,
               is_causal=True, cp_context=None, gk=None, gv=None, chunk_indices=None, cu_seqlens_cpu=None,
               use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False, seq_idx=None, position_ids=None)
REFUSED = [("head_first", True, "head_first=True"), ("state_v_first", True, "K before V"),
           ("transpose_state_layout", True, "K before V"), ("allow_neg_eigval", True, "allow_neg_eigval"),
           ("is_causal", False, "causal"), ("cp_context", object(), "context parallelism"),
           ("chunk_size", 128, "chunk_size must be one of")]


def _inputs(T=9, seed=0):
    q, k, v, g, beta, _ = gdr_inputs(T, 2, 4, 16, 8, seed=seed)
    return q, k, v, g, beta


@pytest.mark.parametrize("op", OPS)
def test_transformers_and_fla_keywords_that_do_not_change_the_math_are_ignored(op):
    """transformers' call (keywords only after q, k, v) and FLA's defaults give exactly the plain result."""
    fn = OPS[op]
    q, k, v, g, beta = _inputs()
    plain, _ = fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    hf, state = fn(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   cu_seqlens=None, **TRANSFORMERS_CALL)
    fla, _ = fn(q, k, v, g, beta, None, None, False, use_qk_l2norm_in_kernel=True, chunk_size=32, **IGNORED)
    assert torch.equal(hf, plain) and torch.equal(fla, plain) and state.shape == (1, 4, 16, 8)


@pytest.mark.parametrize("name, value, says", REFUSED, ids=[r[0] for r in REFUSED])
@pytest.mark.parametrize("op", OPS)
def test_fla_keywords_asking_for_other_math_are_refused(op, name, value, says):
    with pytest.raises(ValueError, match=says):
        OPS[op](*_inputs(), **{name: value})


@pytest.mark.parametrize("op", OPS)
def test_unknown_keywords_and_a_ninth_positional_argument_are_type_errors(op):
    """FLA swallows unknown keywords; here a typo is a TypeError naming it. Everything after the eight
    positional arguments (q, k, v, g, beta, scale, initial_state, output_final_state) is keyword-only:
    FLA 0.6's ninth positional argument (use_qk_l2norm_in_kernel) cannot land in cu_seqlens."""
    with pytest.raises(TypeError, match="use_qk_l2norm_in_kernal"):
        OPS[op](*_inputs(), use_qk_l2norm_in_kernal=True)
    with pytest.raises(TypeError, match="positional"):
        OPS[op](*_inputs(), None, None, False, True)


def test_a_fla_0_6_positional_recurrent_call_fails_loudly():
    """fla-core 0.6's fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, ...): called that way
    here, gk (None) lands in beta and is refused; with keywords (g=, beta=) both agree."""
    q, k, v, g, beta = _inputs()
    with pytest.raises(TypeError, match="beta"):
        gdn_packed.fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta)


def test_boundary_keywords_without_cu_seqlens_are_refused_and_ignored_with_it():
    """seq_idx / position_ids / cu_seq_lens_k mark packed documents: without cu_seqlens ignoring them
    would mix documents (ValueError); with cu_seqlens they are redundant (ignored)."""
    q, k, v, g, beta = _inputs()
    seq_idx = torch.tensor([[0] * 4 + [1] * 5])
    for fn in OPS.values():
        for name in ("seq_idx", "position_ids", "cu_seq_lens_k"):
            with pytest.raises(ValueError, match=f"{name} marks packed documents"):
                fn(q, k, v, g, beta, **{name: seq_idx})
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        assert torch.equal(fn(q, k, v, g, beta, cu_seqlens=cu, seq_idx=seq_idx)[0], fn(q, k, v, g, beta, cu_seqlens=cu)[0])


def test_fla_fused_gating_maps_onto_A_log_and_dt_bias():
    """FLA's use_gate_in_kernel=True + use_beta_sigmoid_in_kernel=True (g, beta raw) is this op's
    A_log / dt_bias gating (dt_bias None: zeros, as in FLA); half of it, or use_gate_in_kernel=False
    with A_log (FLA ignores A_log there), is refused."""
    q, k, v, a, b = _inputs()
    A_log = torch.randn(4)
    ours, _ = gdn_packed.chunk_gated_delta_rule(q, k, v, a, b, A_log=A_log, dt_bias=torch.zeros(4))
    fla, _ = gdn_packed.chunk_gated_delta_rule(q, k, v, a, b, A_log=A_log, use_gate_in_kernel=True,
                                               use_beta_sigmoid_in_kernel=True)
    assert torch.equal(fla, ours)
    with pytest.raises(ValueError, match="go together"):
        gdn_packed.chunk_gated_delta_rule(q, k, v, a, b, A_log=A_log, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="ambiguous"):
        gdn_packed.chunk_gated_delta_rule(q, k, v, a, b, A_log=A_log, dt_bias=torch.zeros(4), use_gate_in_kernel=False)
    with pytest.raises(ValueError, match="needs A_log"):
        gdn_packed.chunk_gated_delta_rule(q, k, v, a, b, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    with pytest.raises(ValueError, match="use_gate_in_kernel=True is not supported"):
        gdn_packed.fused_recurrent_gated_delta_rule(q, k, v, a, b, use_gate_in_kernel=True)


def test_integration_imports_without_transformers_and_apply_says_what_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import torch, gdn_packed.integrations.transformers as t\n"
            "try:\n    t.apply(torch.nn.Linear(2, 2))\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'gdn_packed[hf]'" in out.stdout
