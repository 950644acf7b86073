"""Tidy result rows, the files they go to, and the terminal tables.

One row per (op, scenario, provider, mode, layout, metric): p50/p20/p80 of that metric, plus the run's
environment on every row (Liger-style tidy CSV; the JSON file holds {"meta": ..., "rows": [...]}).
Each run writes a new pair of files <out>/<date>_<time>_<suite>_<device>.{csv,json}, by default in
bench/results/local/, which git ignores; results worth keeping are copied to bench/results/ by hand
under a name that says what they are.
"""
import csv
import datetime as dt
import json
import math
import os
import platform
import re
import subprocess

FIELDS = ["op", "scenario", "provider", "mode", "layout", "dtype", "device", "metric", "unit",
          "p50", "p20", "p80", "status", "note", "real_tokens", "padded_tokens", "git_sha",
          "torch_version", "triton_version", "cuda_version", "device_name", "timestamp"]


def environment(device):
    import torch
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu {platform.machine()} ({torch.get_num_threads()} threads)"
    return dict(git_sha=sha, torch_version=torch.__version__, triton_version=triton_v,
                cuda_version=torch.version.cuda or "", device_name=name, device=device.type,
                timestamp=dt.datetime.now().isoformat(timespec="seconds"))


def row(env, *, op, scenario, provider, mode, layout, dtype, metric, unit="", p50=None, p20=None,
        p80=None, status="ok", note="", real_tokens="", padded_tokens=""):
    r = {k: env.get(k, "") for k in FIELDS}
    r.update(op=op, scenario=scenario, provider=provider, mode=mode, layout=layout, dtype=dtype,
             metric=metric, unit=unit, status=status, note=note, real_tokens=real_tokens,
             padded_tokens=padded_tokens)
    for k, x in (("p50", p50), ("p20", p20), ("p80", p80)):
        r[k] = "" if x is None or (isinstance(x, float) and math.isnan(x)) else x
    return r


