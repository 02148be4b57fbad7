#!/usr/bin/env python3
"""Does every query of duet's Grafana dashboard and every rule return series from a live
Prometheus scraping a duet cluster?

    python3 deploy/tests/live_queries.py --prometheus http://127.0.0.1:9090 [--namespace compose]

Checks, against Prometheus's HTTP API:
- every panel expression of deploy/grafana/duet.json, with `$namespace` set to --namespace and
  Grafana's interval variables set to 5m, returns at least one series;
- every query variable (label_values(metric, label)) finds at least one value;
- every rule of deploy/prometheus/alerts.yml is loaded and evaluated without error
  (health "ok"); every recording rule's output has series; every metric an alert rule reads
  has series in the namespace (an alert's own expression is empty until it fires).

Retries until all pass or --wait seconds have passed (recording rules run every 30 s), then
prints each failure and exits 1 (0 when all pass, printing a summary). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metric_names as mn  # noqa: E402


def query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def rules(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10) as r:
        body = json.load(r)
    return [rule for g in body["data"]["groups"] for rule in g["rules"]]


def check(base: str, ns: str) -> tuple[list[str], list[str]]:
    """(failures, a line per check that passed)."""
    failed, passed = [], []
    for d in mn.DEFAULT_DASHBOARDS:
        for e in mn.dashboard_exprs(d):
            q = mn.grafana_to_promql(e.replace("$namespace", ns))
            try:
                n = len(query(base, q))
            except Exception as err:  # noqa: BLE001 - reported as a failure
                failed.append(f"dashboard query fails: {q}: {err}")
                continue
            (passed if n else failed).append(f"dashboard: {n} series: {q}")
        for v in mn.dashboard_variable_metrics(d):
            n = len(query(base, f'count by (__name__) ({v}{{namespace=~"{ns}"}})'))
            (passed if n else failed).append(f"dashboard variable metric {v}: {n} series")
    live = {r.get("name"): r for r in rules(base)}
    for path in mn.DEFAULT_RULES:
        doc = mn._load_yaml(path) or {}
        for g in doc.get("groups", []) or []:
            for r in g.get("rules", []) or []:
                name = r.get("record") or r.get("alert")
                got = live.get(name)
                if got is None:
                    failed.append(f"rule {name} is not loaded")
                    continue
                if got.get("health") != "ok":
                    failed.append(f"rule {name}: health {got.get('health')!r} {got.get('lastError', '')}")
                    continue
                if r.get("record"):
                    n = len(query(base, f'{{__name__="{name}", namespace=~"{ns}"}}'))
                    (passed if n else failed).append(f"recording rule {name}: {n} series")
                    continue
                for m in sorted(mn.promql_metric_names(str(r["expr"]))):
                    n = len(query(base, f'{{__name__="{m}", namespace=~"{ns}"}}'))
                    (passed if n else failed).append(
                        f"alert {name} ({got.get('state')}) reads {m}: {n} series")
    return failed, passed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prometheus", required=True, help="Prometheus base URL")
    ap.add_argument("--namespace", default="compose", help="value of the namespace label")
    ap.add_argument("--wait", type=float, default=60.0, help="seconds to retry for")
    a = ap.parse_args()
    base = a.prometheus.rstrip("/")
    deadline = time.monotonic() + a.wait
    while True:
        try:
            failed, passed = check(base, a.namespace)
        except Exception as err:  # noqa: BLE001 - Prometheus not answering yet
            failed, passed = [f"prometheus: {err}"], []
        if not failed:
            for line in passed:
                print(line)
            print(f"live_queries: all {len(passed)} checks return series")
            return 0
        if time.monotonic() >= deadline:
            for line in failed:
                print(f"FAIL {line}")
            print(f"live_queries: {len(failed)} of {len(failed) + len(passed)} checks failed")
            return 1
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
