"""Shared fixtures of the offline deploy checks: the chart, its renders for several value
sets (rendered once per session with helm-python-sdk, Helm v4's engine, no cluster), and
small helpers to look inside the rendered objects."""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHART = REPO / "deploy" / "helm" / "duet"
sys.path.insert(0, str(HERE))

RELEASE = "duet"
NAMESPACE = "llm"
# kubeVersion the renders and lint assume (the chart needs >= 1.30).
KUBE_VERSION = "v1.32.0"

EXTERNAL_ETCD = ["http://etcd-0.etcd.infra.svc:2379", "https://etcd-1.etcd.infra.svc:2379"]

# A planner profile as `--set-file planner.profile=...` passes it: the file's text (indented
# JSON; quotes, a non-ASCII character and HTML-ish characters must survive the ConfigMap).
PLANNER_PROFILE = json.dumps({
    "schema": "duet-profile/1",
    "source": {"kind": "written by hand", "machine": "test <a & b> \u00e9", "notes": ["\"quoted\""]},
    "threads": 1, "n_layers": 30, "block_size": 16, "kv_bytes_per_token": 23040, "kv_pool_blocks": 1456,
    "prefill": {"tokens": [16.0, 512.0], "cached": [0.0], "seconds": [[0.09, 3.5]]},
    "decode_step": {"batch": [1.0, 32.0], "context": [128.0], "seconds": [[0.022, 0.29]]},
    "links": [{"backend": "tcp", "bytes_per_s": 1.0e9, "latency_s": 5e-05}],
    "router_overhead_s": 0.002,
}, indent=2, ensure_ascii=False) + "\n"
PLANNER = {"enabled": True, "profile": PLANNER_PROFILE, "slo": "ttft=1000,tpot=100"}
TLS_VALUES = {"enabled": True, "cert": "-----BEGIN CERTIFICATE-----", "key": "-----BEGIN PRIVATE KEY-----",
              "ca": "-----BEGIN CERTIFICATE-----", "serverName": "duet-worker.duet.svc"}

# The chart's preset for the second model.
GEMMA3 = yaml.safe_load((CHART / "values-gemma3.yaml").read_text())

# Value sets every structural test runs over.
VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    # the chart's own preset for the second model (four chunk wheels), and with the chat
    # template its GGUF lacks, as `--set-file router.chatTemplate=...` gives it
    "gemma3": GEMMA3,
    "gemma3-chat": {**GEMMA3, "router": {"chatTemplate": (REPO / "tests" / "data" / "gemma3-chat-template.jinja").read_text()}},
    "etcd-3": {"etcd": {"replicas": 3}},
    "etcd-external": {"etcd": {"enabled": False, "external": {"endpoints": EXTERNAL_ETCD}}},
    "etcd-external-tls-auth": {"etcd": {"enabled": False, "external": {
        "endpoints": [e.replace("http://", "https://") for e in EXTERNAL_ETCD],
        "tlsSecret": "etcd-client-tls", "authSecret": "etcd-duet-user"}}},
    "monitoring": {"monitoring": {"prometheusOperator": {"enabled": True, "labels": {"release": "kps"}}}},
    "monitoring-servicemonitor": {
        "monitoring": {"prometheusOperator": {"enabled": True, "monitor": "ServiceMonitor"}}},
    "gpu-off": {"gpu": {"enabled": False}},
    "gpu-on": {"gpu": {"enabled": True}},
    "gpu-own-image": {"image": {"tag": "0.1.0-rc1"}, "gpu": {"enabled": True, "prefill": 0, "image": {
        "repository": "registry.example/duet-gpu", "digest": "sha256:" + "ab" * 32}}},
    "hpa": {"autoscaling": {
        "prefill": {"enabled": True},
        "decode": {"enabled": True, "metric": {
            "type": "External", "name": "namespace:duet_decode_waiting_sequences:sum",
            "selector": {"namespace": NAMESPACE}, "averageValue": "2"}}}},
    "model-pvc-tls-drain": {
        "model": {"source": "pvc", "pvc": {"claimName": "models", "subPath": "smollm2"}},
        "tls": TLS_VALUES,
        "kvSecret": {"existingSecret": "duet-kv-managed", "existingSecretKey": "secret"},
        "config": {"drain": "30s", "kvIntegrity": "off"},
        "router": {"terminationGracePeriodSeconds": 60,
                   "apiKeys": {"existingSecret": "duet-api-keys-managed", "existingSecretKey": "keys"}},
        "probes": {"liveness": {"periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": 5}},
        "networkPolicy": {"routerFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]},
    },
    "model-hostpath-colocated": {
        "model": {"source": "hostPath", "hostPath": {"path": "/data/models"}},
        "router": {"mode": "colocated", "apiKeys": {"keys": ["k3y-one", "k3y-two"]}},
        "prefill": {"replicas": 0},
        "gpu": {"enabled": True, "runtimeClassName": "nvidia", "prefill": 0, "decode": 2},
        "etcd": {"replicas": 5, "persistence": {"enabled": False}},
    },
    # `duet worker` pods (no planner); each role sets values of its own (own values win).
    "role-switching": {
        "roleSwitching": {"enabled": True},
        "prefill": {"kvPool": "3GiB", "threads": 6, "extraEnv": {"DUET_KV_TIMEOUT": "20s"}},
        "decode": {"maxBatch": 32, "prefixCache": "off", "extraEnv": {"DUET_PREFILL_CHUNK_TOKENS": "128"}},
        "tls": TLS_VALUES,
    },
    # + the planner, with the bundled etcd and a PodMonitor.
    "planner": {
        "roleSwitching": {"enabled": True},
        "planner": PLANNER,
        "router": {"extraEnv": {"DUET_LOCAL_PREFILL_MAX_TOKENS": 64}},
        "monitoring": {"prometheusOperator": {"enabled": True}},
    },
    # + the planner with an external etcd (TLS, auth), a ServiceMonitor, and its own settings.
    "planner-external-etcd": {
        "roleSwitching": {"enabled": True},
        "planner": {**PLANNER, "dryRun": True, "kvLink": "tcp", "sloAttainment": 0.95, "window": "30s",
                    "minPrefill": 0, "workersPerHost": 2, "extraEnv": {"DUET_PLANNER_MARGIN": "0.5"}},
        "etcd": {"enabled": False, "external": {
            "endpoints": [e.replace("http://", "https://") for e in EXTERNAL_ETCD],
            "tlsSecret": "etcd-client-tls", "authSecret": "etcd-duet-user"}},
        "monitoring": {"prometheusOperator": {"enabled": True, "monitor": "ServiceMonitor"}},
    },
}

CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
DUET_ROLES = ("router", "prefill", "decode")


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def render_raw(chart, values: dict | None = None) -> dict[str, str]:
    """Render offline. helm-python-sdk's Chart.render() takes no kube version, but the
    native call under it does (kube_version, like `helm template --kube-version`); use it,
    falling back to the public API if a future release changes the private module."""
    try:
        from helm_python import _native
        opts = {"name": RELEASE, "namespace": NAMESPACE, "kube_version": KUBE_VERSION, "is_install": True}
        return json.loads(_native.call_string(
            "helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)))
    except (ImportError, AttributeError):
        return chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def parse_docs(rendered: dict[str, str]) -> list[dict]:
    docs = []
    for path, text in sorted(rendered.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for d in yaml.safe_load_all(text):
            if d:
                docs.append(d)
    return docs


class Rendered:
    """One value set's render, with look-ups."""

    def __init__(self, name: str, values: dict, raw: dict[str, str], defaults: dict):
        self.name = name
        self.values = values
        self.effective = deep_merge(defaults, values)
        self.raw = raw
        self.docs = parse_docs(raw)

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        for d in self.docs:
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
        raise KeyError(f"{kind}/{name} not rendered in {self.name}")

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def component(self, d: dict) -> str:
        return d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]

    def duet_containers(self):
        """(workload, container) for every duet container (router, prefill, decode)."""
        for w in self.of_kind("Deployment"):
            for c in w["spec"]["template"]["spec"]["containers"]:
                if c["name"] in DUET_ROLES:
                    yield w, c

    def planner(self):
        """(workload, container) of the planner, or None when it is off."""
        for w in self.of_kind("Deployment"):
            for c in w["spec"]["template"]["spec"]["containers"]:
                if c["name"] == "planner":
                    return w, c
        return None

    @property
    def switchable(self) -> bool:
        return bool(self.effective["roleSwitching"]["enabled"])

    def env(self, workload: dict, container: dict) -> dict[str, object]:
        """The container's environment as Kubernetes would build it: envFrom ConfigMaps
        first, then env (which wins). valueFrom entries stay as their dict."""
        out: dict[str, object] = {}
        for src in container.get("envFrom", []) or []:
            if "configMapRef" in src:
                cm = self.get("ConfigMap", src["configMapRef"]["name"])
                out.update({k: str(v) for k, v in (cm.get("data") or {}).items()})
            else:
                raise AssertionError(f"unexpected envFrom source {src}")
        for e in container.get("env", []) or []:
            out[e["name"]] = e["value"] if "value" in e else e["valueFrom"]
        return out


@pytest.fixture(scope="session")
def helm():
    import helm_python
    return helm_python


@pytest.fixture(scope="session")
def chart(helm):
    c = helm.Chart.load(str(CHART))
    yield c
    c.close()


@pytest.fixture(scope="session")
def chart_defaults(chart) -> dict:
    return chart.values


@pytest.fixture(scope="session")
def renders(chart, chart_defaults) -> dict[str, Rendered]:
    return {name: Rendered(name, v, render_raw(chart, v), chart_defaults) for name, v in VALUE_SETS.items()}


@pytest.fixture(params=sorted(VALUE_SETS))
def rendered(request, renders) -> Rendered:
    return renders[request.param]


@pytest.fixture(scope="session")
def promtool() -> str:
    p = shutil.which("promtool")
    if not p:
        pytest.fail("promtool not found: scripts/check-deploy.sh installs it (Debian package prometheus)")
    return p


def duration_seconds(s: str) -> float:
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)?", s.strip())
    assert m, f"{s!r} is not a duet duration"
    v = float(m.group(1))
    return v * {"ms": 1e-3, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


def names_rs() -> Path:
    return REPO / "telemetry" / "src" / "names.rs"
