"""``tools/time_tests.py`` (``make test`` timed on fresh clones) and the README line made from its record."""

from __future__ import annotations

import json

from helpers import load_tool

time_tests = load_tool("time_tests")


def test_the_summary_line_is_pytests_last_one():
    log = ("... 3 passed in 1.0s ...\n"
           "========= 3158 passed, 2 skipped, 1 xfailed in 612.40s (0:10:12) =========\n")
    assert time_tests.SUMMARY_RE.findall(log)[-1] == "3158 passed, 2 skipped, 1 xfailed"
    failed = "==== 2 failed, 3156 passed, 25 errors in 3600.00s (1:00:00) ====\n"
    assert time_tests.SUMMARY_RE.findall(failed) == ["2 failed, 3156 passed, 25 errors"]


def test_copies_below_one_are_refused(capsys):
    try:
        time_tests.main(["--copies", "0"])
    except SystemExit as exit:
        assert exit.code == 2
    else:  # pragma: no cover - the check failed
        raise AssertionError("--copies 0 was accepted")
    assert "--copies must be at least 1" in capsys.readouterr().err


def test_readme_line_names_the_last_run_alone_and_side_by_side(tmp_path, monkeypatch):
    readme_numbers = load_tool("readme_numbers")
    run = dict(date="2026-12-06", commit="abc1234", cpu="AMD EPYC", cores=2, timeout_scale="default")
    record = [
        {**run, "copies": 1, "load_average_before": 0.5, "load_average_after": 2.0,
         "runs": [{"seconds": 600.0, "exit_status": 0, "summary": "10 passed"}]},
        {**run, "copies": 2, "load_average_before": 0.4, "load_average_after": 4.1,
         "runs": [{"seconds": 1200.0, "exit_status": 0, "summary": "10 passed"},
                  {"seconds": 1260.0, "exit_status": 0, "summary": "10 passed"}]},
    ]
    (tmp_path / "test_times.json").write_text(json.dumps(record))
    monkeypatch.setattr(readme_numbers, "RECORDS", tmp_path)
    line = readme_numbers.test_times_block()
    assert "alone, one copy: 10.0 min (10 passed)" in line
    assert "side by side, 2 copies started together: 20.0 min (10 passed) and 21.0 min (10 passed)" in line
