"""FLA's published H200 times (published_h200.csv, from QwenLM/FlashQLA) against the model: its FIT
constants fitted on some rows (TRAIN), every other row predicted, each row's error reported.

How a row is modelled: FLA 0.6.0's chunk_gated_delta_rule is recorded at the row's sequence lengths and
head counts as FlashQLA's script calls FLA (bf16, K = V = 128, cu_seqlens, an initial state; the
backward with dht), on meta tensors (launches.record_fla); each launch takes the per-CTA facts
(registers, shared memory, SASS, TTIR) of the same kernel and config compiled at the reference heads
(16 qk / 32 v heads, one 32768-token sequence: head counts enter FLA's kernels as index constants
only) and its own grid, sequence lengths and tensor sizes; a row's time is the sum of its launches'.
Autotuned kernels: FLA's autotuner times every config at the first call of each key (head counts, K,
V, ...; not the token count), so for each direction and head counts the model takes, per autotuned
launch, the config it finds fastest at the first row of the table with those heads: what an autotuner
measuring real time picks if the model is right (circular: a wrong model may pick a wrong config).

collect() does the recording and compiling (minutes) and returns plain data (FACTS, committed gzipped
in bench/results/); Check(data) models every row from it in seconds (tests and the report use that)."""
import csv
import gzip
import json
import math
import os
import re
import types

from bench.sm90 import model as M
from bench.sm90 import sass

HERE = os.path.dirname(os.path.abspath(__file__))
PUBLISHED = os.path.join(HERE, "published_h200.csv")
FACTS = os.path.join(os.path.dirname(HERE), "results", "sm90_validated_facts.json.gz")
REFERENCE = (16, 32)
# the rows (direction, h_qk, h_v) the constants are fitted on; every other row is held out
TRAIN = (("fwd", 16, 32), ("fwd", 2, 8), ("bwd", 16, 32), ("bwd", 2, 4))
# FLA's state kernels (forward h, backward dhu) have 2-warp (mma.sync) and 4-warp (wgmma) configs. Which
# one FLA's autotuner runs turns on the cost of the wgmma path, which FLA's rows cannot pin and the
# model's physical constants may under-state (bench/NOTES.md, "wgmma latency"), so the model does not
# pick it: the warps of those kernels are a discrete choice fitted on the TRAIN rows (fit()); the other
# configs are the model's choice as before.
STATE_KERNELS = ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64")
STATE_WARPS = 2


def fla_config_allowed(kernel, warps, state_warps=None):
    """Whether FLA's autotuner can run this config of `kernel` here (STATE_WARPS for its state kernels)."""
    return kernel not in STATE_KERNELS or warps == (STATE_WARPS if state_warps is None else state_warps)


def load_published(path=PUBLISHED):
    """The published rows: mode, config, seqlens, lengths (tuple), h_qk, h_v, fla_ms, ..."""
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for r in rows:
        r["h_qk"], r["h_v"], r["fla_ms"] = int(r["h_qk"]), int(r["h_v"]), float(r["fla_ms"])
        r["lengths"] = [int(x) for x in r["lengths"].split("+")]
    return rows


