"""python -m bench [run] [options]   run a suite or chosen scenarios (default: the `default` suite)
python -m bench list              list scenarios, suites and providers
python -m bench plot FILE [-o P]  draw a saved results file (.csv or .json) to PNG
python -m bench kernels [...]     static sm_90 report of the Triton kernels (no GPU; see bench/sm90/)

Results go to bench/results/local/ (ignored by git); copy a run worth keeping to bench/results/
under a name that says what it is.
"""
import argparse
import os
import sys
import time

from bench.common import UsageError

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "local")
MODES = ("fwd", "bwd", "fwdbwd")
FALLBACK_WIDTH = 100        # table width when no terminal is attached and COLUMNS is unset
MIN_REPEATS = 3             # timed calls on CPU: a median and 20th/80th percentiles need three


def _csv(s):
    return None if s is None else tuple(x for x in s.split(",") if x)


def parser():
    from bench.registry import SUITE_DOCS
    suites = "; ".join(f"{n}: {d}" for n, d in SUITE_DOCS.items())
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default=None, help=f"the suite to run (default: default). {suites}")
    ap.add_argument("--gpu-suite", action="store_true", help="same as --suite gpu")
    ap.add_argument("--scenarios", type=_csv, help="comma-separated scenario names (instead of a suite)")
    ap.add_argument("--ops", type=_csv, help="keep only these ops (gdr, packing, conv, recurrent, layer, hybrid)")
    ap.add_argument("--providers", type=_csv, help="keep only these providers (`python -m bench list` shows them)")
    ap.add_argument("--modes", type=_csv, help="keep only these modes (fwd, bwd, fwdbwd)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every token count by this (CPU: 1/16...)")
    ap.add_argument("--dtype", default=None, help="override the scenarios' dtype: float32, bfloat16, float16 "
                    "or float64 (CPU default: float32)")
    ap.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    ap.add_argument("--baseline", default=None, help="provider the speed-ups are against "
                    "(default: fla on GPU, hf-torch on CPU)")
    ap.add_argument("--warmup", type=int, default=1, help="CPU warm-up calls")
    ap.add_argument("--repeats", type=int, default=5, help=f"CPU timed calls (at least {MIN_REPEATS})")
    ap.add_argument("--budget-s", type=float, default=8.0, help="CPU: stop repeating a case after this long")
    ap.add_argument("--cuda-graph", action="store_true", help="GPU: time CUDA-graph replays")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory call")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: steady timings on a shared machine; 0 = torch's own)")
    ap.add_argument("--out", default=RESULTS_DIR, help="results folder (default bench/results/local, ignored "
                    "by git)")
    ap.add_argument("--no-save", action="store_true", help="do not write result files")
    return ap


