"""Timing and peak memory of one callable.

GPU: `triton.testing.do_bench` (CUDA events, L2 flushed between calls, warm-up first), returning the
median and the 20th/80th percentiles; with `cuda_graph=True` `do_bench_cudagraph` replays a captured
graph instead. Without triton, CUDA events by hand. Peak memory: torch.cuda.max_memory_allocated()
during one call, minus what was allocated before it.
CPU: time.perf_counter around each call after `warmup` calls, `repeats` times (fewer when one call is
slow: at least 3 and at most `budget_s` seconds in all). Peak memory: the process's resident set
sampled every 1 ms by a thread during the first warm-up call, minus the RSS before it (an estimate:
memory the allocator already holds from earlier cases is reused without growing the RSS, and short
spikes between samples are missed).
"""
import statistics
import threading
import time


def quantiles(xs):
    """(p50, p20, p80) of a list of seconds."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return statistics.median(xs), q[1], q[7]


def time_cpu(fn, *, warmup=1, repeats=5, budget_s=8.0, min_repeats=3):
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < repeats:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= min_repeats and time.perf_counter() - start > budget_s:
            break
    return quantiles(times), len(times)


def time_gpu(fn, *, warmup_ms=25, rep_ms=100, cuda_graph=False):
    import torch
    try:
        import triton.testing as tt
        if cuda_graph:   # captures and replays on a side stream itself
            ms = tt.do_bench_cudagraph(fn, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        else:
            ms = tt.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return tuple(m / 1e3 for m in ms), None
    except ImportError:
        pass
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return quantiles(times), len(times)


def _rss_bytes():
    with open("/proc/self/statm") as f:
        import os
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory(fn, device):
    """(bytes, how) of the extra memory one call of fn needs at its peak."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, "cuda max_memory_allocated"
    try:
        base = _rss_bytes()
    except OSError:
        return None, "no /proc/self/statm"
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        fn()
    finally:
        done.set()
        th.join()
    peak[0] = max(peak[0], _rss_bytes())
    return peak[0] - base, "cpu peak RSS delta (1 ms sampling)"
