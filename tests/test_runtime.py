"""gdn_packed._runtime.fork: the two lanes of a block (the current stream, and a side stream inside the
context it yields). On CPU both lanes are the current one in program order; on a CUDA device the side lane
starts where the current stream stood at the fork and the current stream waits for it at the block's end
(the GPU part skips without CUDA)."""
import pytest
import torch

from gdn_packed import _runtime


def test_fork_off_cuda_runs_both_lanes_in_program_order():
    order = []
    with _runtime.fork(torch.device("cpu")) as side:
        order.append("main")
        with side:
            order.append("side")
        order.append("main again")
    assert order == ["main", "side", "main again"]
    with pytest.raises(ValueError, match="inside"):
        with _runtime.fork(torch.device("meta")) as side, side:
            raise ValueError("inside the side lane")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the side stream is not checked")
def test_fork_on_cuda_starts_at_the_fork_and_joins_at_the_end():
    """The side lane sees what the current stream enqueued before the block (not what it enqueues in it),
    runs on another stream, and what follows the block sees the side lane's writes, also when the side
    lane is still busy (a sleep) as the block ends."""
    dev = torch.device("cuda")
    a = torch.zeros(1 << 20, device=dev)
    a.fill_(1.0)                                      # before the fork: the side lane sees it
    main = torch.cuda.current_stream()
    with _runtime.fork(dev) as side:
        with side:
            assert torch.cuda.current_stream() != main
            torch.cuda._sleep(50_000_000)             # the side lane still busy when the block ends
            b = a * 2
        assert torch.cuda.current_stream() == main
    c = b + 1                                         # on the current stream: after the join
    assert torch.equal(c.cpu(), torch.full((1 << 20,), 3.0))
    assert _runtime._side_stream(dev) is _runtime._side_stream(dev)     # one per device
