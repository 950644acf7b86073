"""The report of `python -m bench kernels`: one row per launch (for an autotuned kernel, the config the
model finds fastest), totals per direction (a fork's two lanes taken together: model.lanes), the text
table and the JSON / CSV / text files."""
import math
import os
import re

from bench.sm90 import cuda_chunk, cuda_table
from bench.sm90 import model as M
from bench.sm90 import validate as V
from bench.sm90.launches import Launch, TorchOp, record_cases
from bench.sm90.toolchain import compile_all, compile_launch


def dot_precision(c):
    """The dots' input types and, for fp32 operands, the input precision: 'bf16', 'tf32', 'tf32x3'..."""
    kinds = sorted({a if a != "f32" else p for a, _, p in c.dots})
    return "+".join(kinds) or "-"


def _estimate(lc, c, const, sms=M.NUM_SMS):
    if c.error:
        return dict(est_s=math.inf, bound="error")
    return M.estimate(c, lc.programs, lc.num_warps, lc.seq_lens, M.footprint(lc.tensors), const, sms)


def _us(t):
    return round(t * 1e6, 1) if t is not None and math.isfinite(t) else ""


def _complete(row):
    """A row with every column of the table (the missing ones empty)."""
    return {c: "" for c, _ in COLUMNS} | dict(loop_hmma="", loop_f2fp="", step_stalls={}, error="") | row


def _lane(lc):
    """A row's lane column: "" outside a fork, else "<fork> main" / "<fork> side"."""
    return f"{lc.lane[0]} {lc.lane[1]}" if lc.lane else ""


def _sms_held(r):
    """The SMs a modelled row's CTAs hold at once (the main lane's, which the side lane runs beside)."""
    return min(M.NUM_SMS, math.ceil(r["ctas"] / max(1, r["ctas_per_sm"] or 1))) if r["ctas"] != "" else M.NUM_SMS


