"""The Kubernetes base (deploy/k8s/base), checked offline: rendered by `kubectl kustomize` when
kubectl is installed (else by `render_base`, which applies the three kustomize features the base
uses: resources, labels on metadata and pod templates (not selectors), images — and must agree with kubectl where both
run), every resource validated against the Kubernetes OpenAPI schemas shipped with
kubernetes-validate (strict: unknown fields fail), and the manifests checked against the
services' real command lines, flags, variables and healthcheck CLI."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from service_process import REPO

from services.common import healthcheck

BASE = REPO / "deploy" / "k8s" / "base"
COMPONENTS = ("gateway", "drafter", "verifier", "kvstore")
PORTS = {"kvstore": 50051, "verifier": 50052, "drafter": 50053, "gateway": 8000}


def render_base() -> list[dict]:
    """The base rendered in Python: resources in order, labels added to metadata, images set."""
    k = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = [d for f in k["resources"] for d in yaml.safe_load_all((BASE / f).read_text()) if d]
    labels = {key: v for entry in k.get("labels", []) for key, v in entry["pairs"].items()}
    assert all(e.get("includeTemplates") and not e.get("includeSelectors")
               for e in k.get("labels", [])), "render_base handles only this label form"
    images = {i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in k.get("images", [])}
    for d in docs:
        d["metadata"].setdefault("labels", {}).update(labels)
        if d["kind"] == "Deployment":
            d["spec"]["template"]["metadata"].setdefault("labels", {}).update(labels)
            for c in d["spec"]["template"]["spec"]["containers"]:
                c["image"] = images.get(c["image"], c["image"])
    return docs


def _key(d: dict) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    ours = render_base()
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(BASE)], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        theirs = [d for d in yaml.safe_load_all(out) if d]
        assert sorted(map(_key, theirs)) == sorted(map(_key, ours))
        assert {_key(d): d for d in theirs} == {_key(d): d for d in ours}
        return theirs
    return ours


def _get(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if _key(d) == (kind, name)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def test_every_resource_matches_the_kubernetes_schema(docs):
    import kubernetes_validate  # a required test dependency: missing fails, never skips

    version = kubernetes_validate.latest_version()
    for d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{_key(d)}: {e.message} at {list(e.path)}")


def test_each_component_has_deployment_service_pdb_and_probes(docs):
    for name in (*COMPONENTS, "redis"):
        dep = _get(docs, "Deployment", name)
        svc = _get(docs, "Service", name)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert c["readinessProbe"] and c["livenessProbe"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    for name in COMPONENTS:
        pdb = _get(docs, "PodDisruptionBudget", name)
        assert pdb["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}


def _container(docs, name: str) -> dict:
    return _get(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", ["kvstore", "verifier", "drafter"])
def test_grpc_probes_run_the_healthcheck_on_the_service_port(docs, name):
    c = _container(docs, name)
    assert c["ports"][0]["containerPort"] == PORTS[name]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:3] == ["python", "-m", "services.common.healthcheck"]
        args = cmd[3:]
        assert args[args.index("--grpc") + 1] == f"127.0.0.1:{PORTS[name]}"
        # the flags parse; nothing of ours listens on the service's port in the tests: unhealthy
        assert healthcheck.main([*args, "--timeout", "0.1"]) == 1
    argv = c["command"]
    assert argv[:3] == ["python", "-m", f"services.{name}"]
    assert argv[argv.index("--port") + 1] == str(PORTS[name])


def test_commands_parse_with_the_real_flags(docs):
    import argparse

    from services.common.modelsvc import add_args
    from services.gateway.__main__ import build_parser
    from services.kvstore.__main__ import parse_args as kvstore_args

    def model_service(name):
        def parse(argv):
            p = argparse.ArgumentParser()
            add_args(p, name, PORTS[name])
            return p.parse_args(argv)
        return parse

    parsers = {"kvstore": kvstore_args, "verifier": model_service("verifier"),
               "drafter": model_service("drafter"), "gateway": build_parser().parse_args}
    for name, parse in parsers.items():
        parse(_container(docs, name)["command"][3:])


def test_configmap_variables_are_read_by_the_code(docs):
    source = "".join(p.read_text() for d in ("services", "vericache")
                     for p in (REPO / d).rglob("*.py"))
    for key in _get(docs, "ConfigMap", "vericache-config")["data"]:
        if key.startswith("VERICACHE_"):
            short = key.removeprefix("VERICACHE_")
            assert f'"{key}"' in source or f'env("{short}"' in source, f"{key} is read nowhere"


def test_secrets_reach_every_service(docs):
    secret = _get(docs, "Secret", "vericache-secrets")
    assert set(secret["stringData"]) == {"VERICACHE_API_KEY", "VERICACHE_INTERNAL_TOKEN"}
    gw = _container(docs, "gateway")
    assert {"secretRef": {"name": "vericache-secrets"}} in gw["envFrom"]
    for name in ("kvstore", "verifier", "drafter"):
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _container(docs, name)["env"]
                if "valueFrom" in e}
        assert refs["VERICACHE_INTERNAL_TOKEN"]["name"] == "vericache-secrets"


def test_sessions_stay_on_one_pod_and_hpas_scale(docs):
    for name in ("drafter", "verifier"):
        svc = _get(docs, "Service", name)
        assert svc["spec"]["sessionAffinity"] == "ClientIP"
        hpa = _get(docs, "HorizontalPodAutoscaler", name)
        (metric,) = hpa["spec"]["metrics"]
        assert metric["external"]["metric"]["name"] == "vericache_active_requests"
    gw = _get(docs, "HorizontalPodAutoscaler", "gateway")
    assert gw["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    metrics_src = (REPO / "services" / "gateway" / "metrics.py").read_text()
    assert '"vericache_active_requests"' in metrics_src
