"""The benchmark CLI (bench/): an end-to-end run on tiny scenarios with every CPU provider, the
result files' schema, what the console shows (tables that fit the width, one progress line per case
when piped), bad arguments, the correctness gate rejecting a wrong provider, the plot command, and the
provider registry (ours-<backend> exactly for the backends an op has; bench imports only public or
documented names of gdn_packed)."""
import ast
import csv
import glob
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import gdr, output, providers  # noqa: E402
from bench.common import Provider  # noqa: E402
from bench.cli import RESULTS_DIR, main, parser  # noqa: E402
from bench.registry import SUITES  # noqa: E402
from gdn_packed.ops import BACKENDS  # noqa: E402

CPU_PROVIDERS = ("ours-torch", "hf-torch", "naive")
FAST = ["--repeats", "3", "--warmup", "1", "--budget-s", "1", "--threads", "1"]
WIDTH = 80


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny suite in a subprocess whose output is a pipe (not a terminal), 80 columns wide."""
    out = tmp_path_factory.mktemp("results")
    cmd = [sys.executable, "-m", "bench", "--suite", "tiny", "--out", str(out), *FAST]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, COLUMNS=str(WIDTH)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    csvs, jsons = glob.glob(str(out / "*.csv")), glob.glob(str(out / "*.json"))
    assert len(csvs) == 1 and len(jsons) == 1, (csvs, jsons)
    return proc.stdout, csvs[0], jsons[0]


def test_cli_writes_tidy_csv_with_the_schema(tiny_run):
    _, csv_path, _ = tiny_run
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == output.FIELDS
        rows = list(reader)
    for r in rows:
        assert r["status"] in ("ok", "skipped", "failed")
        assert r["torch_version"] == torch.__version__ and r["timestamp"] and r["device"] == "cpu"
    timed = {(r["op"], r["provider"], r["mode"], r["layout"]) for r in rows
             if r["metric"] == "time" and r["status"] == "ok"}
    for p in CPU_PROVIDERS:
        assert ("gdr", p, "fwd", "packed") in timed
        assert ("packing", p, "fwd", "padded") in timed and ("packing", p, "fwd", "packed") in timed
    assert ("gdr", "ours-torch", "fwdbwd", "packed") in timed
    for r in rows:
        if r["metric"] == "time" and r["status"] == "ok":
            assert 0 < float(r["p20"]) <= float(r["p50"]) <= float(r["p80"])
    metrics = {r["metric"] for r in rows}
    assert {"time", "tokens_per_s", "tflops", "gbps", "peak_mem", "speedup", "gate_rel_err",
            "padded_over_packed", "ideal_ratio", "ratio_vs_ideal"} <= metrics
    ideal = [float(r["p50"]) for r in rows if r["metric"] == "ideal_ratio"]
    assert ideal and all(abs(x - 384 / 116) < 1e-9 for x in ideal)
    skipped = {r["provider"]: r["note"] for r in rows if r["status"] == "skipped"}
    assert "needs a GPU" in skipped["ours-triton"] and "fla" in skipped


def test_cli_writes_json_with_meta_and_the_same_rows(tiny_run):
    _, csv_path, json_path = tiny_run
    with open(json_path) as f:
        data = json.load(f)
    assert {"git_sha", "torch_version", "triton_version", "cuda_version", "device_name", "timestamp",
            "suite"} <= set(data["meta"])
    assert all(set(r) == set(output.FIELDS) for r in data["rows"])
    with open(csv_path, newline="") as f:
        assert len(data["rows"]) == len(list(csv.DictReader(f)))


def test_cli_prints_the_tables(tiny_run):
    stdout, _, _ = tiny_run
    assert "padded/packed" in stdout and "ideal" in stdout
    assert "SKIPPED ours-triton: needs a GPU" in stdout
    assert re.search(r"\d+ timed cases; the result files hold \d+ rows", stdout)


def test_tables_fit_the_width_and_never_split_a_name(tiny_run):
    stdout, csv_path, _ = tiny_run
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    lines = [ln for ln in stdout.splitlines() if not ln.startswith("[")]     # progress lines aside
    assert all(len(ln) <= WIDTH for ln in lines), max(lines, key=len)
    words = {w for ln in lines for w in ln.split()}
    timed = {(r["scenario"], r["provider"]) for r in rows if r["metric"] == "time"}
    for scenario, provider in timed:
        assert scenario in words and provider in words, (scenario, provider)


def test_one_progress_line_per_case_when_piped(tiny_run):
    stdout, csv_path, _ = tiny_run
    progress = [re.match(r"\[(\d+)(?:-(\d+))?/(\d+)\] ", ln) for ln in stdout.splitlines()]
    spans = [(int(m[1]), int(m[2] or m[1]), int(m[3])) for m in progress if m]
    total = spans[-1][2]
    assert [a for a, _, _ in spans] == [1] + [b + 1 for _, b, _ in spans[:-1]] and spans[-1][1] == total
    with open(csv_path, newline="") as f:
        timed = [r for r in csv.DictReader(f) if r["metric"] == "time"]
    assert sum(1 for a, b, _ in spans if a == b) >= len(timed) > 0


def test_results_go_to_an_ignored_folder_by_default():
    assert parser().parse_args([]).out == RESULTS_DIR
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    probe = os.path.join(os.path.relpath(RESULTS_DIR, ROOT), "run.csv")
    proc = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    assert proc.returncode == 0, f"{probe} is not ignored by git"


@pytest.mark.parametrize("args, valid", [
    (["--providers", "ours-trition"], "ours-triton"),
    (["--modes", "backward"], "fwdbwd"),
    (["--ops", "gdn"], "gdr"),
    (["--scenarios", "B1_T32768"], "B1_T32768_H16x32_K128_V128"),
    (["--suite", "cpu"], "cpu-extra"),
    (["--dtype", "bf16"], "bfloat16"),
    (["--baseline", "flash"], "fla"),
    (["--device", "gpu"], "cuda"),
], ids=lambda x: x[0] if isinstance(x, list) else "")
def test_bad_names_exit_2_with_one_line_naming_the_valid_ones(args, valid, capsys):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m bench: error:") and valid in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(capsys):
    assert main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device here" in err[0], err


def test_nothing_left_after_the_filters_is_an_error(capsys):
    assert main(["--suite", "default", "--ops", "conv"]) == 2
    assert "nothing to run" in capsys.readouterr().err


def test_help_and_list_name_every_suite_and_no_issue_numbers(capsys):
    help_text = " ".join(parser().format_help().split())
    assert all(f"{name}:" in help_text for name in SUITES)
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name}: " in listing for name in SUITES)
    assert not re.search(r"\bissue \d+", listing)


def _rows_of_a_warning_provider(tmp_path, message):
    """The result rows of a run of ours-torch as a provider that warns `message` on every call."""
    right = providers.PROVIDERS["gdr"]["ours-torch"].call

    def warns(q, k, v, g, beta, cu):
        warnings.warn(message, UserWarning)
        return right(q, k, v, g, beta, cu)
    p = providers.register(Provider("warns", gdr.FAMILY, warns))
    try:
        rc = main(["--scenarios", "TINY_N3_T201_H2x4_K32_V32", "--providers", "warns", "--modes", "fwd",
                   "--out", str(tmp_path), "--no-memory", *FAST])
    finally:
        providers.unregister(p)
    assert rc == 0
    return output.load(glob.glob(str(tmp_path / "*.json"))[0])


def test_a_providers_warning_goes_into_its_row_note(tmp_path, capsys):
    rows = _rows_of_a_warning_provider(tmp_path, "this platform is not supported, rolling back")
    note = next(r["note"] for r in rows if r["provider"] == "warns" and r["metric"] == "time")
    assert "UserWarning: this platform is not supported, rolling back" in note
    assert "rolling back" not in capsys.readouterr().err


def test_fla_platform_warning_is_not_a_note(tmp_path):
    """FLA warns 'Triton is not supported on current platform' at import wherever Triton has no GPU;
    transformers imports FLA, so every hf-torch row carried it (issue 29): it is no row's note."""
    rows = _rows_of_a_warning_provider(tmp_path, "Triton is not supported on current platform, roll back to CPU.")
    assert rows and not any("Triton is not supported" in r["note"] for r in rows)


