#!/usr/bin/env python3
"""Which metric names do duet's dashboard and alert rules reference that a scrape lacks?

    python3 deploy/tests/metric_names.py --exposition scrape.txt [--exposition other.txt ...]

prints every metric name referenced by deploy/grafana/duet.json and
deploy/prometheus/alerts.yml that does not appear in the given Prometheus text expositions
(their union: the router, prefill and decode processes each serve their own /metrics), one
per line, and exits 1 if there is any (0 if none, 2 on a usage or input error). Histogram and
summary families count with their `_bucket`/`_sum`/`_count` series (`# TYPE x histogram`
provides x_bucket, x_sum and x_count), OpenMetrics counters with `_total`.

Other options: --dashboard/--rules replace the default sources (repeatable), --ignore REGEX
skips referenced names it fully matches (e.g. counters that only appear after a failure),
--list prints every referenced name and exits.

Standard library only: the Rust end-to-end test runs it with the system python3.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DASHBOARDS = [REPO / "deploy" / "grafana" / "duet.json"]
DEFAULT_RULES = [REPO / "deploy" / "prometheus" / "alerts.yml"]

_IDENT = re.compile(r"(?<![0-9A-Za-z_:.])[A-Za-z_:][A-Za-z0-9_:]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.I)
_NAME_MATCHER = re.compile(r'__name__\s*=\s*"([A-Za-z_:][A-Za-z0-9_:]*)"')
_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan", "start", "end", "atan2",
}
# Grafana's built-in interval variables, replaced by a duration so the expression is PromQL.
_GRAFANA_DURATIONS = re.compile(
    r"\$\{?__(?:rate_interval|interval|range|interval_ms|range_s|range_ms)\}?")
_GRAFANA_VAR = re.compile(r"\$\{[A-Za-z0-9_]+(?::[a-z]+)?\}|\$[A-Za-z_][A-Za-z0-9_]*|\[\[[A-Za-z0-9_]+\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)")


def grafana_to_promql(expr: str) -> str:
    """A Grafana panel expression with its template variables replaced: interval variables
    by `5m`, any other variable by `.*` (they only stand in label values)."""
    expr = _GRAFANA_DURATIONS.sub("5m", expr)
    return _GRAFANA_VAR.sub(".*", expr)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (function, aggregation and label names are
    not metric names)."""
    names: set[str] = set()
    for block in _BRACES.findall(expr):
        names.update(_NAME_MATCHER.findall(block))
    s = _STRING.sub(" ", expr)
    prev = None
    while prev != s:  # label matchers first (they hold strings), then ranges and groupings
        prev = s
        s = _BRACES.sub(" ", s)
    s = _BRACKETS.sub(" ", s)
    s = _GROUPING.sub(" ", s)
    for m in _IDENT.finditer(s):
        word = m.group(0)
        if word.lower() in _KEYWORDS:
            continue
        rest = s[m.end():].lstrip()
        if rest.startswith("("):  # a function or an aggregation
            continue
        names.add(word)
    return names


def _walk_panels(panels: Iterable[dict]) -> Iterable[dict]:
    for p in panels:
        yield p
        yield from _walk_panels(p.get("panels", []) or [])


def dashboard_exprs(path: Path) -> list[str]:
    """Every PromQL expression of a Grafana dashboard's panel targets (as written, with
    Grafana variables)."""
    d = json.loads(Path(path).read_text())
    out = []
    for p in _walk_panels(d.get("panels", [])):
        for t in p.get("targets", []) or []:
            if t.get("expr"):
                out.append(t["expr"])
    return out


def dashboard_variable_metrics(path: Path) -> set[str]:
    """Metric names used by the dashboard's query variables (label_values(metric, label))."""
    d = json.loads(Path(path).read_text())
    names = set()
    for v in d.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if isinstance(q, str):
            m = _LABEL_VALUES.match(q)
            if m:
                names.add(m.group(1))
    return names


def _load_yaml(path: Path):
    try:
        import yaml  # type: ignore
    except ImportError:
        yaml = None
    text = Path(path).read_text()
    if yaml is not None:
        return yaml.safe_load(text)
    return _mini_rules_yaml(text)


