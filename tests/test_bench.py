"""The benchmark CLI (bench/): an end-to-end run on tiny scenarios with every CPU provider, the
result files' schema, the correctness gate rejecting a wrong provider, and the plot command."""
import csv
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import gdr, output  # noqa: E402
from bench.cli import main  # noqa: E402

CPU_PROVIDERS = ("ours-torch", "hf-torch", "naive")
FAST = ["--repeats", "3", "--warmup", "1", "--budget-s", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    cmd = [sys.executable, "-m", "bench", "--suite", "tiny", "--out", str(out), *FAST]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
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


def test_gate_rejects_a_wrong_provider_and_does_not_time_it(tmp_path, capsys):
    right = gdr.PROVIDERS["ours-torch"].extra["call"]

    def off_by_a_bit(q, k, v, g, beta, cu):      # a plausible bug: the decay applied one token late
        return right(q, k, v, torch.roll(g, 1, dims=1), beta, cu)
    gdr.PROVIDERS["wrong"] = gdr.make_provider("wrong", off_by_a_bit)
    try:
        rc = main(["--scenarios", "TINY_N3_T201_H2x4_K32_V32", "--providers", "wrong,ours-torch",
                   "--modes", "fwd", "--out", str(tmp_path), "--no-memory", *FAST])
    finally:
        del gdr.PROVIDERS["wrong"]
    assert rc == 0
    rows = output.load(glob.glob(str(tmp_path / "*.json"))[0])
    wrong = [r for r in rows if r["provider"] == "wrong"]
    assert any(r["metric"] == "gate_rel_err" and r["status"] == "failed" and r["p50"] > 1e-3 for r in wrong)
    assert any(r["metric"] == "status" and r["status"] == "failed" and "gate" in r["note"] for r in wrong)
    assert not any(r["metric"] == "time" for r in wrong)
    assert any(r["provider"] == "ours-torch" and r["metric"] == "time" for r in rows)
    assert "FAILED" in capsys.readouterr().out


def test_plot_writes_a_png(tiny_run, tmp_path):
    _, csv_path, json_path = tiny_run
    for src in (csv_path, json_path):
        png = tmp_path / (os.path.basename(src) + ".png")
        proc = subprocess.run([sys.executable, "-m", "bench", "plot", src, "-o", str(png)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
