"""benchmarks/gpu_check.py runs end to end on CPU (small sizes): every part, no errors."""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
PARTS = ("kernels", "strategies", "tracker", "rank", "speed")


def test_gpu_check_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for part in PARTS:
        rows = doc[part]
        assert isinstance(rows, list) and rows, (part, rows)  # a dict holds the part's error
        for row in rows:
            assert "error" not in row and row.get("ok", True), (part, row)
        assert f"== {part}" in proc.stdout
    assert {r["strategy"] for r in doc["strategies"]} == {
        "ulysses_attention",
        "upipe_attention",
        "ring_attention",
        "usp_attention",
        "module upipe",
        "module ulysses",
        "module ring",
    }
    assert [r["strategy"] for r in doc["rank"]] == ["ulysses", "upipe"]
    ulysses = doc["rank"][0]  # the closed form is exact for Ulysses (tests/test_memory_model.py)
    assert ulysses["tracker/formula"] == pytest.approx(1, rel=1e-3), ulysses
