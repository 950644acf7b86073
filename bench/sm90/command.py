"""`python -m bench kernels`: the static sm_90 report of every Triton kernel the launchers run.

parse(argv) checks the command line (ValueError for a bad one: bench/cli.py turns it into its usage
error); run(args) records, compiles, models and writes the report."""
import argparse
import os
import re
import sys
import time

from bench.sm90.launches import DEFAULT_SHAPES, DTYPES, fla_missing, parse_shape
from bench.sm90.toolchain import toolchain_missing

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "local")


def _csv(s):
    return tuple(x for x in s.split(",") if x)


def parser():
    ap = argparse.ArgumentParser(
        prog="python -m bench kernels", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The static sm_90 report: every Triton kernel the launchers run (ours and FLA 0.6.0's), "
        "compiled for the H200 without a GPU, with registers, shared memory, spills, occupancy, per-iteration "
        "SASS counts of the sequential chunk loop and a byte/FLOP/latency model (bench/NOTES.md, \"sm_90 "
        "report\").",
        epilog="""examples:
  python -m bench kernels                                    # anchor + 32x1024, bf16 + fp32, ours + FLA, the check
  python -m bench kernels --shape anchor --dtype bf16 --no-fla --no-check --kernels 'dq|dk'
                                                             # a subset of ours: only those kernels compile
  python -m bench kernels --shape anchor --shape 4x8192 --dtype bf16 --modes bwd   # ours and FLA's backward
  python -m bench kernels --check-only                       # the model check alone (seconds)
  python -m bench kernels --shape anchor --dtype bf16 --modes fwd,bwd \
      --measured bench/results/h200_2026-12-04/kernels_anchor.csv   # the model beside an H200's times
Every est us is a model estimate naming its bound (latency, bytes, smem, FLOPs,
narrow); compiles are cached on disk
($GDN_PACKED_SM90_CACHE, default ~/.cache/gdn_packed/sm90), so a rerun compiles only changed kernels.""")
    ap.add_argument("--shape", action="append", help="anchor, 4x8192, 32x1024 or N,L,H,HV,K,V (repeatable; "
                    "default: anchor and 32x1024)")
    ap.add_argument("--dtype", type=_csv, default=("bf16", "fp32"), help="bf16,fp16,fp32 (default bf16,fp32)")
    ap.add_argument("--modes", type=_csv, default=("fwd", "bwd"), help="fwd,bwd (default both)")
    ap.add_argument("--no-fla", action="store_true", help="leave FLA 0.6.0's kernels out")
    ap.add_argument("--triton-only", action="store_true", help="model a Triton-only install (no gdn_packed._C): "
                    "the chunk table as its torch operators; default: the package built, the table from csrc/")
    ap.add_argument("--kernels", metavar="REGEX", help="only the launches whose kernel name this regular expression "
                    "finds, e.g. 'dq|dk' or 'state' (the FLA config choice then sees only those too)")
    ap.add_argument("--no-check", action="store_true", help="leave out the model check against FLA's published "
                    "H200 times (seconds, from the committed facts in bench/results/sm90_validated_facts.json.gz)")
    ap.add_argument("--check-only", action="store_true", help="only the model check (no recording, no compiles)")
    ap.add_argument("--fit", action="store_true", help="fit the model's FIT constants again (records FLA at every "
                    "published row and compiles its candidates: minutes) and print them with the check; "
                    "model.CONSTANTS holds the committed ones")
    ap.add_argument("--collect", action="store_true", help="record FLA at every published row again and compile "
                    "its kernels at the reference heads, writing the facts file (minutes; with --fit, at the "
                    "fitted constants)")
    ap.add_argument("--cuda-lines", action="store_true", help="where the sm_90a CUDA kernels' shared-memory "
                    "wavefronts come from, by csrc source line (the line table of the compile the model reads), "
                    "for each of the mode's kernels and each dtype asked; then the report")
    ap.add_argument("--measured", action="append", metavar="CSV", help="device times measured on a GPU (tools/"
                    "gpu_check.py's profile CSV: shape, provider, mode, kernel, calls, us; repeatable): printed "
                    "beside the model per kernel (bench/sm90/measured.py)")
    ap.add_argument("--measured-csv", metavar="PATH", help="with --measured: write the joined rows here")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--csv", help="write the rows as CSV here (with --check-only: the check's rows)")
    ap.add_argument("--txt", help="write the table here (with --check-only: the check's text)")
    return ap


def parse(argv):
    """The checked arguments; ValueError names what is wrong."""
    args = parser().parse_args(argv)
    for what, names, valid in (("dtype", args.dtype, list(DTYPES)), ("mode", args.modes, ("fwd", "bwd"))):
        bad = [n for n in names if n not in valid]
        if bad:
            raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; valid: {', '.join(valid)}")
    args.shapes = [parse_shape(s) for s in (args.shape or DEFAULT_SHAPES)]
    for path in args.measured or ():
        if not os.path.isfile(path):
            raise ValueError(f"--measured {path!r}: no such file")
    if args.measured_csv and not args.measured:
        raise ValueError("--measured-csv needs --measured")
    if args.kernels:
        try:
            re.compile(args.kernels)
        except re.error as e:
            raise ValueError(f"--kernels {args.kernels!r}: {e}") from None
    why = toolchain_missing() if not args.check_only or args.collect or args.fit else ""
    if why:
        raise ValueError(f"kernels: {why}")
    return args


def check(args, log):
    """The model check against FLA's published times (validate.py): its text, or why there is none."""
    from bench.sm90 import model as M
    from bench.sm90 import validate as V
    if args.collect or args.fit:        # a fit needs every candidate's SASS, which the committed file omits
        data = V.collect(V.load_published(), log=log)
    elif not os.path.exists(V.FACTS):
        return f"model check: no facts file {os.path.relpath(V.FACTS)} (python -m bench kernels --collect writes it)"
    else:
        data = V.load()
    chk = V.Check(data)
    const, chosen, warps = chk.fit(log=log) if args.fit else (M.CONSTANTS, None, V.STATE_WARPS)
    if warps != V.STATE_WARPS:
        log(f"the fit puts FLA's state kernels at {warps} warps: validate.STATE_WARPS holds {V.STATE_WARPS}")
    if args.collect:
        V.save(data, const, state_warps=warps)
    table = chk.table(const, chosen)
    text = V.format_check(table, const, warps)
    if args.check_only and args.csv:
        V.write_check(table, args.csv)
    if args.check_only and args.txt:
        with open(args.txt, "w") as f:
            f.write(text + "\n")
    return text


def run(args):
    from bench.sm90.report import format_table, run_report, write_outputs
    log = lambda m: print(m, file=sys.stderr, flush=True)    # noqa: E731
    if args.check_only:
        print(check(args, log))
        return 0
    if args.cuda_lines:
        from bench.sm90 import cuda_chunk
        for mode in args.modes:       # every kernel of the mode (the forward's: fused, state-only, split)
            for phase in (p for p in cuda_chunk.KERNELS if p.startswith(mode)):
                for dtype in (d for d in args.dtype if d in cuda_chunk.DTYPES):
                    print(cuda_chunk.format_smem_by_line(phase, dtype) + "\n")
    fla = not args.no_fla and not fla_missing()
    if not args.no_fla and not fla:
        print(f"kernels: {fla_missing()}: FLA rows left out", file=sys.stderr)
    if not (args.json or args.csv or args.txt):
        stem = os.path.join(RESULTS_DIR, time.strftime("%Y-%m-%d_%H%M%S") + "_sm90")
        args.json, args.csv, args.txt = stem + ".json", stem + ".csv", stem + ".txt"
    t0 = time.perf_counter()
    rows, totals, meta = run_report(args.shapes, args.dtype, args.modes, fla=fla, kernels=args.kernels,
                                    ext=not args.triton_only, log=log)
    import triton
    meta.update(triton=triton.__version__, shapes={n: d for n, d in args.shapes}, modes=list(args.modes),
                dtypes=list(args.dtype), install="triton-only" if args.triton_only else "built")
    text = format_table(rows, totals, meta)
    if args.measured:
        from bench.sm90 import measured
        joined = measured.join(rows, args.shapes, measured.read(args.measured))
        text += "\n\n" + measured.format_join(joined)
        if args.measured_csv:
            measured.write(joined, args.measured_csv)
    if not args.no_check:
        text += "\n\n" + check(args, log)
    print(text)
    write_outputs(rows, totals, meta, args.json, args.csv, args.txt, text)
    log(f"done in {time.perf_counter() - t0:.1f} s; " + ", ".join(
        os.path.relpath(p) for p in (args.json, args.csv, args.txt) if p))
    return 0
