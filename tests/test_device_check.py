"""benchmarks/device_check.py --dry-run: every step of the device check on this CPU at tiny
shapes (nothing installed), so the script a user runs first on new hardware is proven end
to end here; the JSON and markdown it writes have the documented fields."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_writes_the_documented_report(tmp_path):
    dc = _module()
    assert dc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "device_check.json").read_text())
    assert rep["schema"] == 2 and rep["mode"] == "dry-run" and rep["platform"] == "cpu" and rep["ok"]
    assert rep["install"]["skipped"] == "dry run" and not rep["skipped"] and not rep["timed_out"] and not rep["errors"]
    assert list(rep["stage_s"]) == [name for name, _, _ in dc.stages("dry-run", "cpu")]
    checks = {p["check"]: p for p in rep["parity"]}
    attention = checks["attention cpu vs xla"]
    assert attention["forward_rel_err"] <= dc_tol(dc)[0] and attention["grad_rel_err"] <= dc_tol(dc)[1]
    exact = checks["sampler tokens float32 (xla) device vs CPU"]
    assert exact["exact_required"] and exact["rows_equal"] == exact["rows"] == 8  # 4 prompts x n=2
    trains = rep["train_step"]
    assert [(t["model"], t["attention"]) for t in trains] == [("tiny", "cpu"), ("tiny", "xla")]
    for t in trains:
        assert t["tokens_per_s"] == round(t["rows"] * t["seq_len"] / t["step_s"], 1) or abs(
            t["tokens_per_s"] - t["rows"] * t["seq_len"] / t["step_s"]) < 0.1 * t["tokens_per_s"]
        assert t["mfu"] is None and t["plan_bytes"] > 0   # no published peak for a CPU
    assert [d["sampler"] for d in rep["decode"]] == ["static", "engine"]
    for dec in rep["decode"]:  # no end token: every row runs every step
        assert dec["decode_steps"] == 8 and dec["rows"] == 4 and dec["generated_tokens"] == 32, dec
        assert abs(dec["tokens_per_s"] - 32 / dec["decode_s"]) < 0.02 * dec["tokens_per_s"], dec  # decode_s rounded
    md = (tmp_path / "device_check.md").read_text()
    assert "| attention cpu vs xla | ok |" in md and "| tiny | xla | 1 | 1 x 64 |" in md and "ALL OK" in md
    assert "| tiny | static | 4 | 32 + 8 |" in md and "| tiny | engine | 4 | 32 + 8 |" in md


def dc_tol(dc):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import device_check_work as w

    return w.FWD_TOL, w.GRAD_TOL


def test_a_measurement_over_its_time_limit_is_killed_and_reported(tmp_path, capsys):
    """The per-measurement limit holds even when the measurement never returns: its process is
    killed at the limit and the report says "timed out" (0.5 s: less than the tiny engine's
    first compile). An unknown --only name is refused with the list of names."""
    dc = _module()
    t0 = __import__("time").time()
    assert dc.main(["--dry-run", "--out", str(tmp_path), "--only", "engine decode", "--stage-timeout-s", "0.5"]) == 1
    assert __import__("time").time() - t0 < dc.STARTUP_LIMIT_S
    rep = json.loads((tmp_path / "device_check.json").read_text())
    assert rep["timed_out"] == ["engine decode"] and not rep["ok"] and not rep["skipped"]
    (dec,) = rep["decode"]
    assert dec["timed_out"] and dec["error"].startswith("timed out after") and dec["error"].endswith("(limit 0.5 s)"), dec
    md = (tmp_path / "device_check.md").read_text()
    assert "| engine decode | FAILED: timed out after" in md and "SOME CHECK FAILED" in md
    assert dc.main(["--dry-run", "--out", str(tmp_path), "--only", "decode,warp drive"]) == 2
    assert "--only warp drive: no such measurement" in capsys.readouterr().err


def test_without_an_accelerator_the_device_mode_says_to_dry_run(tmp_path, capsys):
    dc = _module()
    if dc.detect_platform() != "cpu":
        pytest.skip("this host has an accelerator: the device mode would run")
    assert dc.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run runs the same steps on the CPU" in capsys.readouterr().err
