"""The compose cluster (deploy/compose/) against the chart's scrape contract: its Prometheus
scrapes every duet container where the chart's monitors do (port `metrics`, path /metrics),
adds only the labels duet's dashboard and rules group by, loads the chart's own rules, and
gives workers time to drain. The live check (every dashboard query and rule returning
series from the running cluster) is cli/tests/containers.rs with live_queries.py."""

from __future__ import annotations

import subprocess

import yaml

from conftest import CHART, REPO, duration_seconds

COMPOSE = REPO / "deploy" / "compose"
DUET_LABELS = {"outcome", "door", "priority", "placement", "role", "state", "worker", "direction", "reason"}


def _compose() -> dict:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def _duet_services(c: dict) -> dict[str, dict]:
    return {n: s for n, s in c["services"].items() if s.get("image", "").startswith("${DUET_IMAGE")}


def _env(service: dict) -> dict:
    return service.get("environment") or {}


def test_prometheus_scrapes_every_duet_container_on_the_charts_metrics_port_and_path():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    port = values["ports"]["metrics"]
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = {t: g["labels"]["component"] for g in job["static_configs"] for t in g["targets"]}
    c = _compose()
    services = _duet_services(c)
    assert set(services) == {"router", "prefill-0", "prefill-1", "decode-0", "decode-1"}
    for name, s in services.items():
        assert targets.get(f"{name}:{port}") == s["command"][0], f"{name} is not scraped as its role"
        listen = _env(s).get("DUET_METRICS_LISTEN")
        assert listen == f"0.0.0.0:{port}", f"{name} serves /metrics on {listen}"
    assert set(targets) == {f"{n}:{port}" for n in services}
    added = {r["target_label"] for r in job["relabel_configs"]} | {"component"}
    assert added == {"component", "namespace", "pod"}, added
    assert not added & DUET_LABELS
    # the namespace label is the cluster's name, as every duet process is told
    (ns,) = [r["replacement"] for r in job["relabel_configs"] if r["target_label"] == "namespace"]
    assert {_env(s)["DUET_CLUSTER"] for s in services.values()} == {ns}


def test_prometheus_loads_the_charts_rules_and_reaches_the_back_network():
    c = _compose()
    p = c["services"]["prometheus"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in p["volumes"]}
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    for rule_file in prom["rule_files"]:
        assert (COMPOSE / mounts[rule_file]).resolve() == (CHART / "files" / "alerts.yml").resolve()
    assert set(p["networks"]) == {"front", "back"}
    assert c["networks"]["back"]["internal"] is True
    assert all(port.startswith("127.0.0.1:") for port in p["ports"])


def test_prometheus_config_is_valid(promtool, tmp_path):
    # promtool resolves rule_files on this host: point them at the chart's file.
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    prom["rule_files"] = [str(CHART / "files" / "alerts.yml")]
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(prom))
    o = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True)
    assert o.returncode == 0, o.stdout + o.stderr


def test_workers_get_longer_than_their_drain_to_stop():
    for name, s in _duet_services(_compose()).items():
        drain = duration_seconds(_env(s).get("DUET_DRAIN", "10s"))
        assert duration_seconds(s["stop_grace_period"]) > drain, name