def save(rows, env, out_dir, suite):
    os.makedirs(out_dir, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    dev = re.sub(r"[^A-Za-z0-9]+", "-", env["device_name"] if env["device"] == "cuda" else "cpu").strip("-")
    base = os.path.join(out_dir, f"{stamp}_{suite}_{dev}")
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    with open(base + ".json", "w") as f:
        json.dump({"meta": dict(env, suite=suite), "rows": rows}, f, indent=1)
    return base + ".csv", base + ".json"


def load(path):
    """Rows of a results file (.csv or .json), numbers as floats (None when empty)."""
    if path.endswith(".json"):
        with open(path) as f:
            rows = json.load(f)["rows"]
    else:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("p50", "p20", "p80"):
            r[k] = float(r[k]) if r.get(k) not in ("", None) else None
    return rows


# ---------------------------------------------------------------------------------------------- tables
# Terminal output: one table per (op, scenario) under a heading line that carries the names, so the
# tables hold only short columns (provider, mode, layout, numbers) and the notes, which are the only
# cells that wrap. Columns without a value in a table are left out (e.g. roofline on CPU).
def _fmt(x, spec):
    return "" if x in ("", None) else format(x, spec)


def _ms(x):
    return "" if x in ("", None) else (f"{x * 1e3:.3g}" if x * 1e3 < 100 else f"{x * 1e3:.0f}")


def _grouped(rows):
    """{(op, scenario): {(provider, mode, layout): {metric: row}}}, in the rows' order."""
    groups = {}
    for r in rows:
        case = groups.setdefault((r["op"], r["scenario"]), {})
        case.setdefault((r["provider"], r["mode"], r["layout"]), {})[r["metric"]] = r
    return groups


def _heading(group):
    """'op  scenario  dtype, tokens' from any row of the group."""
    r = next(iter(next(iter(group.values())).values()))
    real, padded = r["real_tokens"], r["padded_tokens"]
    tokens = f"{real} real tokens" + (f", {padded} padded" if str(padded) != str(real) else "")
    return f"[bold]{r['op']}  {r['scenario']}[/]  {r['dtype']}, {tokens}"


NOTE_MIN_WIDTH = 12


def _table(columns, cells, width, drop_order=()):
    """(rich Table of `cells`, names of the columns left out). columns: (header, justify, wraps); only
    a wrapping column (the note) folds its text, the others never wrap. Columns empty in every row
    are left out, then the columns of `drop_order`, in that order, until the table fits `width`."""
    from rich import box
    from rich.table import Table
    from rich.text import Text
    keep = [j for j in range(len(columns)) if any(row[j] for row in cells)]

    def need(j):
        header, _, wraps = columns[j]
        return NOTE_MIN_WIDTH if wraps else max(len(header), *(Text.from_markup(row[j]).cell_len for row in cells))
    dropped = []
    for name in drop_order:
        if sum(need(j) for j in keep) + 3 * (len(keep) - 1) <= width:
            break
        j = next((j for j in keep if columns[j][0] == name), None)
        if j is not None:
            keep.remove(j)
            dropped.append(name)
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for j in keep:
        header, justify, wraps = columns[j]
        t.add_column(header, justify=justify, no_wrap=not wraps, overflow="fold",
                     min_width=NOTE_MIN_WIDTH if wraps else None)
    for row in cells:
        t.add_row(*(row[j] for j in keep))
    return t, dropped


def skipped_lines(rows):
    """One line per (provider, reason) of the skipped cases, naming the ops and scenarios."""
    seen = {}
    for r in rows:
        if r["metric"] == "status" and r["status"] == "skipped":
            seen.setdefault((r["provider"], r["note"]), set()).add(f"{r['op']}:{r['scenario']}")
    return [f"SKIPPED {prov}: {note}  [{', '.join(sorted(where))}]" for (prov, note), where in seen.items()]


RESULT_DROP_ORDER = ("tok/s", "GB/s", "p20-p80", "mem MB", "TFLOP/s", "roofline")


def result_tables(rows, baseline, width):
    """([(heading, rich Table)], one per (op, scenario) with a timed or failed case; the columns left
    out to fit `width`). Skipped cases are listed apart (skipped_lines)."""
    columns = [("provider", "left", False), ("mode", "left", False), ("layout", "left", False),
               ("ms p50", "right", False), ("p20-p80", "right", False), ("tok/s", "right", False),
               ("TFLOP/s", "right", False), ("GB/s", "right", False), ("roofline", "right", False),
               ("mem MB", "right", False), (f"vs {baseline}", "right", False), ("note", "left", True)]
    out, dropped = [], set()
    for group in _grouped(rows).values():
        cells = []
        for key, m in group.items():
            if "time" in m:
                tm = m["time"]
                g = lambda n: m[n]["p50"] if n in m else None  # noqa: E731
                frac = g("roofline_frac")
                mem = g("peak_mem")
                cells.append([*key, _ms(tm["p50"]), f"{_ms(tm['p20'])}-{_ms(tm['p80'])}",
                              _fmt(g("tokens_per_s"), ".3g"), _fmt(g("tflops"), ".3g"), _fmt(g("gbps"), ".3g"),
                              "" if frac in ("", None) else f"{100 * frac:.1f}%",
                              _fmt(None if mem in ("", None) else mem / 2**20, ".0f"),
                              "" if g("speedup") in ("", None) else f"{g('speedup'):.2f}x", tm["note"]])
            elif "status" in m and m["status"]["status"] == "failed":
                cells.append([*key] + [""] * 8 + [f"[red]FAILED: {m['status']['note']}[/]"])
        if cells:
            t, left_out = _table(columns, cells, width, RESULT_DROP_ORDER)
            out.append((_heading(group), t))
            dropped.update(left_out)
    return out, [c for c in RESULT_DROP_ORDER if c in dropped]


PACKING_DROP_ORDER = ("padded ms", "packed ms")


def packing_tables(rows, width):
    """[(heading, rich Table)] of padded vs packed time, one per packing scenario."""
    columns = [("provider", "left", False), ("mode", "left", False), ("padded ms", "right", False),
               ("packed ms", "right", False), ("padded/packed", "right", False), ("ideal", "right", False),
               ("of ideal", "right", False)]
    out = []
    for group in _grouped(rows).values():
        cells = []
        for (prov, mode, layout), m in group.items():
            if "padded_over_packed" not in m:
                continue
            pad = group.get((prov, mode, "padded"), {}).get("time", {}).get("p50")
            pkd = m.get("time", {}).get("p50")
            cells.append([prov, mode, _ms(pad), _ms(pkd), f"{m['padded_over_packed']['p50']:.2f}x",
                          _fmt(m["ideal_ratio"]["p50"], ".2f") + "x", _fmt(m["ratio_vs_ideal"]["p50"], ".2f")])
        if cells:
            out.append((_heading(group), _table(columns, cells, width, PACKING_DROP_ORDER)[0]))
    return out


def legend(rows, baseline, dropped=()):
    """The line under the result tables: what the counts, ratios and memory readings mean."""
    cases = sum(1 for r in rows if r["metric"] == "time")
    narrow = f" Left out to fit the terminal: {', '.join(dropped)}." if dropped else ""
    return (f"{cases} timed cases; the result files hold {len(rows)} rows (one per metric of a case)."
            f"{narrow} ms: median and 20th-80th percentile of the timed calls (on CPU --repeats of them, "
            f"fewer when --budget-s runs out: the note says so). vs {baseline}: its time / "
            "this time. mem MB: peak extra memory of one call (on CPU the growth of the resident set, 0 "
            "when the allocator reused memory it already held).")


PACKING_LEGEND = ("padded/packed: time of the padded batch (one document per row) / time of the packed "
                  "row. ideal: padded tokens / real tokens, what skipping the pad saves at equal speed "
                  "per token. of ideal: (padded/packed) / ideal; above 1 when the padded batch is also "
                  "slower per token (e.g. it falls out of cache).")
