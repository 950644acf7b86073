"""The torch backend's own machinery (the CPU path of every op): its two schedules of the chunked op
(host: planned from cu_seqlens read on the host; device: the static schedule of CUDA tensors) against
the float64 reference and each other, the forward's `kept` for the backward, the schedule switch held per
thread, and corrupt cu_seqlens values on CPU tensors. Poison isolation and hard resets of the torch
backend are in tests/test_isolation.py, on the shared packings of gdn_packed.testing.PACKINGS."""
import contextlib
import threading

import pytest
import torch

import gdn_packed
from gdn_packed._runtime import device_schedule, host_schedule
from gdn_packed.ops.chunk_table import build_chunk_table
from gdn_packed.testing import gdr_inputs, layout, no_host_sync, poisoned_outputs, reference_gdr, rel_err
from gdn_packed.torch_ref import chunk


@pytest.mark.parametrize("schedule", ["host", "host-blocks", "device"])
def test_schedules_match_reference(schedule, monkeypatch):
    """The CPU (host) schedule in one block and in many, and the static schedule CUDA tensors run
    (forced on CPU with device_schedule), against the float64 reference; each is bit-identical
    when rerun, and the host schedule gives the same bits in one block and in many."""
    cu, pad, rows = layout([0, 1, 63, 64, 65, 70, 5], gaps=[0, 2, 0, 1, 0, 3, 0], tail=2)
    q, k, v, g, beta, h0 = gdr_inputs(rows, 2, 4, 32, 16, N=7, initial_state=True, seed=7)

    def run():
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        with poisoned_outputs():
            o, fs = gdn_packed.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                                      cu_seqlens=cu, cu_seqlens_padded=pad,
                                                      use_qk_l2norm_in_kernel=True, backend="torch")
            gen = torch.Generator().manual_seed(8)
            do, dht = torch.randn(o.shape, generator=gen), torch.randn(fs.shape, generator=gen)
            torch.autograd.backward([o, fs], [do, dht])
        return [o, fs] + [x.grad for x in xs], do, dht

    if schedule == "device":
        with device_schedule():
            got, do, dht = run()
            again, *_ = run()
    else:
        if schedule == "host-blocks":
            one, *_ = run()
            monkeypatch.setattr(chunk, "BLOCK_CHUNK_HEADS", 4)
            assert len(chunk.Schedule(*_table(cu, pad, rows), rows, 64).blocks(4)) >= 2     # one per 2 steps
        got, do, dht = run()
        again, *_ = run()
        if schedule == "host-blocks":
            assert all(torch.equal(a, b) for a, b in zip(got, one))
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    rs = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    ro, rf = reference_gdr(*rs[:5], initial_state=rs[5], cu_seqlens=cu, cu_seqlens_padded=pad,
                           use_qk_l2norm_in_kernel=True)
    torch.autograd.backward([ro, rf], [do.double(), dht.double()])
    for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got, [ro, rf] + [x.grad for x in rs]):
        assert rel_err(a, b) <= 1e-5, name


def _table(cu, pad, rows):
    return build_chunk_table(cu, pad, rows, 64)


def test_backward_from_kept_matches_recompute():
    """The forward's `kept` (host schedule: states of even steps and every Vnew) gives the backward
    the gradients it computes from the inputs alone (within fp32 rounding); kept's size is the fake
    kernel's, every element written (NaN-poisoned outputs), and both ops pass opcheck with it."""
    from gdn_packed.ops.chunk_gdr import chunk_gdr_bwd, chunk_gdr_fwd
    cu, pad, rows = layout([0, 1, 63, 64, 65, 70, 5, 130], gaps=[0, 2, 0, 1, 0, 3, 0, 1], tail=2)
    q, k, v, g, beta, h0 = gdr_inputs(rows, 2, 4, 32, 16, N=8, initial_state=True, seed=9)
    args = (q, k, v, g, beta, h0, cu, pad, 0.25, True, "torch")
    with poisoned_outputs():
        o, fs, kept = chunk_gdr_fwd(*args, None, None, True)
        _, _, nothing = chunk_gdr_fwd(*args, None, None, False)
    assert kept.shape == ((rows // 64 + 8) * 4 * 32 * 16 + (rows // 32 + 8) * 4 * 32 * 16,)
    assert not kept.isnan().any() and nothing.numel() == 0
    gen = torch.Generator().manual_seed(10)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(fs.shape, generator=gen)
    bwd = args[:8] + (do, dht) + args[8:]
    from_kept = chunk_gdr_bwd(*bwd, None, None, kept)
    recomputed = chunk_gdr_bwd(*bwd)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), from_kept, recomputed):
        assert rel_err(a, b) <= 1e-6, name
    torch.library.opcheck(chunk_gdr_fwd, args + (None, None, True))
    torch.library.opcheck(chunk_gdr_bwd, bwd + (None, None, kept))