def _mini_rules_yaml(text: str) -> dict:
    """Without PyYAML: pull `record:` and `expr:` values (plain or `|` blocks) out of a
    Prometheus rule file. Enough for the files this project writes."""
    rules = []
    lines = text.splitlines()
    i = 0
    cur: dict = {}
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)(?:- )?(record|alert|expr):\s*(.*)$", line)
        if m:
            indent, key, val = len(m.group(1)), m.group(2), m.group(3).strip()
            if key in ("record", "alert") and cur:
                rules.append(cur)
                cur = {}
            if val in ("|", "|-", ">", ">-"):
                block = []
                i += 1
                while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                    block.append(lines[i].strip())
                    i += 1
                cur[key] = " ".join(block)
                continue
            cur[key] = val.strip("'\"")
        i += 1
    if cur:
        rules.append(cur)
    return {"groups": [{"name": "all", "rules": rules}]}


def rule_exprs(path: Path) -> tuple[list[str], set[str]]:
    """(every rule expression, the names the file's recording rules define)."""
    doc = _load_yaml(path) or {}
    exprs, recorded = [], set()
    for g in doc.get("groups", []) or []:
        for r in g.get("rules", []) or []:
            if r.get("expr") is not None:
                exprs.append(str(r["expr"]))
            if r.get("record"):
                recorded.add(r["record"])
    return exprs, recorded


def referenced_names(dashboards: Iterable[Path] = DEFAULT_DASHBOARDS,
                     rules: Iterable[Path] = DEFAULT_RULES) -> set[str]:
    """Every metric name the dashboards and rule files read, less the recording rules'
    own outputs."""
    names: set[str] = set()
    recorded: set[str] = set()
    for d in dashboards:
        for e in dashboard_exprs(d):
            names |= promql_metric_names(grafana_to_promql(e))
        names |= dashboard_variable_metrics(d)
    for r in rules:
        exprs, rec = rule_exprs(r)
        recorded |= rec
        for e in exprs:
            names |= promql_metric_names(e)
    return names - recorded


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{|\s)")
_TYPE = re.compile(r"^#\s*TYPE\s+([A-Za-z_:][A-Za-z0-9_:]*)\s+(\w+)")


def exposition_names(text: str) -> set[str]:
    """Series names present in a Prometheus (or OpenMetrics) text exposition."""
    present: set[str] = set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            m = _TYPE.match(line)
            if m:
                name, kind = m.group(1), m.group(2).lower()
                if kind in ("histogram", "gaugehistogram"):
                    present |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
                elif kind == "summary":
                    present |= {name, f"{name}_sum", f"{name}_count"}
                elif kind == "counter":
                    present |= {name if name.endswith("_total") else f"{name}_total"}
                else:
                    present.add(name)
            continue
        m = _SAMPLE.match(line + " ")
        if m:
            present.add(m.group(1))
    return present


def missing_names(referenced: Iterable[str], present: set[str],
                  ignore: Iterable[str] = ()) -> list[str]:
    pats = [re.compile(p) for p in ignore]
    return sorted(n for n in set(referenced)
                  if n not in present and not any(p.fullmatch(n) for p in pats))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exposition", action="append", default=[], metavar="FILE",
                    help="a Prometheus text exposition ('-': stdin); repeatable, the union counts")
    ap.add_argument("--dashboard", action="append", metavar="JSON",
                    help=f"Grafana dashboard(s) (default: {DEFAULT_DASHBOARDS[0].relative_to(REPO)})")
    ap.add_argument("--rules", action="append", metavar="YAML",
                    help=f"Prometheus rule file(s) (default: {DEFAULT_RULES[0].relative_to(REPO)})")
    ap.add_argument("--ignore", action="append", default=[], metavar="REGEX",
                    help="referenced names to skip (full match); repeatable")
    ap.add_argument("--list", action="store_true", help="print every referenced name and exit")
    a = ap.parse_args(argv)
    try:
        refs = referenced_names([Path(p) for p in a.dashboard] if a.dashboard else DEFAULT_DASHBOARDS,
                                [Path(p) for p in a.rules] if a.rules else DEFAULT_RULES)
        if a.list:
            print("\n".join(sorted(refs)))
            return 0
        if not a.exposition:
            ap.error("--exposition FILE is required (or --list)")
        present: set[str] = set()
        for f in a.exposition:
            text = sys.stdin.read() if f == "-" else Path(f).read_text()
            present |= exposition_names(text)
    except (OSError, ValueError) as e:
        print(f"metric_names: {e}", file=sys.stderr)
        return 2
    missing = missing_names(refs, present, a.ignore)
    for n in missing:
        print(n)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
