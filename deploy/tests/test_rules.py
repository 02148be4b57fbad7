"""The Prometheus rules and the Grafana dashboard, checked with promtool."""

from __future__ import annotations

import json
import subprocess

import yaml

from conftest import CHART, REPO
from metric_names import dashboard_exprs, grafana_to_promql

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
CHART_ALERTS = CHART / "files" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "duet.json"


def _promtool(promtool, *args, cwd=None):
    p = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    return p.returncode, p.stdout + p.stderr


def test_alerts_single_source():
    """deploy/prometheus/alerts.yml is the chart's files/alerts.yml (a symlink inside the
    repo; the chart cannot read outside itself, so the chart's copy is the real file)."""
    assert ALERTS.read_bytes() == CHART_ALERTS.read_bytes()
    if ALERTS.is_symlink():
        assert ALERTS.resolve() == CHART_ALERTS.resolve()


def test_promtool_check_rules(promtool):
    rc, out = _promtool(promtool, "check", "rules", str(ALERTS))
    assert rc == 0, out
    assert "SUCCESS" in out


def test_promtool_rule_unit_tests(promtool):
    """deploy/tests/alerts_test.yml: each alert fires (and stays quiet) on synthetic series."""
    rc, out = _promtool(promtool, "test", "rules", "alerts_test.yml", cwd=REPO / "deploy" / "tests")
    assert rc == 0, out


def test_alerts_cover_the_brief():
    doc = yaml.safe_load(ALERTS.read_text())
    alerts = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    assert {"DuetTimeToFirstTokenHigh", "DuetKVCacheNearlyFull", "DuetNoDecodeWorkers", "DuetRegistryStale"} <= set(alerts)
    assert "absent(" in alerts["DuetNoDecodeWorkers"]["expr"]
    assert alerts["DuetTimeToFirstTokenHigh"]["for"] == "5m" and "> 2" in alerts["DuetTimeToFirstTokenHigh"]["expr"]
    assert alerts["DuetKVCacheNearlyFull"]["for"] == "5m" and "> 0.95" in alerts["DuetKVCacheNearlyFull"]["expr"]
    for a in alerts.values():
        assert a["labels"]["severity"] in ("warning", "critical")
        assert a["annotations"]["summary"] and a["annotations"]["description"]


def test_dashboard_promql_is_valid(promtool, tmp_path):
    """Every PromQL expression of the dashboard, Grafana variables substituted, written as
    recording rules and checked by `promtool check rules`."""
    exprs = dashboard_exprs(DASHBOARD)
    assert len(exprs) >= 30
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(e)} for i, e in enumerate(exprs)]}]}
    f = tmp_path / "dashboard-rules.yml"
    f.write_text(yaml.safe_dump(rules, sort_keys=False))
    rc, out = _promtool(promtool, "check", "rules", str(f))
    assert rc == 0, out
    assert f"SUCCESS: {len(exprs)} rules found" in out, out


def test_dashboard_shape():
    d = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    titles = {p["title"] for p in panels}
    for want in ("Prefill busy ratio", "Decode memory bandwidth", "Time to first token", "Time per output token",
                 "Inter-token latency", "KV cache use", "KV transfer bandwidth", "Queue depth",
                 "Routing decisions by placement", "Requests by outcome", "Workers by role", "Registry stale"):
        assert want in titles, want
    exprs = " ".join(dashboard_exprs(DASHBOARD))
    for q in ("0.5", "0.9", "0.99"):
        for h in ("duet_router_time_to_first_token_seconds_bucket", "duet_router_time_per_output_token_seconds_bucket",
                  "duet_router_inter_token_latency_seconds_bucket"):
            assert f"histogram_quantile({q}, sum by (le) (rate({h}" in exprs, (q, h)
    assert "rate(duet_kv_transfer_bytes_total" in exprs
    # panels do not overlap on the 24-column grid
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps at {(x, y)}"
                cells.add((x, y))