# -- the schedule switch (issue 29): per thread, and a kept valid whichever schedule the backward runs

SWITCH_CASE = dict(lengths=[0, 1, 63, 64, 65, 70, 5], gaps=[0, 2, 0, 1, 0, 3, 0], tail=2)


def _switch_inputs():
    cu, pad, rows = layout(**SWITCH_CASE)
    q, k, v, g, beta, h0 = gdr_inputs(rows, 2, 4, 32, 16, N=7, initial_state=True, seed=11)
    gen = torch.Generator().manual_seed(12)
    do, dht = torch.randn(1, rows, 4, 16, generator=gen), torch.randn(7, 4, 32, 16, generator=gen)
    return (q, k, v, g, beta, h0), do, dht, cu, pad


def _fwd_bwd(fwd_ctx, bwd_ctx):
    """Forward of the torch backend under fwd_ctx, its backward under bwd_ctx: o, state and the six
    input gradients."""
    xs0, do, dht, cu, pad = _switch_inputs()
    xs = [x.clone().requires_grad_() for x in xs0]
    with poisoned_outputs():
        with fwd_ctx():
            o, fs = gdn_packed.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                                      cu_seqlens=cu, cu_seqlens_padded=pad,
                                                      use_qk_l2norm_in_kernel=True, backend="torch")
        with bwd_ctx():
            torch.autograd.backward([o, fs], [do, dht])
    return [o.detach(), fs.detach()] + [x.grad for x in xs]


@pytest.mark.parametrize("where", ["fwd-host-bwd-device", "fwd-device-bwd-host"])
def test_schedule_switch_between_forward_and_backward(where):
    """A forward on one schedule and its backward on the other (device_schedule entered or left
    between them): the backward takes the forward's kept whichever schedule made it, matches the
    float64 reference and gives the same bits when rerun."""
    host, device = contextlib.nullcontext, device_schedule
    fwd, bwd = (host, device) if where == "fwd-host-bwd-device" else (device, host)
    got = _fwd_bwd(fwd, bwd)
    assert all(torch.equal(a, b) for a, b in zip(got, _fwd_bwd(fwd, bwd)))
    xs, do, dht, cu, pad = _switch_inputs()
    rs = [x.double().requires_grad_() for x in xs]
    ro, rf = reference_gdr(*rs[:5], initial_state=rs[5], cu_seqlens=cu, cu_seqlens_padded=pad,
                           use_qk_l2norm_in_kernel=True)
    torch.autograd.backward([ro, rf], [do.double(), dht.double()])
    for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got,
                          [ro, rf] + [x.grad for x in rs]):
        assert rel_err(a, b) <= 1e-5, name