def _compact_sass(text):
    """The instructions of cuobjdump's SASS, one a line, without encodings or comments."""
    return "\n".join(" ".join(m.group(0).split()) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/[^;/]*;", text))


def collect(rows, log=print):
    """Records FLA at every row and at the reference, compiles the reference's launches (every
    autotune config) and returns the data Check needs: {"kernels": {id: facts}, "rows": [row with its
    launches: kernel id, autotune group, programs, warps, sequence lengths, tensor bytes, tile bytes,
    FLOPs]}. A launch's tile bytes and FLOPs per program are read from the reference's TTIR at 1 and 2
    chunks per sequence and taken linear in the row's mean chunks per sequence (FLA's kernels loop over
    the token count only in their chunk loop)."""
    import torch

    from bench.sm90.launches import Recorder, TorchOp, fake_hopper, record_fla
    from bench.sm90.toolchain import build, compile_all, compile_launch
    rec = Recorder(torch_ops=True)
    with fake_hopper(), rec.active():
        record_fla(rec, (1, 32768) + REFERENCE + (128, 128), torch.bfloat16, ("fwd", "bwd"), lengths=(32768,),
                   h0=True, dht=True)
        ref = list(rec.launches)
        recorded = []
        for r in rows:
            rec.launches = []
            modes = ("fwd",) if r["mode"] == "fwd" else ("fwd", "bwd")
            record_fla(rec, (1, sum(r["lengths"]), r["h_qk"], r["h_v"], 128, 128), torch.bfloat16, modes,
                       lengths=r["lengths"], h0=True, dht=r["mode"] == "bwd")
            recorded.append([lc for lc in rec.launches if lc.phase == r["mode"]])
    log(f"recorded FLA at {len(rows)} published rows")
    ref = [lc for lc in ref if not isinstance(lc, TorchOp)]
    compile_all(ref, log=log)
    kernels = {}
    for lc in ref:
        kid = f"{lc.phase} {lc.kernel} {lc.config_text()}"
        c1, c2 = compile_launch(lc, 1), compile_launch(lc, 2)
        kernels[kid] = dict(
            regs=c1.regs, smem=c1.smem, spill=c1.spill, error=c1.error, dots=[list(d) for d in c1.dots], chunks=1,
            ttir_loops=c1.ttir_loops, sass=_compact_sass(build(lc).get("sass", "")),
            per_program={k: [getattr(c1, k) - (getattr(c2, k) - getattr(c1, k)), getattr(c2, k) - getattr(c1, k)]
                         for k in ("bytes_ld", "bytes_st", "flops")})
    out = []
    for r, lcs in zip(rows, recorded):
        row = {k: r[k] for k in ("mode", "config", "seqlens", "lengths", "h_qk", "h_v", "fla_ms")}
        ops = [lc for lc in lcs if isinstance(lc, TorchOp)]
        row["launches"] = [dict(kernel=f"{lc.phase} {lc.kernel} {lc.config_text()}", group=lc.group,
                                programs=lc.programs, warps=lc.num_warps, seq_lens=list(lc.seq_lens),
                                tensor_bytes=M.footprint(lc.tensors)) for lc in lcs if lc not in ops]
        row["launches"].append(dict(kernel="torch", group=-1, launches=len(ops), bytes=sum(op.bytes for op in ops)))
        out.append(row)
    return dict(kernels=kernels, rows=out)


def save(data, const=None, path=FACTS, state_warps=None):
    """Writes collect()'s data; with `const`, only the SASS of the configs chosen under it is kept (the
    other candidates keep their per-CTA terms at those constants: enough to choose among them again
    there, not to fit), which keeps the file small."""
    if const is not None:
        chk = Check(data)
        keep = {kid for picks in chk.choose(const, state_warps=state_warps).values() for kid in picks.values()}
        out = dict(data, kernels={}, constants=const.as_dict())
        for kid, k in data["kernels"].items():
            if kid in keep:
                out["kernels"][kid] = k
            else:
                lin = M._per_cta_linear(chk.facts(kid, 1.0), const)
                out["kernels"][kid] = dict({n: v for n, v in k.items() if n != "sass"}, sass=None, linear=lin)
        data = out
    with gzip.open(path, "wt") as f:
        json.dump(data, f, separators=(",", ":"))


def load(path=FACTS):
    with gzip.open(path, "rt") as f:
        return json.load(f)


class Check:
    """The model of every published row from collect()'s data."""

    def __init__(self, data):
        self.data = data
        self.kernels = {}
        for kid, k in data["kernels"].items():
            self.kernels[kid] = k | dict(prog=sass.program(k["sass"]) if k["sass"] is not None else None,
                                         dots=[tuple(d) for d in k["dots"]])
        self.constants = data.get("constants")      # the constants of the per-CTA terms kept without SASS
        self.rows = data["rows"]
        for r in self.rows:
            r["train"] = [r["mode"], r["h_qk"], r["h_v"]] in [list(t) for t in TRAIN]
            order = {}
            for la in r["launches"]:     # autotune groups numbered in their order within the row
                la["group"] = order.setdefault(la["group"], len(order))

    def facts(self, kid, chunks):
        """A kernel's facts as model.estimate takes them, its per-program bytes and FLOPs at `chunks`."""
        k = self.kernels[kid]
        per = {n: a + b * chunks for n, (a, b) in k["per_program"].items()}
        return types.SimpleNamespace(regs=k["regs"], smem=k["smem"], error=k["error"], prog=k["prog"],
                                     ttir_loops=k["ttir_loops"], dots=k["dots"], chunks=k["chunks"],
                                     linear_const=self.constants, linear=k.get("linear"), **per)

    def launch_estimate(self, la, const, chunks):
        if la["kernel"] == "torch":
            return M.torch_estimate(la["bytes"], la["launches"], const)
        c = self.facts(la["kernel"], chunks)
        return M.estimate(c, la["programs"], la["warps"], la["seq_lens"], la["tensor_bytes"], const)

    @staticmethod
    def _chunks(r):
        return sum(-(-n // M.CHUNK) for n in r["lengths"]) / len(r["lengths"])

    def choose(self, const, only=None, state_warps=None):
        """{(mode, h_qk, h_v): {group: kernel id}}: per autotuned launch the config the model finds fastest
        at the first row with those heads among those fla_config_allowed (only: the (mode, h_qk, h_v) to
        choose for; default all)."""
        chosen = {}
        for r in self.rows:
            key = (r["mode"], r["h_qk"], r["h_v"])
            if key in chosen or only is not None and key not in only:
                continue
            best = {}
            for la in r["launches"]:
                if la["kernel"] != "torch" and not fla_config_allowed(la["kernel"].split()[1], la["warps"],
                                                                      state_warps):
                    continue
                t = self.launch_estimate(la, const, self._chunks(r))["est_s"]
                if la["group"] not in best or t < best[la["group"]][0]:
                    best[la["group"]] = (t, la["kernel"])
            chosen[key] = {g: kid for g, (_, kid) in best.items()}
        return chosen

    def predict(self, const, chosen, only=None):
        """Per row: (seconds, [(launch, estimate)]) of the chosen configs; None where only(row) is false."""
        out = []
        for r in self.rows:
            if only and not only(r):
                out.append(None)
                continue
            pick = chosen[(r["mode"], r["h_qk"], r["h_v"])]
            parts = [(la, self.launch_estimate(la, const, self._chunks(r))) for la in r["launches"]
                     if pick[la["group"]] == la["kernel"]]
            out.append((sum(e["est_s"] for _, e in parts), parts))
        return out

    def table(self, const, chosen=None):
        """[row | est_ms, err (est / measured - 1), train, kernels: [(kernel id, est us, bound)]]."""
        chosen = chosen or self.choose(const)
        out = []
        for r, (t, parts) in zip(self.rows, self.predict(const, chosen)):
            out.append(dict({k: r[k] for k in ("mode", "config", "seqlens", "h_qk", "h_v", "fla_ms", "train")},
                            est_ms=t * 1e3, err=t * 1e3 / r["fla_ms"] - 1,
                            kernels=[(la["kernel"], e["est_s"] * 1e6, e["bound"]) for la, e in parts]))
        return out

    def loss(self, const, chosen, rows=lambda r: r["train"]):
        """Sum of squared log errors over the rows (the TRAIN rows by default)."""
        pred = self.predict(const, chosen, only=rows)
        return sum(math.log(p[0] * 1e3 / r["fla_ms"]) ** 2 for r, p in zip(self.rows, pred) if p)

    def fit(self, const=None, evaluations=60, log=print):
        """The FIT constants minimising the squared log error over the TRAIN rows (Nelder-Mead on their
        logarithms, within model.BOUNDS, from `const`), with the configs chosen again at every step as
        FLA's autotuner would choose them under those constants, for each warps of FLA's state kernels
        (STATE_KERNELS: 2 or 4); the better of the two. Returns (constants, chosen configs, state warps)."""
        import numpy as np
        from scipy.optimize import minimize
        const = const or M.CONSTANTS
        lo, hi = np.log([M.BOUNDS[n][0] for n in M.FIT]), np.log([M.BOUNDS[n][1] for n in M.FIT])
        train = [r for r in self.rows if r["train"]]
        first = {(r["mode"], r["h_qk"], r["h_v"]) for r in train}

        def at(x):
            return const.with_(**dict(zip(M.FIT, np.exp(np.clip(x, lo, hi)))))

        fits = []
        for warps in (2, 4):
            def loss(x):
                cst = at(x)
                value = self.loss(cst, self.choose(cst, only=first, state_warps=warps))
                log(f"  state kernels w{warps}, {cst.fitted_text()}: training loss {value:.4f}")
                return value
            x0 = np.clip(np.log([const.get(n) for n in M.FIT]), lo, hi)
            res = minimize(loss, x0, method="Nelder-Mead", options=dict(maxfev=evaluations, xatol=0.01, fatol=1e-4))
            fits.append((res.fun, warps, at(res.x)))
            log(f"fit, FLA's state kernels at {warps} warps: {at(res.x).fitted_text()}; training loss {res.fun:.4f}")
        value, warps, const = min(fits, key=lambda f: f[0])
        return const, self.choose(const, state_warps=warps), warps


def write_check(table, path):
    """The check's rows as CSV (bench/results/sm90_validated_check.csv: tests/test_sm90_report.py
    compares the committed facts' table with it)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "config", "seqlens", "h_qk", "h_v", "train", "fla_ms", "est_ms", "err", "kernels"])
        for t in table:
            w.writerow([t["mode"], t["config"], t["seqlens"], t["h_qk"], t["h_v"], int(t["train"]), t["fla_ms"],
                        f"{t['est_ms']:.4f}", f"{t['err']:+.4f}",
                        "; ".join(f"{k} {us:.1f} {b}" for k, us, b in t["kernels"])])


def summary(table):
    """(largest |error| over all rows, over the held-out rows, number of rows within 20%)."""
    errs = [abs(t["err"]) for t in table]
    held = [abs(t["err"]) for t in table if not t["train"]]
    return max(errs), max(held, default=0.0), sum(e <= 0.2 for e in errs)


def format_check(table, const, state_warps=None):
    """The text of the check: the summary line, then one line per published row."""
    worst, held, within = summary(table)
    n_train = sum(t["train"] for t in table)
    heads = ", ".join(f"{m} {h}/{hv}" for m, h, hv in TRAIN)
    out = [f"model check: FLA rows within {worst * 100:.1f}% ({within} of {len(table)} within 20%; the "
           f"{len(table) - n_train} held-out rows within {held * 100:.1f}%); fitted on the {n_train} rows marked * "
           f"({heads} heads): {const.fitted_text()}; FLA's state kernels at "
           f"{STATE_WARPS if state_warps is None else state_warps} warps",
           "FLA's published H200 times (QwenLM/FlashQLA benchmark_results_H200.txt, fla 0.5.1) against the model of "
           "FLA 0.6.0's kernels (bench/sm90/validate.py):",
           f"  {'dir':<4}{'model config':<16}{'seqlens':<13}{'h_qk':>5}{'h_v':>4}{'FLA ms':>8}{'model ms':>9}{'err':>6}"
           "  largest kernels (us, bound)"]
    for t in table:
        top = sorted(t["kernels"], key=lambda k: -k[1])[:3]
        kern = ", ".join(f"{k.split()[1] if k != 'torch' else 'torch ops'} {us:.0f} {b}" for k, us, b in top)
        out.append(f"{'*' if t['train'] else ' '} {t['mode']:<4}{t['config']:<16}{t['seqlens']:<13}{t['h_qk']:>5}"
                   f"{t['h_v']:>4}{t['fla_ms']:>8.3f}{t['est_ms']:>9.3f}{t['err'] * 100:>+5.0f}%  {kern}")
    return "\n".join(out)
