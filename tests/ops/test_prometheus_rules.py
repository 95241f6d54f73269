"""The Prometheus rules in deploy/prometheus: valid (`promtool check rules`), every alert unit-tested
with a case that fires and one that does not (`promtool test rules`), every alert with its runbook."""

from __future__ import annotations

import subprocess

import yaml

from tests.ops.tools import RULES, RULES_TEST, require_tool


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_check_rules():
    out = subprocess.run([require_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_test_rules():
    out = subprocess.run([require_tool("promtool"), "test", "rules", RULES_TEST.name], capture_output=True,
                         text=True, cwd=RULES_TEST.parent)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_runbook_and_tests_that_fire_and_do_not():
    alerts = {r["alert"]: r for r in _rules() if "alert" in r}
    assert len(alerts) >= 7
    for name, rule in alerts.items():
        ann = rule.get("annotations", {})
        assert ann.get("summary") and ann.get("runbook") and len(ann["runbook"]) > 80, name
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired: dict[str, set] = {}
    series: dict[str, int] = {}
    for t in tests:
        for case in t.get("alert_rule_test", []):
            fired.setdefault(case["alertname"], set()).update(
                tuple(sorted(e["exp_labels"].items())) for e in case["exp_alerts"])
            # a case that does not fire: an input series the expected alerts leave out, or an empty case
            series[case["alertname"]] = max(series.get(case["alertname"], 0), len(t["input_series"]))
    for name in alerts:
        assert fired.get(name), f"{name}: no test case where it fires"
        assert series[name] > len(fired[name]) or any(
            not c["exp_alerts"] for t in tests for c in t.get("alert_rule_test", []) if c["alertname"] == name), \
            f"{name}: no test case where it does not fire"