def _rows_of(case, const):
    """Model rows of one case: per launch group, the candidate the model finds fastest. The launches of a
    fork's side lane (gdn_packed._runtime.fork) are modelled on the SMs its main lane leaves (lane_sms)."""
    impl, name, dims, dt, launches = case
    N, L = dims[:2]
    seq_chunks = -(-L // M.CHUNK)
    groups, ops = {}, {}
    rows = []
    for lc in launches:
        side = lc.lane[1:] == ("side",)
        if side and not isinstance(lc, Launch):
            raise ValueError(f"{lc.kernel}: only Triton launches are modelled in a fork's side lane")
        if isinstance(lc, TorchOp):
            if lc.lane:
                raise ValueError(f"{lc.kernel}: torch operators are not modelled in a fork")
            ops.setdefault(lc.phase, []).append(lc)
        elif isinstance(lc, cuda_chunk.CudaLaunch):     # the CUDA kernel models itself (bench/sm90/cuda_chunk.py)
            rows.append(dict(cuda_chunk.row(name, dims, dt, const, lc), lane=_lane(lc)))
        elif isinstance(lc, cuda_table.TableLaunch):    # csrc's chunk table (bench/sm90/cuda_table.py)
            rows += [_complete(dict(r, lane=_lane(lc))) for r in cuda_table.rows(lc, name, dt, impl, const)]
        else:
            groups.setdefault((side, lc.phase, lc.group), []).append(lc)
    for (side, phase, _), cands in sorted(groups.items(), key=lambda kv: kv[0][0]):    # the side lanes last
        sms = M.NUM_SMS
        if side:
            held = [_sms_held(r) for r in rows if r.get("lane") == f"{cands[0].lane[0]} main"]
            sms = M.NUM_SMS - max(held, default=0)
        best = None
        for lc in cands:
            if impl == "fla" and not V.fla_config_allowed(lc.kernel, lc.num_warps):
                continue
            c = compile_launch(lc, seq_chunks)
            est = _estimate(lc, c, const, sms if sms > 0 else M.NUM_SMS)    # no SM left: after the main lane
            if best is None or est["est_s"] < best[2]["est_s"]:
                best = (lc, c, est)
        lc, c, est = best
        loop = c.loop if c.seq_loop else {}
        step = M.chunk_step(c, const) if not c.error else None
        rows.append(dict(
            impl=impl, shape=name, dtype=dt, mode=phase, kernel=lc.kernel, config=lc.config_text(),
            candidates=len(cands), grid="x".join(map(str, lc.grid)), ctas=lc.programs, warps=lc.num_warps,
            stages=lc.num_stages, regs=c.regs, smem_kb=round(c.smem / 1024, 1), spill_b=c.spill,
            ctas_per_sm=est.get("ctas_per_sm", 0), waves=est.get("waves", 0),
            loop_hgmma=loop.get("hgmma", ""), loop_hmma=loop.get("hmma", ""), loop_instr=loop.get("instr", ""),
            loop_waits=loop.get("waits", ""), loop_bars=loop.get("bars", ""), loop_f2fp=loop.get("f2fp", ""),
            step_cycles=round(step["cycles"]) if step else "",
            step_stalls={k: round(v) for k, v in step["stalls"].items()} if step else {},
            dots=dot_precision(c), hbm_gb=float(f"{est.get('hbm_bytes', 0) / 1e9:.4g}"),
            gflop=round(est.get("flops", 0) / 1e9, 2), lat_us=_us(est.get("t_lat")), bytes_us=_us(est.get("t_mem")),
            flops_us=_us(est.get("t_tc")), smem_us=_us(est.get("t_smem")), bound=est.get("bound", ""),
            est_us=round(est["est_s"] * 1e6, 1) if c.error == "" else "", error=c.error, lane=_lane(lc),
            **(dict(lane_sms=max(sms, 0), alone_us=_us(_estimate(lc, c, const)["est_s"])) if side else {})))
    for phase, these in ops.items():
        est = M.torch_estimate(sum(op.bytes for op in these), len(these), const)
        rows.append(dict(
            impl=impl, shape=name, dtype=dt, mode=phase, kernel=f"torch ops ({len(these)} launches)", config="",
            candidates=1, grid="", ctas="", warps="", stages="", regs="", smem_kb="", spill_b=0, ctas_per_sm="",
            waves="", loop_hgmma="", loop_hmma="", loop_instr="", loop_waits="", loop_bars="", loop_f2fp="",
            step_cycles="", step_stalls={}, dots="-", hbm_gb=float(f"{est['hbm_bytes'] / 1e9:.4g}"), gflop=0.0,
            lat_us="", bytes_us=_us(est["t_mem"]), flops_us="", bound="bytes", est_us=round(est["est_s"] * 1e6, 1),
            error="", lane="", ops=sorted({op.kernel[6:] for op in these})))
    return rows


def _fork_total(fork, rows, const):
    """The time of one fork's rows (its two lanes at once, model.lanes), with what they take in sequence."""
    terms = lambda r: {k: (r[c] or 0.0) * 1e-6 for k, c in (("t_lat", "lat_us"), ("t_mem", "bytes_us"),  # noqa: E731
                                                           ("t_smem", "smem_us"), ("t_tc", "flops_us"),
                                                           ("est_s", "est_us"))}
    main = [terms(r) for r in rows if r["lane"].endswith("main")]
    side = [r for r in rows if r["lane"].endswith("side")]
    sms = min((r["lane_sms"] for r in side), default=0)
    t, bound = M.lanes(main, [dict(terms(r), alone_s=(r["alone_us"] or 0.0) * 1e-6) for r in side], sms, const)
    return dict(fork=int(fork), est_us=round(t * 1e6, 1), bound=bound, side_sms=sms,
                sequence_us=round(sum(r.get("alone_us", r["est_us"]) or 0.0 for r in rows), 1),
                main=[r["kernel"] for r in rows if r["lane"].endswith("main")], side=[r["kernel"] for r in side])


def report(cases, const=None):
    """(rows, totals, meta) of recorded cases under the model's constants (model.CONSTANTS)."""
    const = const or M.CONSTANTS
    rows = [r for cs in cases for r in _rows_of(cs, const)]
    totals, forks = {}, {}
    for r in rows:
        key = (r["impl"], r["shape"], r["dtype"], r["mode"])
        t = totals.setdefault(key, dict(impl=r["impl"], shape=r["shape"], dtype=r["dtype"], mode=r["mode"], kernels=0,
                                        est_us=0.0, hbm_gb=0.0, gflop=0.0, spill_kernels=0))
        t["kernels"] += 1
        if r.get("lane"):
            forks.setdefault(key + (r["lane"].split()[0],), []).append(r)
        else:
            t["est_us"] = round(t["est_us"] + (r["est_us"] or 0.0), 1)
        t["hbm_gb"] = round(t["hbm_gb"] + r["hbm_gb"], 3)
        t["gflop"] = round(t["gflop"] + r["gflop"], 1)
        t["spill_kernels"] += r["spill_b"] > 0
    for (*key, fork), these in forks.items():
        t = totals[tuple(key)]
        t.setdefault("lanes", []).append(_fork_total(fork, these, const))
        t["est_us"] = round(t["est_us"] + t["lanes"][-1]["est_us"], 1)
    for t in totals.values():
        fla = totals.get(("fla", t["shape"], t["dtype"], t["mode"]))
        t["vs_fla"] = round(t["est_us"] / fla["est_us"], 2) if fla and fla["est_us"] else ""
    return rows, list(totals.values()), dict(constants=const.as_dict())


def run_report(shapes, dtypes, modes, fla=True, kernels=None, ext=True, log=print):
    """(rows, totals, meta) of the whole report. An autotuned (FLA) kernel's configs are all compiled
    and modelled at the first shape only; the other shapes keep the config chosen there (FLA's
    autotune keys hold the head counts and dims, not the token count), which saves ~2/3 of the compiles.
    kernels: a regular expression; only the launches whose kernel name it finds are kept. ext: as with
    gdn_packed._C built (launches.record_cases)."""
    cases = record_cases(shapes, dtypes, modes, fla=fla, ext=ext, log=log)
    if kernels:
        cases = [(*cs[:4], [lc for lc in cs[4] if re.search(kernels, lc.kernel)]) for cs in cases]
    first = [cs for cs in cases if cs[1] == shapes[0][0]]
    compile_all([lc for *_, launches in first for lc in launches if isinstance(lc, Launch)], log=log)
    rows, _, _ = report(first)
    chosen = {(r["impl"], r["dtype"], r["mode"], r["kernel"]): r["config"] for r in rows if r["candidates"] > 1}

    def keep(case):
        impl, name, dims, dt, launches = case
        if name == shapes[0][0]:
            return case
        return (impl, name, dims, dt, [lc for lc in launches if chosen.get(
            (impl, dt, lc.phase, lc.kernel), lc.config_text()) == lc.config_text()])

    cases = [keep(cs) for cs in cases]
    compile_all([lc for *_, launches in cases for lc in launches if isinstance(lc, Launch)], log=log)
    return report(cases)


COLUMNS = [("impl", 4), ("mode", 3), ("kernel", 44), ("config", 22), ("lane", 6), ("ctas", 6), ("warps", 2),
           ("regs", 3), ("smem_kb", 6), ("spill_b", 5), ("ctas_per_sm", 2), ("waves", 3), ("loop_hgmma", 3),
           ("loop_instr", 4), ("loop_waits", 3), ("loop_bars", 3), ("step_cycles", 5), ("dots", 9), ("hbm_gb", 7),
           ("gflop", 7), ("lat_us", 8), ("bytes_us", 8), ("flops_us", 7), ("smem_us", 7), ("bound", 7),
           ("est_us", 8)]
HEAD = dict(impl="impl", mode="dir", kernel="kernel", config="config", lane="lane", ctas="CTAs", warps="w",
            regs="reg", smem_kb="smemKB", spill_b="spill", ctas_per_sm="/SM", waves="wav", loop_hgmma="HGM",
            loop_instr="inst", loop_waits="wt", loop_bars="bar", step_cycles="cyc", dots="dots", hbm_gb="HBM GB",
            gflop="GFLOP", lat_us="lat us", bytes_us="bytes us", flops_us="flop us", smem_us="smem us", bound="bound",
            est_us="est us")
LEFT = ("kernel", "config", "lane", "impl", "dots", "bound", "mode")


def format_table(rows, totals, meta):
    """The text report: one table per (shape, dtype), then the totals."""
    install = ("a Triton-only install (no gdn_packed._C): our chunk table as torch operators"
               if meta.get("install") == "triton-only" else
               "the package built (gdn_packed._C): our chunk table from csrc/chunk_table.cu, 2 launches")
    out = [f"static sm_90 report (no GPU): triton {meta.get('triton', '?')}; model constants: "
           f"{M.Constants.from_dict(meta['constants']).text()}.", f"Modelled as {install}.",
           "est us is a MODEL ESTIMATE (bench/NOTES.md, 'sm_90 report'), not a measurement: max(lat (+) max(bytes, "
           "smem), flop, narrow) + launch, (+) = (lat^p + mem^p)^(1/p), p = overlap x CTAs/SM; smem: shared-memory "
           "wavefronts with bank conflicts (banks.py); bound = the largest. HGM/inst/wt/bar: per iteration of the sequential chunk loop (SASS; HGM "
           "'Nh': N HMMA, no HGMMA); cyc: one warp's cycles per chunk step on its critical path.", ""]
    keys = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rows))
    for shape, dt in keys:
        out.append(f"== {shape} {dt}")
        out.append(" ".join(f"{HEAD[c]:>{w}}" if c not in LEFT else f"{HEAD[c]:<{w}}" for c, w in COLUMNS))
        for r in rows:
            if (r["shape"], r["dtype"]) != (shape, dt):
                continue
            cells = []
            for c, w in COLUMNS:
                v = r.get(c, "")
                if c == "loop_hgmma" and r["loop_hmma"]:
                    v = f"{r['loop_hmma']}h"
                if c == "config" and r["candidates"] > 1:
                    v = f"{v} ({r['candidates']})"
                left = c in LEFT
                cells.append(f"{str(v)[:w] if left else str(v):<{w}}" if left else f"{str(v):>{w}}")
            out.append(" ".join(cells) + (f"  ERROR {r['error']}" if r["error"] else ""))
        out.append("")
    out.append("== totals (sum over the kernels of one direction, a fork's lanes taken together: the lines below; "
               "vs_fla = est time / FLA's est time)")
    out.append(f"{'impl':<5}{'shape':<24}{'dtype':<6}{'dir':<5}{'kernels':>8}{'est us':>10}{'HBM GB':>9}"
               f"{'GFLOP':>9}{'spilling':>9}{'vs_fla':>8}")
    for t in totals:
        out.append(f"{t['impl']:<5}{t['shape']:<24}{t['dtype']:<6}{t['mode']:<5}{t['kernels']:>8}{t['est_us']:>10}"
                   f"{t['hbm_gb']:>9}{t['gflop']:>9}{t['spill_kernels']:>9}{str(t['vs_fla']):>8}")
    for t in totals:
        for f in t.get("lanes", ()):
            where = f"on the {f['side_sms']} SMs it leaves" if f["side_sms"] else "after it (it leaves no SM)"
            out.append(f"{t['impl']} {t['shape']} {t['dtype']} {t['mode']}: lanes (fork {f['fork']}): "
                       f"{', '.join(f['side'])} beside {', '.join(f['main'])}, {where}: {f['est_us']} us "
                       f"(bound: {f['bound']}; {f['sequence_us']} one after the other)")
    out.append("config (n): an autotuned kernel; the model picked this of its n configs. lanes: launches that run at "
               "once (a side stream); a side lane's rows are modelled on the SMs the main lane leaves.")
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
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)) or ["impl"])
            w.writeheader()
            w.writerows(rows)
    if txt_path:
        with open(txt_path, "w") as f:
            f.write(text + "\n")
