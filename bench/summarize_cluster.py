"""Summarise scripts/bench-cluster.sh output: medians per configuration, as ratios to duet run."""
import json
import statistics
import sys

rows = [json.loads(l) for l in sys.stdin if l.strip()]
out = {}
for label in ("run", "disaggregated", "disaggregated-tcp", "disaggregated-shm", "colocated"):
    rs = [r for r in rows if r["label"] == label]
    if not rs:
        continue
    ttft, tpot, share, prompt = [], [], [], []
    for r in rs:
        n = len(r["ids"])
        if label == "run":
            t = r["timings"]
            first = t["prefill_ms"] / 1e3
            per = t["decode_ms_per_token"] / 1e3
            prompt.append(len(r["prompt_ids"]))
        else:
            t = r["timings"]
            first = t["time_to_first_token_seconds"]
            per = (t["total_seconds"] - first) / max(n - 1, 1)
            share.append(t["kv_transfer_seconds"] / first if first > 0 else 0.0)
            prompt.append(r["usage"]["prompt_tokens"])
        ttft.append(first)
        tpot.append(per)
    out[label] = {
        "runs": len(rs),
        "prompt_tokens": prompt[0],
        "ttft_s_median": statistics.median(ttft),
        "tpot_s_median": statistics.median(tpot),
        "kv_transfer_share_of_ttft_median": statistics.median(share) if share else None,
    }
base = out.get("run")
for label, v in out.items():
    if base:
        v["ttft_vs_run"] = v["ttft_s_median"] / base["ttft_s_median"]
        v["tpot_vs_run"] = v["tpot_s_median"] / base["tpot_s_median"]
path = sys.argv[1]
with open(path, "w") as f:
    json.dump({"configs": out, "raw": rows}, f, indent=1)
print(json.dumps(out, indent=1))
