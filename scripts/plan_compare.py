#!/usr/bin/env python3
"""Predicted (`duet plan simulate`) against measured (`duet bench serve`) reports.

  plan_compare.py merge OUT.json A.json B.json ...   one report from one-rate reports
  plan_compare.py table DIR LAYOUT...                 the markdown table of validate-plan.sh

Errors are (predicted - measured) / measured. The knee is the first rate whose SLO
attainment is under 90%.
"""
import json
import sys


def merge(out, parts):
    reports = [json.load(open(p)) for p in parts]
    merged = reports[0]
    merged["runs"] = [r for rep in reports for r in rep["runs"]]
    pts = [
        {"rate": r["summary"]["rate"], "attainment": r["summary"]["slo"]["attainment"],
         "request_throughput": r["summary"]["request_throughput"]}
        for r in merged["runs"] if r["summary"].get("slo")
    ]
    if merged.get("sweep") or pts:
        sweep = merged.get("sweep") or {}
        sweep["points"] = pts
        ok = [p["rate"] for p in pts if p["attainment"] is not None and p["attainment"] >= 0.9]
        sweep["goodput_rate"] = max(ok) if ok else None
        merged["sweep"] = sweep if "slo" in sweep else None
    json.dump(merged, open(out, "w"), indent=1)


def by_rate(path):
    rep = json.load(open(path))
    return {r["summary"]["rate"]: r["summary"] for r in rep["runs"]}


def knee(runs):
    for rate in sorted(runs):
        slo = runs[rate].get("slo") or {}
        if (slo.get("attainment") or 0.0) < 0.9:
            return rate
    return None


def err(p, m):
    return (p - m) / m if m else float("nan")


def table(d, layouts):
    print("| layout | rate | TTFT p50 meas / pred (err) | TTFT p90 meas / pred (err) "
          "| TPOT p50 meas / pred (err) | TPOT p90 meas / pred (err) | attainment meas / pred |")
    print("|---|---|---|---|---|---|---|")
    knees = []
    for lay in layouts:
        m = by_rate(f"{d}/{lay}-measured.json")
        s = by_rate(f"{d}/{lay}-simulated.json")
        for rate in sorted(m):
            a, b = m[rate], s.get(rate)
            if b is None:
                continue
            cells = []
            for metric in ("ttft_ms", "tpot_ms"):
                for q in ("p50", "p90"):
                    x, y = (a.get(metric) or {}).get(q), (b.get(metric) or {}).get(q)
                    if x is None or y is None:
                        cells.append("-")
                    else:
                        cells.append(f"{x:.0f} / {y:.0f} ({err(y, x):+.0%})" if metric == "ttft_ms"
                                     else f"{x:.1f} / {y:.1f} ({err(y, x):+.0%})")
            att = lambda r: (r.get("slo") or {}).get("attainment")
            fa = lambda v: "-" if v is None else f"{v:.0%}"
            print(f"| {lay} | {rate} | " + " | ".join(cells) + f" | {fa(att(a))} / {fa(att(b))} |")
        knees.append((lay, knee(m), knee(s)))
    print()
    print("| layout | knee measured | knee predicted |")
    print("|---|---|---|")
    for lay, km, ks in knees:
        print(f"| {lay} | {km or 'none'} | {ks or 'none'} |")


if __name__ == "__main__":
    if sys.argv[1] == "merge":
        merge(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