def main(argv=None):
    """Dispatch to a subcommand of COMMANDS (`run` when the first argument names none)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "run"
    if argv and argv[0] in COMMANDS:
        command = argv.pop(0)
    try:
        if argv and command == "run" and not argv[0].startswith("-"):    # `run` takes options only
            raise UsageError(f"unknown command {argv[0]!r}; valid: {', '.join(COMMANDS)} "
                             "(or run's options: python -m bench --help)")
        return COMMANDS[command](argv)
    except UsageError as e:
        print(f"python -m bench: error: {e}", file=sys.stderr)
        return 2


def _one_of(what, names, valid):
    bad = [n for n in names if n not in valid]
    if bad:
        raise UsageError(f"unknown {what} {', '.join(map(repr, bad))}; valid: {', '.join(valid)}")


def resolve_device(name):
    import torch
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r}: the benchmark runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("a CPU-only build" if torch.version.cuda is None else
                   f"built for CUDA {torch.version.cuda} but finds no usable GPU")
            raise UsageError(f"--device {name!r}: no CUDA device here (torch {torch.__version__} is {why})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name!r}: there are {torch.cuda.device_count()} CUDA devices")
    return device


def jobs_for(args):
    """(jobs, suite name) after --suite / --scenarios / --ops; names are checked."""
    from bench.registry import OP_MODES, SCENARIOS, SUITES, Job
    if args.scenarios:
        _one_of("scenario", args.scenarios, list(SCENARIOS))
        jobs = [Job(n, OP_MODES[SCENARIOS[n].op]) for n in args.scenarios]
        suite = "custom"
    else:
        suite = "gpu" if args.gpu_suite else (args.suite or "default")
        _one_of("suite", [suite], list(SUITES))
        jobs = list(SUITES[suite])
    if args.ops:
        _one_of("op", args.ops, list(OP_MODES))
        jobs = [j for j in jobs if (j.op or SCENARIOS[j.scenario].op) in args.ops]
    return jobs, suite


def check_names(args):
    from bench.common import DTYPES
    from bench.providers import PROVIDERS
    providers = list(dict.fromkeys(n for ps in PROVIDERS.values() for n in ps))
    if args.providers:
        _one_of("provider", args.providers, providers)
    if args.baseline:
        _one_of("baseline provider", [args.baseline], providers)
    if args.modes:
        _one_of("mode", args.modes, MODES)
    if args.dtype:
        _one_of("dtype", [args.dtype], list(DTYPES))


def terminal_width():
    """Columns of the terminal stdout (or, when stdout is piped, stderr) is attached to; else COLUMNS,
    else FALLBACK_WIDTH."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream.isatty():
                return os.get_terminal_size(stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            pass
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        return FALLBACK_WIDTH


class LineProgress:
    """runner.Progress for output that is not a terminal: one line per finished case (or group)."""

    def __init__(self, console):
        self.console, self.total, self.count = console, 0, 0

    def start(self, total):
        self.total = total

    def begin(self, text):
        pass

    def done(self, n, text):
        first, self.count = self.count + 1, self.count + n
        span = f"{first}-{self.count}" if n > 1 else f"{self.count}"
        self.console.print(f"[{span}/{self.total}] {text}", markup=False, highlight=False, soft_wrap=True)


class BarProgress:
    """runner.Progress on a terminal: a rich progress bar that disappears when the run ends."""

    def __init__(self, bar):
        self.bar, self.task = bar, None

    def start(self, total):
        self.task = self.bar.add_task("benchmark", total=total)

    def begin(self, text):
        self.bar.update(self.task, description=text)

    def done(self, n, text):
        self.bar.advance(self.task, n)


def run_command(argv):
    args = parser().parse_args(argv)
    if args.repeats < MIN_REPEATS:
        raise UsageError(f"--repeats must be at least {MIN_REPEATS} (a median and the 20th/80th percentiles), "
                         f"got {args.repeats}")
    jobs, suite = jobs_for(args)
    check_names(args)
    device = resolve_device(args.device)

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from bench import output, runner
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)
    opt = runner.Options(device=device, dtype=args.dtype, scale=args.scale, providers=args.providers,
                         modes=args.modes, warmup=args.warmup, repeats=args.repeats, budget_s=args.budget_s,
                         cuda_graph=args.cuda_graph, baseline=args.baseline, memory=not args.no_memory)
    if not runner.plan(jobs, opt):
        what = "the chosen scenarios" if suite == "custom" else f"suite {suite!r}"
        raise UsageError(f"nothing to run: no case of {what} is left after --ops/--providers/--modes "
                         "(`python -m bench list` shows which providers and modes each suite runs)")
    width = terminal_width()
    console = Console(width=width)
    env = output.environment(device)
    console.print(f"[bold]gdn_packed bench[/] suite={suite} device={env['device_name']} torch {env['torch_version']}"
                  f" triton {env['triton_version'] or '-'} cuda {env['cuda_version'] or '-'} git {env['git_sha']}"
                  f" scale={args.scale:g}")
    t0 = time.perf_counter()
    if console.is_terminal:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            rows = runner.run(jobs, opt, env, BarProgress(bar))
    else:
        rows = runner.run(jobs, opt, env, LineProgress(console))
    tables, dropped = output.result_tables(rows, opt.baseline, width)
    for heading, table in tables:
        console.print(heading)
        console.print(table)
    for line in output.skipped_lines(rows):
        console.print(f"[dim]{line}[/]", highlight=False)
    console.print(output.legend(rows, opt.baseline, dropped), highlight=False)
    packing = output.packing_tables(rows, width)
    for heading, table in packing:
        console.print(heading)
        console.print(table)
    if packing:
        console.print(output.PACKING_LEGEND, highlight=False)
    console.print(f"done in {time.perf_counter() - t0:.1f} s")
    if not args.no_save:
        csv_path, json_path = output.save(rows, env, args.out, suite)
        console.print(f"results: {os.path.relpath(csv_path)} and {os.path.relpath(json_path)}", highlight=False)
    return 0


def list_command(argv):
    if argv:
        raise UsageError(f"`list` takes no arguments, got {' '.join(argv)}")
    from bench.registry import SCENARIOS, SUITE_DOCS, SUITES
    from bench.providers import PROVIDERS
    print("scenarios:")
    for n, s in SCENARIOS.items():
        extra = f" docs={len(s.docs)} real={s.real_tokens} padded={s.padded_tokens}" if s.layout == "packing" else ""
        print(f"  {n:58s} op={s.op:9s} {s.dtype:9s}{extra}  [{s.source}]")
    print("suites:")
    for n, jobs in SUITES.items():
        print(f"  {n}: {SUITE_DOCS[n]}")
        for j in jobs:
            print(f"      {j.scenario} {'/'.join(j.modes)}" + (f" [{', '.join(j.providers)}]" if j.providers else ""))
    print("providers:")
    for op, ps in PROVIDERS.items():
        print(f"  {op}: {', '.join(ps)}")
    return 0


def plot_command(argv):
    from bench.plot import main as plot_main
    return plot_main(argv)


def kernels_command(argv):
    """The static sm_90 report (bench/sm90/command.py)."""
    from bench.sm90 import command
    try:
        args = command.parse(argv)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return command.run(args)


COMMANDS = {"run": run_command, "list": list_command, "plot": plot_command, "kernels": kernels_command}
