"""benchmarks/gpu_check.py, the prepared GPU check, in its tiny CPU form: every section runs (or
says why not) and writes its file, so the script a GPU session runs cannot rot here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
SECTIONS = ["smoke", "gpt", "hf_llama", "fp8", "host_syncs", "kv_cache", "watchdog", "fp8_loss",
            "more"]
QUICK = ["smoke", "host_syncs", "kv_cache", "watchdog"]  # no compilation: seconds


def _check(tmp_path, only: list[str]) -> dict[str, dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path),
                           "--only", ",".join(only)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    files = sorted(tmp_path.glob("*.json"))
    assert [f.name.split("_", 1)[1][:-5] for f in files] == only  # numbered in running order
    return {f.name.split("_", 1)[1][:-5]: json.loads(f.read_text()) for f in files}


def test_the_sections_without_compilation_run_on_the_cpu(tmp_path):
    results = _check(tmp_path, QUICK)
    assert results["kv_cache"]["status"] == "ok"
    cached, uncached = results["kv_cache"]["cached"], results["kv_cache"]["uncached"]
    assert cached["tokens"] == uncached["tokens"]  # the cache changes speed, not tokens
    assert {results[s]["status"] for s in ("smoke", "host_syncs", "watchdog")} == {"skipped"}


@pytest.mark.extended
def test_every_section_runs_on_the_cpu(tmp_path):
    results = _check(tmp_path, SECTIONS)
    gpt = results["gpt"]
    assert gpt["status"] == "ok" and gpt["compiled"]["first_step_s"] > 0
    assert abs(gpt["compiled"]["final_loss"] - gpt["eager"]["final_loss"]) < 1e-4
    assert results["hf_llama"]["status"] == "ok" and results["hf_llama"]["mfu"] > 0
    assert results["fp8"]["status"] == "refused"  # no FP8 tensor cores here, said in one line
    assert results["fp8_loss"]["status"] == "refused"
    assert results["more"]["status"] == "ok"