@pytest.mark.parametrize("repeats", ["1", "2", "0"])
def test_fewer_repeats_than_the_help_says_exit_2(repeats, capsys):
    assert "at least 3" in " ".join(parser().format_help().split())
    assert main(["--scenarios", "TINY_N3_T201_H2x4_K32_V32", "--repeats", repeats, "--no-save"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--repeats must be at least 3" in err[0], err


def test_a_misspelled_subcommand_lists_the_valid_ones(capsys):
    assert main(["plott", "results.csv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'plott'" in err[0], err
    assert all(name in err[0] for name in ("run", "list", "plot", "kernels")), err


def test_fla_refusing_to_run_is_a_skip_with_its_reason(tmp_path):
    """fla-core raises RuntimeError('... produces incorrect results ...') for its gated backward on Hopper
    with Triton 3.4-3.7.0 (an H200 with Triton 3.6.0, 2026-12-04): that row is skipped with FLA's words,
    not failed; a provider's other errors still fail."""
    def refuses(q, k, v, g, beta, cu):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
                           "chunk_bwd_dqkwg (see #640).")

    def breaks(q, k, v, g, beta, cu):
        raise RuntimeError("an ordinary bug")
    ps = [providers.register(Provider(n, gdr.FAMILY, f)) for n, f in (("refuses", refuses), ("breaks", breaks))]
    try:
        rc = main(["--scenarios", "TINY_N3_T201_H2x4_K32_V32", "--providers", "refuses,breaks,ours-torch",
                   "--modes", "fwd", "--out", str(tmp_path), "--no-memory", *FAST])
    finally:
        for p in ps:
            providers.unregister(p)
    assert rc == 0
    rows = output.load(glob.glob(str(tmp_path / "*.json"))[0])
    status = {r["provider"]: r for r in rows if r["metric"] == "status"}
    assert status["refuses"]["status"] == "skipped" and "fla refuses here" in status["refuses"]["note"]
    assert status["breaks"]["status"] == "failed"


def test_gate_rejects_a_wrong_provider_and_does_not_time_it(tmp_path, capsys):
    right = providers.PROVIDERS["gdr"]["ours-torch"].call

    def off_by_a_bit(q, k, v, g, beta, cu):      # a plausible bug: the decay applied one token late
        return right(q, k, v, torch.roll(g, 1, dims=1), beta, cu)
    p = providers.register(Provider("wrong", gdr.FAMILY, off_by_a_bit))
    try:
        rc = main(["--scenarios", "TINY_N3_T201_H2x4_K32_V32", "--providers", "wrong,ours-torch",
                   "--modes", "fwd", "--out", str(tmp_path), "--no-memory", *FAST])
    finally:
        providers.unregister(p)
    assert rc == 0
    rows = output.load(glob.glob(str(tmp_path / "*.json"))[0])
    wrong = [r for r in rows if r["provider"] == "wrong"]
    assert any(r["metric"] == "gate_rel_err" and r["status"] == "failed" and r["p50"] > 1e-3 for r in wrong)
    assert any(r["metric"] == "status" and r["status"] == "failed" and "gate" in r["note"] for r in wrong)
    assert not any(r["metric"] == "time" for r in wrong)
    assert any(r["provider"] == "ours-torch" and r["metric"] == "time" for r in rows)
    assert "FAILED" in capsys.readouterr().out


# the public op behind each op of the bench that has ours-<backend> providers
PUBLIC_OP = {"gdr": "chunk_gated_delta_rule", "packing": "chunk_gated_delta_rule",
             "conv": "causal_conv1d_varlen", "recurrent": "fused_recurrent_gated_delta_rule"}


@pytest.mark.parametrize("op", sorted(PUBLIC_OP))
def test_ours_providers_are_exactly_the_backends_the_op_has(op):
    ours = [n[len("ours-"):] for n in providers.PROVIDERS[op] if n.startswith("ours-")]
    assert ours == list(BACKENDS[PUBLIC_OP[op]])


def test_every_op_with_providers_is_covered():
    assert set(providers.PROVIDERS) == set(PUBLIC_OP) | {"layer", "hybrid"}


def test_register_refuses_a_taken_name_and_unregister_restores_the_table():
    before = {op: dict(ps) for op, ps in providers.PROVIDERS.items()}
    taken = Provider("ours-torch", gdr.FAMILY, gdr.ours("torch"))
    with pytest.raises(ValueError, match="'ours-torch' is already registered"):
        providers.register(taken)
    p = providers.register(Provider("extra", gdr.FAMILY, gdr.ours("torch")))
    assert providers.PROVIDERS["gdr"]["extra"] is p and providers.PROVIDERS["packing"]["extra"] is p
    providers.unregister(p)
    with pytest.raises(KeyError, match="'extra' is not registered"):
        providers.unregister(p)
    assert providers.PROVIDERS == before


# gdn_packed modules bench may import: the public API, its documented modules, and the per-token
# recurrence documented in docs/DESIGN.md section 9 (the `naive` provider); from gdn_packed.ops only BACKENDS
ALLOWED = {"gdn_packed": None, "gdn_packed.packing": None, "gdn_packed.layers": None,
           "gdn_packed.testing": None, "gdn_packed.megatron": None, "gdn_packed.torch_ref.naive": None,
           "gdn_packed.ops": {"BACKENDS"}}


def test_bench_imports_only_public_or_documented_names_of_gdn_packed():
    bad = []
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods, names = [node.module], [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                mods, names = [a.name for a in node.names], []
            else:
                continue
            where = f"{os.path.basename(path)}:{node.lineno}"
            for mod in mods:
                if mod.split(".")[0] != "gdn_packed":
                    continue
                if mod not in ALLOWED:
                    bad.append(f"{where} imports {mod}")
                elif ALLOWED[mod] is not None and not set(names) <= ALLOWED[mod]:
                    bad.append(f"{where} imports {sorted(set(names) - ALLOWED[mod])} from {mod}")
                bad += [f"{where} imports the private name {n} from {mod}" for n in names if n.startswith("_")]
    assert not bad, bad


def test_plot_writes_a_png(tiny_run, tmp_path):
    _, csv_path, json_path = tiny_run
    for src in (csv_path, json_path):
        png = tmp_path / (os.path.basename(src) + ".png")
        proc = subprocess.run([sys.executable, "-m", "bench", "plot", src, "-o", str(png)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
