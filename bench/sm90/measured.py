"""The model beside device times measured on a GPU: the per-kernel CSVs of tools/gpu_check.py's profile
step (columns shape, provider, mode, kernel, calls, us: device time per call of the op, summed over the
kernel's launches) joined with the report's rows, per (shape, impl, direction, kernel). What
`python -m bench kernels --measured CSV` prints (bench/NOTES.md, "The model after the H200")."""
import csv
import math
import re

PROVIDERS = {"ours-triton": "ours", "ours-cuda": "cuda", "fla": "fla"}


def shape_key(dims):
    """The profile's name of a shape: N x L ('1x32768')."""
    return f"{dims[0]}x{dims[1]}"


def kernel_name(name):
    """The report's name of a profiled kernel: a Triton kernel's name as it is; a C++ kernel's demangled
    signature ('void gdn::sm90::(anonymous namespace)::chunk_gdr_fwd_sm90_kernel<__nv_bfloat16>(...)')
    cut to its function's name."""
    m = re.search(r"([A-Za-z_]\w*)(?:<[^()]*>)?\(", name)
    return m.group(1) if m else name


def read(paths):
    """{(shape, impl, mode, kernel): us} of the profile CSVs (the providers bench/sm90 models only; the
    instantiations of one C++ kernel summed)."""
    out = {}
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                impl = PROVIDERS.get(r["provider"])
                if impl:
                    key = (r["shape"], impl, r["mode"], kernel_name(r["kernel"]))
                    out[key] = out.get(key, 0.0) + float(r["us"])
    return out


def join(rows, shapes, measured):
    """One dict per kernel both the report and the measurement have: shape, impl, mode, kernel, the
    measured and modelled us (the model summed over the kernel's launches), the bounds, measured / model."""
    names = {name: shape_key(dims) for name, dims in shapes}
    model = {}
    for r in rows:
        if r["shape"] not in names or r["est_us"] in ("", None) or r["kernel"].startswith("torch ops"):
            continue
        key = (names[r["shape"]], r["impl"], r["mode"], r["kernel"])
        m = model.setdefault(key, dict(us=0.0, bounds=[]))
        m["us"] += r["est_us"]
        m["bounds"].append(r["bound"])
    out = []
    for key, m in model.items():
        if key in measured and m["us"] > 0:
            us = measured[key]
            out.append(dict(shape=key[0], impl=key[1], mode=key[2], kernel=key[3], measured_us=us,
                            model_us=round(m["us"], 1), bound="+".join(dict.fromkeys(m["bounds"])),
                            ratio=round(us / m["us"], 2)))
    return sorted(out, key=lambda j: (j["shape"], j["impl"], j["mode"], -j["measured_us"]))


def format_join(joined):
    """The text: per kernel, measured / model; per (shape, impl, direction), the sums; the spread."""
    if not joined:
        return "measured vs model: no kernel of the measurement is in the report (shapes, providers, modes)"
    out = ["measured vs model (device time per call; model = this report's est us summed over the kernel's "
           "launches):", f"  {'shape':<9}{'impl':<5}{'dir':<4}{'kernel':<46}{'measured us':>12}{'model us':>10}"
           f"  {'bound':<16}{'measured/model':>14}"]
    for j in joined:
        out.append(f"  {j['shape']:<9}{j['impl']:<5}{j['mode']:<4}{j['kernel'][:45]:<46}{j['measured_us']:>12.1f}"
                   f"{j['model_us']:>10.1f}  {j['bound']:<16}{j['ratio']:>14.2f}")
    sums = {}
    for j in joined:
        s = sums.setdefault((j["shape"], j["impl"], j["mode"]), [0.0, 0.0])
        s[0] += j["measured_us"]
        s[1] += j["model_us"]
    for (shape, impl, mode), (meas, mod) in sums.items():
        out.append(f"  {shape:<9}{impl:<5}{mode:<4}{'(the kernels above)':<46}{meas:>12.1f}{mod:>10.1f}  {'':<16}"
                   f"{meas / mod:>14.2f}")
    logs = [math.log(j["ratio"]) for j in joined if j["ratio"] > 0]
    worst = max(joined, key=lambda j: abs(math.log(j["ratio"])) if j["ratio"] > 0 else math.inf)
    out.append(f"measured vs model: {len(joined)} kernel rows, measured/model from {min(j['ratio'] for j in joined):.2f} "
               f"to {max(j['ratio'] for j in joined):.2f} (geometric mean {math.exp(sum(logs) / len(logs)):.2f}; "
               f"worst {worst['impl']} {worst['kernel']} at {worst['shape']})")
    return "\n".join(out)


def write(joined, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["shape", "impl", "mode", "kernel", "measured_us", "model_us", "bound",
                                          "ratio"])
        w.writeheader()
        w.writerows(joined)
