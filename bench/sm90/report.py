"""The report of `python -m bench kernels`: one row per launch (for an autotuned kernel, the config the
model finds fastest), totals per direction, the text table and the JSON / CSV / text files."""
import math
import os

from bench.sm90 import model as M
from bench.sm90.launches import SHAPES, record_cases
from bench.sm90.toolchain import compile_all, compile_launch


def dot_precision(c):
    """The dots' input types and, for fp32 operands, the input precision: 'bf16', 'tf32', 'tf32x3'..."""
    kinds = sorted({a if a != "f32" else p for a, _, p in c.dots})
    return "+".join(kinds) or "-"


def _rows_of(case, kappa):
    """Model rows of one case: per launch group, the candidate the model finds fastest."""
    impl, name, dims, dt, launches = case
    N, L = dims[:2]
    seq_chunks = -(-L // 64)
    groups = {}
    for lc in launches:
        groups.setdefault((lc.phase, lc.group), []).append(lc)
    rows = []
    for (phase, _), cands in groups.items():
        best = None
        for lc in cands:
            c = compile_launch(lc, seq_chunks)
            est = M.estimate(lc.programs, lc.num_warps, c, kappa) if not c.error else dict(est_s=math.inf)
            if best is None or est["est_s"] < best[2]["est_s"]:
                best = (lc, c, est)
        lc, c, est = best
        loop = c.loop if c.seq_loop else {}
        rows.append(dict(
            impl=impl, shape=name, dtype=dt, mode=phase, kernel=lc.kernel, config=lc.config_text(),
            candidates=len(cands), grid="x".join(map(str, lc.grid)), ctas=lc.programs, warps=lc.num_warps,
            stages=lc.num_stages, regs=c.regs, smem_kb=round(c.smem / 1024, 1), spill_b=c.spill,
            ctas_per_sm=est.get("ctas_per_sm", 0), waves=est.get("waves", 0),
            loop_hgmma=loop.get("hgmma", ""), loop_hmma=loop.get("hmma", ""), loop_instr=loop.get("instr", ""), loop_waits=loop.get("waits", ""),
            loop_bars=loop.get("bars", ""), loop_f2fp=loop.get("f2fp", ""), dots=dot_precision(c),
            hbm_gb=float(f"{est.get('hbm_bytes', 0) / 1e9:.4g}"), gflop=round(est.get("flops", 0) / 1e9, 2),
            bound=est.get("bound", ""), est_us=round(est["est_s"] * 1e6, 1) if c.error == "" else "",
            error=c.error))
    return rows


def report(cases):
    """(rows, totals, kappa): kappa calibrated on FLA's bf16 forward at the anchor shape when recorded."""
    anchor = [cs for cs in cases if cs[0] == "fla" and cs[2] == SHAPES["anchor"] and cs[3] == "bf16"]
    kappa, calibrated = M.KAPPA_DEFAULT, False
    if anchor:
        def fwd_total(kap):
            return sum(r["est_us"] for r in _rows_of(anchor[0], kap) if r["mode"] == "fwd" and r["est_us"] != "") / 1e6
        kappa, calibrated = M.calibrate(fwd_total), True
    rows = [r for cs in cases for r in _rows_of(cs, kappa)]
    totals = {}
    for r in rows:
        t = totals.setdefault((r["impl"], r["shape"], r["dtype"], r["mode"]),
                              dict(impl=r["impl"], shape=r["shape"], dtype=r["dtype"], mode=r["mode"], kernels=0,
                                   est_us=0.0, hbm_gb=0.0, gflop=0.0, spill_kernels=0))
        t["kernels"] += 1
        t["est_us"] = round(t["est_us"] + (r["est_us"] or 0.0), 1)
        t["hbm_gb"] = round(t["hbm_gb"] + r["hbm_gb"], 3)
        t["gflop"] = round(t["gflop"] + r["gflop"], 1)
        t["spill_kernels"] += r["spill_b"] > 0
    for t in totals.values():
        fla = totals.get(("fla", t["shape"], t["dtype"], t["mode"]))
        t["vs_fla"] = round(t["est_us"] / fla["est_us"], 2) if fla and fla["est_us"] else ""
    clamped = calibrated and kappa in (0.0, M.KAPPA_MAX)
    return rows, list(totals.values()), dict(kappa=round(kappa, 3), calibrated=calibrated and not clamped,
                                             calibration_clamped=clamped)


def run_report(shapes, dtypes, modes, fla=True, log=print):
    """(rows, totals, meta) of the whole report. An autotuned (FLA) kernel's configs are all compiled
    and modelled at the first shape only; the other shapes keep the config chosen there (FLA's
    autotune keys hold the head counts and dims, not the token count), which saves ~2/3 of the compiles."""
    cases = record_cases(shapes, dtypes, modes, fla=fla, log=log)
    first = [cs for cs in cases if cs[1] == shapes[0][0]]
    compile_all([lc for *_, launches in first for lc in launches], log=log)
    rows, _, _ = report(first)
    chosen = {(r["impl"], r["dtype"], r["mode"], r["kernel"]): r["config"] for r in rows if r["candidates"] > 1}

    def keep(case):
        impl, name, dims, dt, launches = case
        if name == shapes[0][0]:
            return case
        return (impl, name, dims, dt, [lc for lc in launches if chosen.get(
            (impl, dt, lc.phase, lc.kernel), lc.config_text()) == lc.config_text()])

    cases = [keep(cs) for cs in cases]
    compile_all([lc for *_, launches in cases for lc in launches], log=log)
    return report(cases)


COLUMNS = [("impl", 4), ("mode", 3), ("kernel", 44), ("config", 22), ("ctas", 6), ("warps", 2), ("regs", 3),
           ("smem_kb", 6), ("spill_b", 5), ("ctas_per_sm", 2), ("waves", 3), ("loop_hgmma", 3),
           ("loop_instr", 4), ("loop_waits", 3), ("loop_bars", 3), ("dots", 9), ("hbm_gb", 7), ("gflop", 7),
           ("bound", 4), ("est_us", 8)]
HEAD = dict(impl="impl", mode="dir", kernel="kernel", config="config", ctas="CTAs", warps="w", regs="reg",
            smem_kb="smemKB", spill_b="spill", ctas_per_sm="/SM", waves="wav", loop_hgmma="HGM",
            loop_instr="inst", loop_waits="wt", loop_bars="bar", dots="dots", hbm_gb="HBM GB", gflop="GFLOP",
            bound="bnd", est_us="est us")


def _calibration_text(meta):
    if meta.get("calibration_clamped"):
        return "NOT calibrated: no kappa in the model's range gives FLA's 1.89 ms; clamped"
    if meta["calibrated"]:
        return "calibrated: FLA 0.6.0 bf16 forward at the anchor = 1.89 ms on an H200"
    return "default, not calibrated: FLA not recorded at the anchor shape"


def format_table(rows, totals, meta):
    """The text report: one table per (shape, dtype), then the totals."""
    out = [f"static sm_90 report (no GPU): triton {meta.get('triton', '?')}, model kappa = {meta['kappa']} "
           f"cycles/instruction ({_calibration_text(meta)}).",
           "est us is a MODEL ESTIMATE (bench/NOTES.md, 'sm_90 report'), not a measurement. HGM/inst/wt/bar: per "
           "iteration of the sequential chunk loop (SASS; HGM 'Nh': N HMMA, no HGMMA).", ""]
    keys = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rows))
    for shape, dt in keys:
        out.append(f"== {shape} {dt}")
        out.append(" ".join(f"{HEAD[c]:>{w}}" if c not in ("kernel", "config", "impl", "dots", "bound", "mode")
                            else f"{HEAD[c]:<{w}}" for c, w in COLUMNS))
        for r in rows:
            if (r["shape"], r["dtype"]) != (shape, dt):
                continue
            cells = []
            for c, w in COLUMNS:
                v = r[c]
                if c == "loop_hgmma" and r["loop_hmma"]:
                    v = f"{r['loop_hmma']}h"
                if c == "config" and r["candidates"] > 1:
                    v = f"{v} ({r['candidates']})"
                left = c in ("kernel", "config", "impl", "dots", "bound", "mode")
                cells.append(f"{str(v)[:w] if left else str(v):<{w}}" if left else f"{str(v):>{w}}")
            out.append(" ".join(cells) + (f"  ERROR {r['error']}" if r["error"] else ""))
        out.append("")
    out.append("== totals (sum over the kernels of one direction; vs_fla = est time / FLA's est time)")
    out.append(f"{'impl':<5}{'shape':<24}{'dtype':<6}{'dir':<5}{'kernels':>8}{'est us':>10}{'HBM GB':>9}"
               f"{'GFLOP':>9}{'spilling':>9}{'vs_fla':>8}")
    for t in totals:
        out.append(f"{t['impl']:<5}{t['shape']:<24}{t['dtype']:<6}{t['mode']:<5}{t['kernels']:>8}{t['est_us']:>10}"
                   f"{t['hbm_gb']:>9}{t['gflop']:>9}{t['spill_kernels']:>9}{str(t['vs_fla']):>8}")
    out.append("config (n): an autotuned kernel; the model picked this of its n configs.")
    return "\n".join(out)


def write_outputs(rows, totals, meta, json_path=None, csv_path=None, txt_path=None, text=""):
    import csv
    import json
    for path in (json_path, csv_path, txt_path):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(meta=meta, rows=rows, totals=totals), f, indent=1)
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["impl"])
            w.writeheader()
            w.writerows(rows)
    if txt_path:
        with open(txt_path, "w") as f:
            f.write(text + "\n")
