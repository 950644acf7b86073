"""The sweep: for every job, provider, mode and layout - availability, correctness gate, timing,
figures - as tidy rows (bench/output.py)."""
import traceback
import warnings

import torch

from bench import model, timing
from bench.common import DTYPES, FLA_REFUSES, Skip, sync
from bench.output import row
from bench.providers import PROVIDERS
from bench.registry import SCENARIOS


class Options:
    def __init__(self, *, device, dtype=None, scale=1.0, providers=None, modes=None, warmup=1, repeats=5,
                 budget_s=8.0, cuda_graph=False, baseline=None, memory=True):
        self.device, self.dtype, self.scale = device, dtype, scale
        self.providers, self.modes = providers, modes
        self.warmup, self.repeats, self.budget_s = warmup, repeats, budget_s
        self.cuda_graph, self.memory = cuda_graph, memory
        self.baseline = baseline or ("fla" if device.type == "cuda" else "hf-torch")


def plan(jobs, opt):
    """[(op, scenario, [provider names], [modes])] after the option filters."""
    out = []
    for job in jobs:
        s = SCENARIOS[job.scenario].scaled(opt.scale)
        op = job.op or s.op
        names = [n for n in PROVIDERS[op] if (job.providers is None or n in job.providers)
                 and (opt.providers is None or n in opt.providers)]
        modes = [m for m in job.modes if opt.modes is None or m in opt.modes]
        if names and modes:
            out.append((op, s, names, modes))
    return out


def layouts(s):
    if s.layout == "packing":
        return ("padded", "packed")
    return ("packed",) if s.layout in ("varlen", "decode") else ("dense",)


class Progress:
    """What the sweep reports while it runs (the CLI draws a bar on a terminal and prints a line per
    case otherwise): start(total cases) once, then begin(text) before and done(n, text) after each
    case, or each group of n cases that share one outcome (a provider that cannot run here)."""

    def start(self, total):
        pass

    def begin(self, text):
        pass

    def done(self, n, text):
        pass


def run(jobs, opt, env, progress=None):
    progress = progress or Progress()
    rows, gates = [], {}
    work = plan(jobs, opt)
    progress.start(sum(len(n) * len(m) * len(layouts(s)) for _, s, n, m in work))
    for op, s, names, modes in work:
        dtype_name = opt.dtype or (s.dtype if opt.device.type == "cuda" else "float32")
        base = dict(op=op, scenario=s.name, dtype=dtype_name, real_tokens=s.real_tokens,
                    padded_tokens=s.padded_tokens)
        for name in names:
            progress.begin(f"{op} {s.name} {name}")
            with warnings.catch_warnings(record=True) as caught:      # the usual filters apply
                block = _provider_rows(PROVIDERS[op][name], op, s, modes, dtype_name, opt, env, base, gates,
                                       progress)
            _note_warnings(block, caught)
            rows += block
    _speedups(rows, env, opt.baseline)
    return rows


def _provider_rows(p, op, s, modes, dtype_name, opt, env, base, gates, progress):
    """The rows of one provider on one scenario: availability, gate, then every mode and layout."""
    device, dtype, lay = opt.device, DTYPES[dtype_name], layouts(s)
    where = f"{op} {s.name} {p.name}"
    rows = []
    why = _safe(lambda: p.why_not(device))
    if why:
        for mode in modes:
            rows.append(row(env, **base, provider=p.name, mode=mode, layout="-", metric="status",
                            status="skipped", note=why))
        progress.done(len(modes) * len(lay), f"{where}: skipped - {why}")
        return rows
    for mode in modes:
        grads = mode != "fwd"
        gkey = (p.family.ops, p.name, dtype_name, grads)     # one gate result per family (gdr, packing)
        if gkey not in gates:
            gates[gkey] = _gate(p, device, dtype, grads)
        status, err, detail = gates[gkey]
        rows.append(row(env, **base, provider=p.name, mode=mode, layout="gate", metric="gate_rel_err",
                        p50=err, status=status, note=detail))
        if status != "ok":
            rows.append(row(env, **base, provider=p.name, mode=mode, layout="-", metric="status",
                            status=status, note=("gate: " if status == "failed" else "") + detail))
            progress.done(len(lay), f"{where} {mode}: gate {status} - {detail}")
            continue
        for layout in lay:
            case = _measure(p, op, s, layout, mode, dtype, opt, env, base)
            rows += case
            progress.done(1, f"{where} {mode} {layout}: {_outcome(case)}")
        if s.layout == "packing":
            rows += _packing_rows(rows, env, base, p.name, mode, s)
    return rows


def _outcome(case_rows):
    r = case_rows[0]
    if r["metric"] == "time":
        return f"{r['p50'] * 1e3:.4g} ms"
    return f"{r['status']} - {r['note']}"


# warnings that say nothing about a case: FLA's at import on a machine where Triton has no GPU
# (transformers imports FLA, so every hf-torch row had it; the rows name the device anyway)
NOT_NOTED = ("Triton is not supported on current platform",)


def _note_warnings(rows, caught):
    """Warnings a provider raised go into its rows' notes (but those of NOT_NOTED)."""
    seen = []
    for w in caught:
        text = f"{w.category.__name__}: {(str(w.message).splitlines() or [''])[0]}"
        if any(str(w.message).startswith(n) for n in NOT_NOTED):
            continue
        if text not in seen:
            seen.append(text)
    if not seen:
        return
    for r in rows:
        if r["metric"] in ("time", "status"):
            r["note"] = "; ".join(x for x in (r["note"], "warning " + "; ".join(seen)) if x)


