"""deploy/tests/metric_names.py against a synthetic exposition built from
telemetry/src/names.rs, and every name the dashboard and rules use against that catalogue."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import HERE, REPO, names_rs
from metric_names import (exposition_names, missing_names, promql_metric_names, referenced_names)

SCRIPT = HERE / "metric_names.py"


def catalogue() -> dict[str, str]:
    """name -> kind (counter, gauge, histogram) parsed from names.rs: the catalogue! macro
    entries (`Kind CONST = "name", "help";`), or, for plain `pub const X: &str = "name";`
    declarations, histograms taken from telemetry/src/exporter.rs's HISTOGRAM_BUCKETS."""
    text = names_rs().read_text()
    kinds = {name: kind.lower() for kind, name in
             re.findall(r'\b(Counter|Gauge|Histogram)\s+[A-Z0-9_]+\s*=\s*"(duet_[a-z0-9_]+)"', text)}
    if kinds:
        return kinds
    consts = dict(re.findall(r'pub const ([A-Z0-9_]+): &str = "(duet_[a-z0-9_]+)"', text))
    exporter = (REPO / "telemetry" / "src" / "exporter.rs").read_text()
    hist = set(re.findall(r"\(\s*([A-Z0-9_]+)\s*,\s*[A-Z_]+\s*\)", exporter))
    return {n: ("histogram" if c in hist else "counter" if n.endswith("_total") else "gauge")
            for c, n in consts.items()}


def exposition(cat: dict[str, str], drop: set[str] = frozenset()) -> str:
    """A text exposition with one series per catalogue entry, as metrics-exporter-prometheus
    writes it (histograms as _bucket/_sum/_count)."""
    lines = []
    for name, kind in sorted(cat.items()):
        if name in drop:
            continue
        lines.append(f"# HELP {name} synthetic")
        if kind == "histogram":
            lines.append(f"# TYPE {name} histogram")
            lines += [f'{name}_bucket{{worker="w",le="0.1"}} 1', f'{name}_bucket{{worker="w",le="+Inf"}} 2',
                      f'{name}_sum{{worker="w"}} 0.3', f'{name}_count{{worker="w"}} 2']
        else:
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f'{name}{{worker="w"}} 1')
    return "\n".join(lines) + "\n"


def _base(name: str, cat: dict[str, str]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and cat.get(name[: -len(suffix)]) == "histogram":
            return name[: -len(suffix)]
    return name


def test_catalogue_parses():
    cat = catalogue()
    assert len(cat) >= 40
    assert cat["duet_router_time_to_first_token_seconds"] == "histogram"
    assert cat["duet_prefill_queue_depth"] == "gauge"
    assert cat["duet_router_requests_total"] == "counter"


def test_every_referenced_name_is_in_names_rs():
    """The dashboard and the rules use only names from telemetry/src/names.rs; histograms only
    through _bucket/_sum/_count, other kinds only by their own name."""
    cat = catalogue()
    refs = referenced_names()
    assert len(refs) >= 25
    for n in sorted(refs):
        base = _base(n, cat)
        assert base in cat, f"{n} is not in telemetry/src/names.rs"
        if cat[base] == "histogram":
            assert n != base, f"{n}: a histogram is read through _bucket/_sum/_count"
        else:
            assert n == base, n


def test_nothing_missing_from_a_full_exposition():
    cat = catalogue()
    present = exposition_names(exposition(cat))
    assert missing_names(referenced_names(), present) == []


@pytest.mark.parametrize("drop", ["duet_decode_kv_blocks_used", "duet_router_time_to_first_token_seconds",
                                  "duet_router_workers"])
def test_a_missing_name_is_reported(drop):
    cat = catalogue()
    present = exposition_names(exposition(cat, {drop}))
    missing = missing_names(referenced_names(), present)
    if cat[drop] == "histogram":
        assert missing == [f"{drop}_bucket"]
    else:
        assert missing == [drop]


def test_cli(tmp_path):
    cat = catalogue()
    full = tmp_path / "full.txt"
    full.write_text(exposition(cat))
    p = subprocess.run([sys.executable, str(SCRIPT), "--exposition", str(full)], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr

    part = tmp_path / "part.txt"
    part.write_text(exposition(cat, {"duet_prefill_busy_ratio", "duet_kv_transfer_bytes_total"}))
    p = subprocess.run([sys.executable, str(SCRIPT), "--exposition", str(part)], capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stdout.split() == ["duet_kv_transfer_bytes_total", "duet_prefill_busy_ratio"]

    # the union of several scrapes counts; --ignore skips names
    rest = tmp_path / "rest.txt"
    rest.write_text("duet_prefill_busy_ratio{worker=\"p\"} 0.5\n")
    p = subprocess.run([sys.executable, str(SCRIPT), "--exposition", str(part), "--exposition", str(rest),
                        "--ignore", "duet_kv_transfer_.*"], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout

    p = subprocess.run([sys.executable, str(SCRIPT), "--exposition", str(tmp_path / "nope.txt")],
                       capture_output=True, text=True)
    assert p.returncode == 2


def test_cli_runs_without_pyyaml(tmp_path):
    """The Rust end-to-end test may run it with a bare system python3: the fallback rule
    parser must find the same names as PyYAML."""
    code = ("import sys; sys.modules['yaml'] = None; sys.path.insert(0, %r); "
            "import metric_names as m; print('\\n'.join(sorted(m.referenced_names())))" % str(HERE))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == sorted(referenced_names())


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y"}[5m])))', {"a_bucket"}),
    ("sum(rate(a_total[5m])) / ignoring(x) group_left sum(b) > bool 0", {"a_total", "b"}),
    ('absent(up{job="x"}) or vector(0) unless c offset 5m', {"up", "c"}),
    ('{__name__="d", job="j"} and e:rec:rate5m', {"d", "e:rec:rate5m"}),
    ("max without (pod) (f) * 1e3 + Inf - NaN", {"f"}),
    ('g{name="by (x)", other=~"a|b"}', {"g"}),
])
def test_promql_metric_names(expr, names):
    assert promql_metric_names(expr) == names


def test_exposition_names():
    text = """# HELP h x
# TYPE h histogram
h_bucket{le="1"} 0
# TYPE c counter
c_total 3
s{quantile="0.5"} 1
# TYPE om counter
g 1 1700000000000
"""
    assert exposition_names(text) == {"h_bucket", "h_sum", "h_count", "c_total", "s", "om_total", "g"}
