"""python -m bench [run] [options]   run a suite or chosen scenarios (default: the `default` suite)
python -m bench list              list scenarios, suites and providers
python -m bench plot FILE [-o P]  draw a saved results file (.csv or .json) to PNG
"""
import argparse
import os
import sys
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _csv(s):
    return None if s is None else tuple(x for x in s.split(",") if x)


def parser():
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default=None, help="default | gpu | tiny (default: default)")
    ap.add_argument("--gpu-suite", action="store_true", help="same as --suite gpu")
    ap.add_argument("--scenarios", type=_csv, help="comma-separated scenario names (instead of a suite)")
    ap.add_argument("--ops", type=_csv, help="keep only these ops (gdr, packing, conv, recurrent, layer, hybrid)")
    ap.add_argument("--providers", type=_csv, help="keep only these providers")
    ap.add_argument("--modes", type=_csv, help="keep only these modes (fwd, bwd, fwdbwd)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every token count by this (CPU: 1/16...)")
    ap.add_argument("--dtype", default=None, help="override the scenarios' dtype (CPU default: float32)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    ap.add_argument("--baseline", default=None, help="provider the speed-ups are against "
                    "(default: fla on GPU, hf-torch on CPU)")
    ap.add_argument("--warmup", type=int, default=1, help="CPU warm-up calls")
    ap.add_argument("--repeats", type=int, default=5, help="CPU timed calls (at least 3)")
    ap.add_argument("--budget-s", type=float, default=8.0, help="CPU: stop repeating a case after this long")
    ap.add_argument("--cuda-graph", action="store_true", help="GPU: time CUDA-graph replays")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory call")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: steady timings on a shared machine; 0 = torch's own)")
    ap.add_argument("--out", default=RESULTS_DIR, help="results folder (default bench/results)")
    ap.add_argument("--no-save", action="store_true", help="do not write result files")
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        from bench.plot import main as plot_main
        return plot_main(argv[1:])
    if argv and argv[0] == "list":
        return list_all()
    if argv and argv[0] == "run":
        argv = argv[1:]
    args = parser().parse_args(argv)
    return run(args)


def jobs_for(args):
    from bench.registry import OP_MODES, SUITES, Job, lookup
    if args.scenarios:
        jobs = [Job(n, OP_MODES[lookup(n).op]) for n in args.scenarios]
        suite = "custom"
    else:
        suite = "gpu" if args.gpu_suite else (args.suite or "default")
        if suite not in SUITES:
            raise SystemExit(f"unknown suite {suite!r}; suites: {', '.join(SUITES)}")
        jobs = list(SUITES[suite])
    if args.ops:
        jobs = [j for j in jobs if (j.op or lookup(j.scenario).op) in args.ops]
    return jobs, suite


def run(args):
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from bench import output, runner
    console = Console(width=max(Console().width, 150))
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(dev)
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)
    jobs, suite = jobs_for(args)
    opt = runner.Options(device=device, dtype=args.dtype, scale=args.scale, providers=args.providers,
                         modes=args.modes, warmup=args.warmup, repeats=args.repeats, budget_s=args.budget_s,
                         cuda_graph=args.cuda_graph, baseline=args.baseline, memory=not args.no_memory)
    env = output.environment(device)
    console.print(f"[bold]gdn_packed bench[/] suite={suite} device={env['device_name']} torch {env['torch_version']}"
                  f" triton {env['triton_version'] or '-'} cuda {env['cuda_version'] or '-'} git {env['git_sha']}"
                  f" scale={args.scale:g}")
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        rows = runner.run(jobs, opt, env, progress)
    main_t, pack_t = output.tables(rows, opt.baseline)
    console.print(main_t)
    for line in output.skipped_lines(rows):
        console.print(f"[dim]{line}[/]", highlight=False)
    if pack_t is not None:
        console.print(pack_t)
    console.print(f"{len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    if not args.no_save:
        csv_path, json_path = output.save(rows, env, args.out, suite)
        console.print(f"results: {os.path.relpath(csv_path)} and {os.path.relpath(json_path)}")
    return 0


def list_all():
    from bench.registry import SCENARIOS, SUITES
    from bench.runner import PROVIDERS
    print("scenarios:")
    for n, s in SCENARIOS.items():
        extra = f" docs={len(s.docs)} real={s.real_tokens} padded={s.padded_tokens}" if s.layout == "packing" else ""
        print(f"  {n:58s} op={s.op:9s} {s.dtype:9s}{extra}  [{s.source}]")
    print("suites:")
    for n, jobs in SUITES.items():
        print(f"  {n}: " + ", ".join(f"{j.scenario}({'/'.join(j.modes)})" for j in jobs))
    print("providers:")
    for op, ps in PROVIDERS.items():
        print(f"  {op}: {', '.join(ps)}")
    return 0
