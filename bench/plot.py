"""python -m bench plot FILE [-o OUT.png]: draw a saved results file (.csv or .json) to PNG.

Left: median time per case (log scale, p20-p80 whiskers), one bar per provider, grouped by
op / scenario / mode / layout. Right (when the file has packing rows): padded/packed time ratio per
provider next to the ideal ratio (padded tokens / real tokens).
"""
import argparse
import os

from bench.common import UsageError


def main(argv):
    ap = argparse.ArgumentParser(prog="python -m bench plot")
    ap.add_argument("file")
    ap.add_argument("-o", "--out", default=None, help="PNG path (default: FILE with .png)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.file):
        raise UsageError(f"plot: no results file {args.file!r}")
    out = args.out or os.path.splitext(args.file)[0] + ".png"
    plot(args.file, out)
    print(f"wrote {out}")
    return 0


def plot(path, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.output import load
    rows = [r for r in load(path) if r["status"] == "ok"]
    times = [r for r in rows if r["metric"] == "time"]
    ratios = [r for r in rows if r["metric"] == "padded_over_packed"]
    ideals = {(r["op"], r["scenario"], r["provider"], r["mode"]): r["p50"]
              for r in rows if r["metric"] == "ideal_ratio"}
    ncols = 2 if ratios else 1
    fig, axes = plt.subplots(1, ncols, figsize=(8 * ncols, 5.5), squeeze=False)
    ax = axes[0][0]
    groups = sorted({(r["op"], r["scenario"], r["mode"], r["layout"]) for r in times})
    provs = sorted({r["provider"] for r in times})
    width = 0.8 / max(1, len(provs))
    for j, prov in enumerate(provs):
        xs, ys, lo, hi = [], [], [], []
        for i, g in enumerate(groups):
            for r in times:
                if (r["op"], r["scenario"], r["mode"], r["layout"]) == g and r["provider"] == prov:
                    xs.append(i + j * width)
                    ys.append(r["p50"] * 1e3)
                    lo.append((r["p50"] - r["p20"]) * 1e3)
                    hi.append((r["p80"] - r["p50"]) * 1e3)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=prov)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels(["\n".join((f"{g[0]} {g[2]} {g[3]}", g[1][:40])) for g in groups], rotation=60,
                       ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("median time (ms), p20-p80")
    ax.legend(fontsize=8)
    ax.set_title(os.path.basename(path), fontsize=9)
    if ratios:
        ax2 = axes[0][1]
        labels = [f"{r['provider']} {r['mode']}\n{r['scenario'][:36]}" for r in ratios]
        xs = range(len(ratios))
        ax2.bar([x - 0.2 for x in xs], [r["p50"] for r in ratios], 0.4, label="padded / packed time")
        ax2.bar([x + 0.2 for x in xs], [ideals.get((r["op"], r["scenario"], r["provider"], r["mode"]), 0)
                                        for r in ratios], 0.4, label="ideal: padded / real tokens")
        ax2.set_xticks(list(xs))
        ax2.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax2.set_ylabel("x")
        ax2.legend(fontsize=8)
        ax2.set_title("what packing buys", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
