"""Collected only when named on the command line; pass counts of the torch suite (``test_torch_suite.py``), checked when the whole suite ran.

Every check item records ``(entry, is_control, twin, check, is_documented_deviation)``. After the session
this plugin prints, per class, how many checks conform and how many are documented deviations, and when every
item of the suite ran (no ``-k``/deselection, nothing skipped for another reason than CUDA) it asserts:

* the control (torch's own classes) conforms on every check it runs;
* for every optbook twin, conforming checks == the control's passes minus its documented deviations;
* for every other optbook class, conforming checks == checks run minus its documented deviations.

A failed assertion turns the session's exit status into a failure. Under pytest-xdist the reports (with
their ``user_properties``) reach the controller, where this runs. ``OPTBOOK_TORCH_SUITE_REPORT=path`` writes
every item's outcome and, for failures, the first line of the error, as JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections import defaultdict

_HERE = pathlib.Path(__file__).resolve().parent


def _requested(config) -> bool:
    """True when the command line names this folder or a file in it (``make torch-suite`` does)."""
    base = pathlib.Path(config.invocation_params.dir)
    for arg in config.invocation_params.args:
        if arg.startswith("-"):
            continue
        path = (base / arg.split("::")[0]).resolve()
        if path == _HERE or _HERE in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    """The suite takes minutes on 2 cores: the plain test run (``make test``) leaves it to ``make torch-suite``."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_") and not _requested(config):
        return True
    return None

_RESULTS: dict[str, dict] = {}
_SUMMARY: list[str] = []


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    if "torch_suite" not in props:
        return
    entry, control, twin, check, deviation = props["torch_suite"]
    rec = _RESULTS.setdefault(report.nodeid, dict(entry=entry, control=control, twin=twin, check=check,
                                                  deviation=deviation, outcome="passed", error=""))
    if report.when == "call" or report.outcome != "passed":
        if report.outcome == "failed" or rec["outcome"] == "passed":
            rec["outcome"] = report.outcome
        if report.outcome == "failed":
            text = getattr(report.longrepr, "reprcrash", None)
            rec["error"] = text.message if text is not None else str(report.longrepr)[-2000:]


def _counts():
    per = defaultdict(lambda: dict(passed=0, deviations=0, failed=0, skipped=0, run=0))
    for rec in _RESULTS.values():
        c = per[rec["entry"]]
        c["run"] += 1
        if rec["outcome"] == "skipped":
            c["skipped"] += 1
        elif rec["outcome"] == "failed":
            c["failed"] += 1
        elif rec["deviation"]:
            c["deviations"] += 1
        else:
            c["passed"] += 1
    return per


def pytest_sessionfinish(session, exitstatus):
    if not _RESULTS:
        return
    path = os.environ.get("OPTBOOK_TORCH_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(sorted(_RESULTS.values(), key=lambda r: (r["entry"], r["check"])), f, indent=1)
    per = _counts()
    entries = {r["entry"]: (r["control"], r["twin"]) for r in _RESULTS.values()}
    controls = [e for e, (c, _) in entries.items() if c]
    ours = [e for e, (c, _) in entries.items() if not c]
    tot = lambda es, k: sum(per[e][k] for e in es)  # noqa: E731
    _SUMMARY.append(f"torch suite: control (torch.optim) passed {tot(controls, 'passed')} of {tot(controls, 'run')} "
                    f"({tot(controls, 'skipped')} skipped); optbook passed {tot(ours, 'passed')} of "
                    f"{tot(ours, 'run')}, documented deviations {tot(ours, 'deviations')}, failed "
                    f"{tot(ours, 'failed')} ({tot(ours, 'skipped')} skipped)")
    for e in controls + ours:
        c = per[e]
        _SUMMARY.append(f"  {e:<22} passed {c['passed']:>3}  deviations {c['deviations']:>3}  failed {c['failed']:>3}"
                        f"  skipped {c['skipped']:>3}  of {c['run']}")
    import test_torch_suite  # the controller under xdist collected nothing: count the items from the module
    complete = len(_RESULTS) == len(test_torch_suite.ITEMS)
    if not complete:
        _SUMMARY.append("  (not every item of the suite ran here: the pass-count equality is not checked)")
        return
    problems = []
    for e in controls:
        if per[e]["passed"] != per[e]["run"] - per[e]["skipped"]:
            problems.append(f"control {e} does not pass every check it runs")
    for e in ours:
        twin = entries[e][1]
        base = (per[twin]["passed"] if twin else per[e]["run"] - per[e]["skipped"])
        if per[e]["passed"] != base - per[e]["deviations"]:
            problems.append(f"{e}: passed {per[e]['passed']} != {'control' if twin else 'checks run'} {base} "
                            f"- documented deviations {per[e]['deviations']}")
    if problems:
        _SUMMARY.extend("  PASS-COUNT CHECK FAILED: " + p for p in problems)
        session.exitstatus = 1
    else:
        _SUMMARY.append("  pass-count check: every twin passes the control's count minus its documented "
                        "deviations; every other class passes its checks minus its documented deviations")


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)