def test_device_schedule_is_per_thread_when_interleaved():
    """Two threads entering and leaving device_schedule interleaved (A in, B in, A out, B out): each
    sees its own switch, and once both have left no thread is left on the device schedule."""
    cpu = torch.device("cpu")
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def thread_a():
        with device_schedule():
            a_in.set()
            b_in.wait(10)
            seen["a-inside"] = host_schedule(cpu)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        seen["b-before"] = host_schedule(cpu)
        with device_schedule():
            b_in.set()
            a_out.wait(10)
            seen["b-inside-after-a-left"] = host_schedule(cpu)
        seen["b-after"] = host_schedule(cpu)

    threads = [threading.Thread(target=f) for f in (thread_a, thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert seen == {"a-inside": False, "b-before": True, "b-inside-after-a-left": False, "b-after": True}
    assert host_schedule(cpu)
    after = []
    t = threading.Thread(target=lambda: after.append(host_schedule(cpu)))
    t.start()
    t.join(30)
    assert after == [True]


def test_device_schedule_leaves_other_threads_alone():
    """While one thread is inside device_schedule (and no_host_sync), another thread's forward and
    backward run the host schedule: the same bits as with nobody inside, and host reads allowed."""
    alone = _fwd_bwd(contextlib.nullcontext, contextlib.nullcontext)
    got, errors = [], []

    def other():
        try:
            got.extend(_fwd_bwd(contextlib.nullcontext, contextlib.nullcontext))
        except Exception as e:          # reported below, with the main thread's switch off again
            errors.append(e)

    with no_host_sync():
        t = threading.Thread(target=other)
        t.start()
        t.join(120)
    assert not errors, errors
    assert len(got) == len(alone) and all(torch.equal(a, b) for a, b in zip(got, alone))


# -- bad cu_seqlens values on CPU tensors (issue 29): a ValueError naming them, never a hang ----------

BAD_OFFSETS = {    # (cu_seqlens, cu_seqlens_padded or None) for T = 20 rows
    "past-rows": ([0, 5, 10 ** 6], None),
    "huge-int64": ([0, 5, 10 ** 15], None),
    "decreasing": ([0, 15, 3, 20], None),
    "negative": ([0, -5, 10], None),
    "not-from-0": ([7, 12], None),
    "padded-past-rows": ([0, 5, 10], [0, 10 ** 9, 10 ** 9 + 5]),
    "padded-negative": ([0, 5, 10], [-10 ** 6, 0, 5]),
}


def _call_op(op, cu, pad, T=20, backend="torch"):
    if op in ("chunk", "recurrent"):
        q, k, v, g, beta, _ = gdr_inputs(T, 1, 1, 16, 16)
        f = gdn_packed.chunk_gated_delta_rule if op == "chunk" else gdn_packed.fused_recurrent_gated_delta_rule
        return f(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_padded=pad, output_final_state=True, backend=backend)
    x = torch.randn(1, T, 8)
    if op == "conv":
        return gdn_packed.causal_conv1d_varlen(x, torch.randn(8, 4), cu_seqlens=cu, cu_seqlens_padded=pad,
                                               backend=backend)
    if op == "rmsnorm":
        return gdn_packed.gated_rmsnorm(x, torch.randn(1, T, 8), torch.randn(8), cu_seqlens=cu,
                                        cu_seqlens_padded=pad, backend=backend)
    return build_chunk_table(cu, pad, T, 64)


OPS = ["chunk", "recurrent", "conv", "rmsnorm", "chunk_table"]


@pytest.mark.parametrize("bad", list(BAD_OFFSETS))
@pytest.mark.parametrize("op", OPS)
def test_bad_offsets_on_cpu_are_a_value_error_without_validate(op, bad):
    """On CPU tensors reading cu_seqlens costs nothing, so every op checks their values with
    validate=False too (on 738aed4 fused_recurrent_gated_delta_rule ran > 10 minutes on
    cu_seqlens [0, 5, 10**6] over 20 rows; the others returned a silent answer)."""
    cu, pad = BAD_OFFSETS[bad]
    cu, pad = torch.tensor(cu), None if pad is None else torch.tensor(pad)
    with pytest.raises(ValueError, match="cu_seqlens"):
        _call_op(op, cu, pad)


@pytest.mark.parametrize("op", OPS)
def test_bad_offsets_on_the_device_schedule_stay_bounded(op):
    """Where the values are not read (the schedule of CUDA tensors, forced on CPU) corrupt offsets
    give an answer within the rows, in about the time of a good call: every loop is bounded by the
    rows that exist."""
    with device_schedule():
        out = _call_op(op, torch.tensor([0, 5, 10 ** 6]), None)
    first = out if op == "rmsnorm" else out[0]
    assert first.shape[:2] == ((20 // 64 + 2, 4) if op == "chunk_table" else (1, 20))


def test_recurrent_steps_never_exceed_the_rows():
    """The host schedule of the recurrent torch path takes the longest sequence's length in steps,
    capped at the T rows (corrupt offsets reaching the kernel directly cannot make it loop longer)."""
    from gdn_packed.torch_ref.recurrent import _steps
    assert _steps(torch.tensor([5, 10 ** 6 - 5]), 20) == 20
    assert _steps(torch.tensor([5, 3]), 20) == 5
