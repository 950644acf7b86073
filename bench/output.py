"""Tidy result rows, the files they go to, and the terminal tables.

One row per (op, scenario, provider, mode, layout, metric): p50/p20/p80 of that metric, plus the run's
environment on every row (Liger-style tidy CSV; the JSON file holds {"meta": ..., "rows": [...]}).
Each run writes a new pair of files bench/results/<date>_<time>_<suite>_<device>.{csv,json}.
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
def _fmt(x, spec):
    return "" if x in ("", None) else format(x, spec)


def _ms(x):
    return "" if x in ("", None) else (f"{x * 1e3:.3g}" if x * 1e3 < 100 else f"{x * 1e3:.0f}")


def skipped_lines(rows):
    """One line per (provider, reason) of the skipped cases, naming the ops and scenarios."""
    seen = {}
    for r in rows:
        if r["metric"] == "status" and r["status"] == "skipped":
            seen.setdefault((r["provider"], r["note"]), set()).add(f"{r['op']}:{r['scenario']}")
    return [f"SKIPPED {prov}: {note}  [{', '.join(sorted(where))}]" for (prov, note), where in seen.items()]


def tables(rows, baseline):
    """(results table, packing table or None) as rich Tables; skipped cases are listed apart
    (skipped_lines)."""
    from rich.table import Table
    cases = {}
    for r in rows:
        key = (r["op"], r["scenario"], r["provider"], r["mode"], r["layout"])
        cases.setdefault(key, {})[r["metric"]] = r
    t = Table(title=f"gdn_packed benchmark (speed-up vs {baseline})", show_lines=False)
    for c, j in (("op", "left"), ("scenario", "left"), ("provider", "left"), ("mode", "left"),
                 ("layout", "left"), ("p50 ms", "right"), ("p20-p80 ms", "right"), ("tok/s", "right"),
                 ("TFLOP/s", "right"), ("GB/s", "right"), ("roofline", "right"), ("mem MB", "right"),
                 ("speed-up", "right"), ("status / note", "left")):
        t.add_column(c, justify=j, overflow="fold")
    for key, m in cases.items():
        if "time" in m:
            tm = m["time"]
            g = lambda n: m[n]["p50"] if n in m else None  # noqa: E731
            t.add_row(*key, _ms(tm["p50"]), f"{_ms(tm['p20'])}-{_ms(tm['p80'])}", _fmt(g("tokens_per_s"), ".3g"),
                      _fmt(g("tflops"), ".3g"), _fmt(g("gbps"), ".3g"),
                      _fmt(g("roofline_frac") and 100 * g("roofline_frac"), ".1f") + ("%" if "roofline_frac" in m else ""),
                      _fmt(g("peak_mem") and g("peak_mem") / 2**20, ".0f"),
                      _fmt(g("speedup"), ".2f") + ("x" if "speedup" in m else ""), tm["note"])
        elif "status" in m and m["status"]["status"] == "failed":
            t.add_row(*key, "", "", "", "", "", "", "", "", f"[red]FAILED: {m['status']['note']}[/]")
    pk = [r for r in rows if r["metric"] == "padded_over_packed"]
    if not pk:
        return t, None
    p = Table(title="packing: the same documents padded (one per row) vs packed (cu_seqlens)")
    for c in ("op", "scenario", "provider", "mode", "padded ms", "packed ms", "padded/packed",
              "ideal (padded/real tokens)", "fraction of ideal"):
        p.add_column(c, overflow="fold")
    for r in pk:
        key = (r["op"], r["scenario"], r["provider"], r["mode"])
        pad = cases.get(key + ("padded",), {}).get("time", {}).get("p50")
        pkd = cases.get(key + ("packed",), {}).get("time", {}).get("p50")
        ideal = cases.get(key + ("packed",), {}).get("ideal_ratio", {}).get("p50")
        frac = cases.get(key + ("packed",), {}).get("ratio_vs_ideal", {}).get("p50")
        p.add_row(*key, _ms(pad), _ms(pkd), f"{r['p50']:.2f}x", _fmt(ideal, ".2f") + "x", _fmt(frac, ".2f"))
    return t, p