def _safe(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001
        return f"availability check raised {type(e).__name__}: {e}"


def _gate(p, device, dtype, grads):
    """('ok' | 'failed' | 'skipped', max rel. err, detail)."""
    try:
        ok, errs, detail = p.gate(device, dtype, grads)
    except Skip as e:
        return "skipped", None, str(e)
    except NotImplementedError as e:
        return "skipped", None, f"not implemented: {e}"
    except Exception as e:  # noqa: BLE001 - a crashing provider is a failing one
        if _fla_refuses(e):
            return "skipped", None, _fla_refuses(e)
        return "failed", None, f"gate raised {type(e).__name__}: {_first_line(e)}"
    worst = max(errs.values()) if errs else None
    return ("ok" if ok else "failed"), worst, detail


def _fla_refuses(e):
    """The skip note when e is fla-core refusing to run here (bench.common.FLA_REFUSES), else ''."""
    return f"fla refuses here: {_first_line(e)}" if FLA_REFUSES in str(e) else ""


def _first_line(e):
    return (str(e).splitlines() or [""])[0][:300]


def _measure(p, op, s, layout, mode, dtype, opt, env, base):
    device = opt.device
    r = lambda **kw: row(env, **base, provider=p.name, mode=mode, layout=layout, **kw)  # noqa: E731
    try:
        case = p.build(s, layout, mode, device, dtype)

        def fn():
            out = case.fn()
            sync(device)
            return out
        if device.type == "cuda":
            (p50, p20, p80), n = timing.time_gpu(case.fn, cuda_graph=opt.cuda_graph)
            mem, how = timing.peak_memory(fn, device) if opt.memory else (None, "")
        else:   # the first warm-up call is the memory call (RSS grows there, later calls reuse it)
            mem, how = timing.peak_memory(fn, device) if opt.memory and opt.warmup else (None, "")
            (p50, p20, p80), n = timing.time_cpu(fn, warmup=opt.warmup - (mem is not None),
                                                 repeats=opt.repeats, budget_s=opt.budget_s)
    except Skip as e:
        return [r(metric="status", status="skipped", note=str(e))]
    except NotImplementedError as e:
        return [r(metric="status", status="skipped", note=f"not implemented: {_first_line(e)}")]
    except torch.cuda.OutOfMemoryError as e:
        return [r(metric="status", status="failed", note=f"out of memory: {_first_line(e)}")]
    except Exception as e:  # noqa: BLE001
        if _fla_refuses(e):
            return [r(metric="status", status="skipped", note=_fla_refuses(e))]
        traceback.print_exc()
        return [r(metric="status", status="failed", note=f"{type(e).__name__}: {_first_line(e)}")]
    note = "; ".join(x for x in (case.note, f"{n} of {opt.repeats} timed runs (--budget-s)"
                                 if n and n < opt.repeats else "") if x)
    out = [r(metric="time", unit="s", p50=p50, p20=p20, p80=p80, note=note)]
    tok = s.real_tokens
    out.append(r(metric="tokens_per_s", unit="real tokens/s", p50=tok / p50, p20=tok / p80, p80=tok / p20))
    fl, by = model.flops(s, op, mode), model.bytes_moved(s, op, mode)
    if fl:
        out.append(r(metric="tflops", unit="TFLOP/s (model, real tokens)", p50=fl / p50 / 1e12,
                     p20=fl / p80 / 1e12, p80=fl / p20 / 1e12))
    if by:
        out.append(r(metric="gbps", unit="GB/s (model minimum bytes)", p50=by / p50 / 1e9,
                     p20=by / p80 / 1e9, p80=by / p20 / 1e9))
    peaks = model.gpu_peaks(env["device_name"], s.dtype if device.type == "cuda" else "float32") \
        if device.type == "cuda" else None
    floor = model.roofline_floor(fl, by, peaks)
    if floor:
        out.append(r(metric="roofline_frac", unit=f"floor/time ({peaks[2]})", p50=floor / p50,
                     p20=floor / p80, p80=floor / p20))
    if mem is not None:
        out.append(r(metric="peak_mem", unit=f"bytes ({how})", p50=float(mem)))
    return out


def _packing_rows(rows, env, base, name, mode, s):
    def t(layout):
        for x in rows:
            if (x["provider"], x["mode"], x["layout"], x["metric"], x["scenario"], x["op"]) == \
                    (name, mode, layout, "time", s.name, base["op"]):
                return x
    pad, pk = t("padded"), t("packed")
    if not pad or not pk:
        return []
    ideal = s.padded_tokens / s.real_tokens
    ratio = pad["p50"] / pk["p50"]
    r = lambda **kw: row(env, **base, provider=name, mode=mode, layout="packed", **kw)  # noqa: E731
    return [r(metric="padded_over_packed", unit="x (time padded / time packed)", p50=ratio,
              p20=pad["p20"] / pk["p80"], p80=pad["p80"] / pk["p20"]),
            r(metric="ideal_ratio", unit="x (padded tokens / real tokens)", p50=ideal),
            r(metric="ratio_vs_ideal", unit="fraction of the ideal ratio", p50=ratio / ideal)]


def _speedups(rows, env, baseline):
    times = {}
    for x in rows:
        if x["metric"] == "time":
            times[(x["op"], x["scenario"], x["mode"], x["layout"], x["provider"])] = x
    for (op, sc, mode, layout, prov), x in list(times.items()):
        b = times.get((op, sc, mode, layout, baseline))
        if b is None:
            continue
        rows.append(dict(x, metric="speedup", unit=f"x vs {baseline} (time {baseline} / time)",
                         p50=b["p50"] / x["p50"], p20=b["p20"] / x["p80"], p80=b["p80"] / x["p20"],
                         note=""))

