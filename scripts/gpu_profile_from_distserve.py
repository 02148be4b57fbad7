#!/usr/bin/env python3
"""Writes a hand profile of OPT-13B on one A100-80GB (tensor parallelism 1) for `duet plan`,
from the latency model DistServe published with its simulator (never measured here: duet has
not run on a GPU).

Source: github.com/LLMServe/DistServe, simdistserve/estimators/profile_data/
profiler-a100-80g.distserve.json (commit 7057aefe62f61c69600b1354e044e3dbc7cc1b1c), entry
"facebook/opt-13b" / "1", used by simdistserve/estimators/time_estimator.py as
  prefill_ms = a + b * sum(tokens) + c * sum(tokens^2)
  decode_ms  = a + b * sum(context tokens) + c * batch   (small-batch fit below 95 sequences,
                                                          large-batch fit from 95)
KV size from OPT-13B's shape (40 layers, hidden 5120, fp16 K and V): 819,200 bytes per token.
KV pool: 80 GB minus 26 GB of fp16 weights and 4 GB of activations/workspace (an assumption),
in 16-token blocks. Links from NVIDIA's datasheets (A100 NVLink 600 GB/s, i.e. 300 GB/s each
way; HDR InfiniBand 200 Gb/s = 25 GB/s) with an assumed 10 us latency: specifications, not
measurements.

  python3 scripts/gpu_profile_from_distserve.py > plan/profiles/a100-opt13b-distserve.json
"""
import json

PREFILL = (16.456860431694288, 0.09264750660897617, 6.474785740229194e-06)
DECODE_SMALL = (19.934702624895458, 0.0006269356524350583, 0.03850697740828398)
DECODE_LARGE = (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046)
THRESHOLD = 95
KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2
BLOCK = 16
POOL_BYTES = (80 - 26 - 4) * 10**9


def prefill_s(tokens, cached):
    a, b, c = PREFILL
    # Attention over a cached prefix: the quadratic term of the whole sequence minus the
    # prefix's own (its KV exists).
    quad = (tokens + cached) ** 2 - cached ** 2
    return (a + b * tokens + c * quad) / 1e3


def decode_s(batch, context):
    a, b, c = DECODE_SMALL if batch < THRESHOLD else DECODE_LARGE
    return (a + b * batch * context + c * batch) / 1e3


tokens = [16, 64, 128, 256, 512, 1024, 2048, 4096]
cached = [0, 1024, 4096]
batch = [1, 2, 4, 8, 16, 32, 64, 94, 95, 128, 256, 512]
context = [128, 512, 1024, 2048, 4096]
profile = {
    "schema": "duet-profile/1",
    "source": {
        "kind": "hand",
        "model": "facebook/opt-13b (fp16)",
        "engine": "DistServe on 1x A100-80GB, tensor parallelism 1",
        "machine": "NVIDIA A100-SXM4-80GB",
        "created_unix_s": 0.0,
        "notes": [
            "prefill and decode_step: DistServe's published latency model, "
            "github.com/LLMServe/DistServe simdistserve/estimators/profile_data/"
            "profiler-a100-80g.distserve.json (commit 7057aefe), opt-13b, TP 1",
            "kv_bytes_per_token: 40 layers x 5120 hidden x K,V x 2 bytes",
            "kv_pool_blocks: (80 - 26 weights - 4 workspace) GB / (16 x 819200 B): an assumption",
            "links: datasheet figures (NVLink 3 300 GB/s per direction, HDR InfiniBand 25 GB/s), "
            "10 us latency assumed; router_overhead_s: 2 ms assumed",
            "written by scripts/gpu_profile_from_distserve.py; duet has never run on a GPU",
        ],
    },
    "threads": 1,
    "n_layers": 40,
    "block_size": BLOCK,
    "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
    "kv_pool_blocks": POOL_BYTES // (BLOCK * KV_BYTES_PER_TOKEN),
    "prefill": {
        "tokens": [float(t) for t in tokens],
        "cached": [float(c) for c in cached],
        "seconds": [[prefill_s(t, c) for t in tokens] for c in cached],
    },
    "decode_step": {
        "batch": [float(b) for b in batch],
        "context": [float(c) for c in context],
        "seconds": [[decode_s(b, c) for b in batch] for c in context],
    },
    "links": [
        {"backend": "nvlink", "bytes_per_s": 300e9, "latency_s": 10e-6},
        {"backend": "ib-hdr", "bytes_per_s": 25e9, "latency_s": 10e-6},
    ],
    "router_overhead_s": 0.002,
}
print(json.dumps(profile, indent=1))
