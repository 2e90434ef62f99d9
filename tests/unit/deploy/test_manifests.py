"""deploy/kubernetes, checked offline: Kubernetes schemas, cross-references, and shoal itself.

Every manifest validates against the (strict) JSON schema of a pinned Kubernetes release; the
KEDA ScaledObject, a custom resource, is checked field by field. The references between
manifests must hold (selectors, RBAC, Secrets, volumes), and everything the manifests say to
shoal is checked with shoal's own code: container args with the real CLI parser, environment
variables against the names the CLI reads, the pipeline with the spec parser, the broker
config against broker/secure.conf, the ACL against shoal.broker.access, and the KEDA trigger
against what the scaler's HTTP endpoint really serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import re
import shutil
import subprocess
import tomllib
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import orjson
import pytest
import yaml

import shoal
from shoal._cli import common
from shoal.broker.access import BrokerUser, Role, render_acl
from shoal.broker.profiles import ConfigTemplate
from shoal.broker.settings import BrokerSettings
from shoal.cli import build_parser
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.runtime.scaler import Scaler, ScalerConfig
from shoal.scaler.http import MetricsServer
from shoal.scaler.policy import Bounds
from shoal.schemas.topics import Topics

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
KEDA = DEPLOY / "keda"
MONITORING = DEPLOY / "monitoring"

KUBERNETES_VERSION = "1.30.0"
"""The oldest release the manifests target (the combiner's pod-index label is on by default
from 1.28; 1.30 is the oldest release still supported by the major cloud providers)."""

CUSTOM_RESOURCES = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}
"""Kinds kubernetes-validate has no schema for; each is checked by a test of its own."""

WORKLOADS = ("Deployment", "StatefulSet")


# -- loading -------------------------------------------------------------------------------------


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


@cache
def documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in manifest_files() for doc in _load(path)]


def base_docs() -> list[dict[str, Any]]:
    return [doc for path, doc in documents() if path.parent == BASE]


def find(kind: str, name: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    matches = [
        d
        for d in (base_docs() if docs is None else docs)
        if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def workloads(docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [d for d in (base_docs() if docs is None else docs) if d["kind"] in WORKLOADS]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def shoal_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in containers(workload) if c.get("command") == ["shoal"]]
    return container


def kustomization(directory: Path) -> dict[str, Any]:
    (doc,) = _load(directory / "kustomization.yaml")
    return doc


def namespace() -> str:
    value = kustomization(BASE)["namespace"]
    assert isinstance(value, str)
    return value


def pipeline() -> PipelineSpec:
    text = find("ConfigMap", "shoal-pipeline")["data"]["pipeline.toml"]
    return parse_pipeline(tomllib.loads(text))


# -- the Kubernetes schema -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "doc"),
    [
        pytest.param(
            path, doc, id=f"{path.relative_to(DEPLOY)}:{doc['kind']}/{doc['metadata']['name']}"
        )
        for path, doc in documents()
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_RESOURCES
    ],
)
def test_every_manifest_validates_against_the_kubernetes_schema(
    path: Path, doc: dict[str, Any]
) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")


def test_the_schema_check_catches_a_misspelt_field() -> None:
    worker = find("Deployment", "shoal-worker")
    broken = {**worker, "spec": {**worker["spec"], "terminationGracePeriodSecond": 180}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_only_known_custom_resources_escape_the_schema_check() -> None:
    unknown = []
    for _, doc in documents():
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unknown.append((doc["apiVersion"], doc["kind"]))
    assert set(unknown) == CUSTOM_RESOURCES


# -- kustomize -----------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", [DEPLOY, BASE, KEDA, MONITORING], ids=lambda p: p.name)
def test_kustomizations_list_every_manifest_beside_them(directory: Path) -> None:
    listed = kustomization(directory)["resources"]
    for entry in listed:
        assert (directory / entry).exists(), f"{directory.name}: {entry} does not exist"
    own = {p.name for p in directory.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert own <= set(listed), f"{directory.name}: not in kustomization.yaml: {own - set(listed)}"


def test_manifests_leave_the_namespace_to_kustomize() -> None:
    for path, doc in documents():
        assert "namespace" not in doc["metadata"], f"{path.name}: {doc['metadata']['name']}"
    assert kustomization(KEDA)["namespace"] == namespace()
    assert kustomization(MONITORING)["namespace"] == namespace()
    assert find("Namespace", namespace())


def kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (kubectl kustomize builds the overlays offline)")
    built = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


@pytest.mark.parametrize("directory", [DEPLOY, KEDA], ids=lambda p: p.name)
def test_kustomize_builds_valid_manifests_in_one_namespace(directory: Path) -> None:
    docs = kustomize(directory)
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_RESOURCES:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace(), doc["metadata"]["name"]
    binding = find("RoleBinding", "shoal-scaler", docs)
    assert {s.get("namespace") for s in binding["subjects"]} == {namespace()}
    for workload in shoal_workloads(docs):
        check_shoal_args(workload)


def test_the_keda_overlay_makes_the_scaler_observe_only() -> None:
    docs = kustomize(KEDA)
    scaler = parse_shoal_args(find("Deployment", "shoal-scaler", docs))
    assert scaler.backend == "keda"
    verbs = {
        tuple(r["resources"]): set(r["verbs"]) for r in find("Role", "shoal-scaler", docs)["rules"]
    }
    assert verbs == {("deployments",): {"get"}, ("deployments/scale",): {"get"}}
    assert find("ScaledObject", "shoal-worker", docs)
    base = kustomize(DEPLOY)
    assert parse_shoal_args(find("Deployment", "shoal-scaler", base)).backend == "kubernetes"
    assert not [d for d in base if d["kind"] == "ScaledObject"]


# -- selectors and services ------------------------------------------------------------------------


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def test_workloads_select_their_own_pods() -> None:
    for workload in workloads():
        selector = workload["spec"]["selector"]["matchLabels"]
        assert labels_match(selector, pod_labels(workload)), workload["metadata"]["name"]


def test_every_service_selects_one_workload_and_its_named_ports() -> None:
    for service in (d for d in base_docs() if d["kind"] == "Service"):
        name = service["metadata"]["name"]
        selected = [
            w for w in workloads() if labels_match(service["spec"]["selector"], pod_labels(w))
        ]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} workloads"
        ports = {p["name"] for c in containers(selected[0]) for p in c.get("ports", [])}
        for port in service["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            assert target in ports, f"Service {name}: no container port {target!r}"


def test_statefulsets_are_governed_by_a_headless_service_of_their_pods() -> None:
    for workload in (w for w in workloads() if w["kind"] == "StatefulSet"):
        service = find("Service", workload["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"
        assert labels_match(service["spec"]["selector"], pod_labels(workload))


def test_the_broker_admits_every_pod_that_connects_to_it() -> None:
    policy = find("NetworkPolicy", "shoal-broker")
    broker = find("StatefulSet", "shoal-broker")
    assert labels_match(policy["spec"]["podSelector"]["matchLabels"], pod_labels(broker))
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    clients = [w for w in workloads() if any("SHOAL_BROKER" in env_of(c) for c in containers(w))]
    assert {w["metadata"]["name"] for w in clients} == {
        "shoal-worker",
        "shoal-combiner",
        "shoal-scaler",
    }
    for workload in clients:
        assert labels_match(peer["podSelector"]["matchLabels"], pod_labels(workload))
    assert [p["port"] for p in rule["ports"]] == [broker_service_port()]


def broker_service_port() -> int:
    (port,) = find("Service", "shoal-broker")["spec"]["ports"]
    value: int = port["port"]
    return value


# -- the shoal command lines -----------------------------------------------------------------------

EXPECTED_COMMAND = {
    "shoal-worker": "worker",
    "shoal-combiner": "combiner",
    "shoal-scaler": "scaler",
}
FIELD_VALUES = {
    "metadata.namespace": "shoal",
    "metadata.labels['apps.kubernetes.io/pod-index']": "0",
}
"""What the kubelet would put into fieldRef variables, for expanding $(VAR) in args."""


def expand(arg: str, env: dict[str, dict[str, Any]]) -> str:
    """Expand $(VAR) the way the kubelet does; unknown variables fail the test."""

    def value(match: re.Match[str]) -> str:
        entry = env.get(match.group(1))
        assert entry is not None, f"$({match.group(1)}) is not in the container's env"
        if "value" in entry:
            return str(entry["value"])
        field = entry["valueFrom"]["fieldRef"]["fieldPath"]
        assert field in FIELD_VALUES, f"no test value for fieldRef {field}"
        return FIELD_VALUES[field]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg)


def parse_shoal_args(workload: dict[str, Any]) -> Any:
    container = shoal_container(workload)
    args = [expand(a, env_of(container)) for a in container["args"]]
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{workload['metadata']['name']}: shoal refuses {args}")


def check_shoal_args(workload: dict[str, Any]) -> Any:
    name = workload["metadata"]["name"]
    parsed = parse_shoal_args(workload)
    assert parsed.command == EXPECTED_COMMAND[name]
    mounts = {m["mountPath"]: m["name"] for m in shoal_container(workload)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    pipeline_file = Path(parsed.pipeline)
    volume = volumes[mounts[str(pipeline_file.parent)]]
    assert volume["configMap"]["name"] == "shoal-pipeline"
    assert pipeline_file.name in find("ConfigMap", "shoal-pipeline")["data"]
    return parsed


def shoal_workloads(docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [w for w in workloads(docs) if w["metadata"]["name"] in EXPECTED_COMMAND]


def test_container_args_are_accepted_by_shoals_cli() -> None:
    names = {w["metadata"]["name"] for w in workloads()}
    assert names == {*EXPECTED_COMMAND, "shoal-broker"}
    for workload in shoal_workloads():
        check_shoal_args(workload)


def test_the_cli_check_refuses_a_renamed_flag() -> None:
    worker = find("Deployment", "shoal-worker")
    renamed = dict(shoal_container(worker), args=["worker", "--pipeline-file", "/etc/shoal/x"])
    spec = dict(pod_spec(worker), containers=[renamed])
    broken = {**worker, "spec": {**worker["spec"], "template": {"metadata": {}, "spec": spec}}}
    with pytest.raises(pytest.fail.Exception, match="shoal refuses"):
        parse_shoal_args(broken)


def test_environment_variables_are_ones_shoal_reads() -> None:
    read = set(re.findall(r'"(SHOAL_[A-Z_]+)"', inspect.getsource(common)))
    assert {"SHOAL_BROKER", "SHOAL_USERNAME", "SHOAL_PASSWORD_FILE"} <= read
    for workload in workloads():
        for container in containers(workload):
            for name in env_of(container):
                if name.startswith("SHOAL_") and name != "SHOAL_PARTITION":
                    assert name in read, f"{workload['metadata']['name']}: shoal never reads {name}"


def test_components_reach_the_broker_service_with_their_own_password() -> None:
    secret = find("Secret", "shoal-credentials")
    for name in EXPECTED_COMMAND:
        workload = next(w for w in workloads() if w["metadata"]["name"] == name)
        container = shoal_container(workload)
        env = {k: v.get("value") for k, v in env_of(container).items()}
        settings = BrokerSettings.from_url(str(env["SHOAL_BROKER"]))
        assert (settings.host, settings.port) == ("shoal-broker", broker_service_port())
        assert "SHOAL_PASSWORD" not in env  # a file from the Secret, never a literal
        password = Path(str(env["SHOAL_PASSWORD_FILE"]))
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = next(
            v for v in pod_spec(workload)["volumes"] if v["name"] == mounts[str(password.parent)]
        )
        assert volume["secret"]["secretName"] == "shoal-credentials"
        # Only its own key is mounted, under the file name SHOAL_PASSWORD_FILE names.
        assert volume["secret"]["items"] == [{"key": env["SHOAL_USERNAME"], "path": password.name}]
        assert env["SHOAL_USERNAME"] in secret["stringData"]


def test_workers_drain_on_one_core_and_leave_replicas_to_the_scaler() -> None:
    worker = find("Deployment", "shoal-worker")
    assert "replicas" not in worker["spec"]  # `kubectl apply` must not undo the scaler
    assert pod_spec(worker)["terminationGracePeriodSeconds"] >= 60
    container = shoal_container(worker)
    assert env_of(container)["POLARS_MAX_THREADS"]["value"] == "1"
    assert (
        container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"] == "1"
    )
    assert "--id" not in container["args"]  # every pod must get a fresh client id


def test_one_combiner_per_partition_with_its_checkpoint_on_a_volume() -> None:
    combiner = find("StatefulSet", "shoal-combiner")
    assert combiner["spec"]["replicas"] == pipeline().partitions
    container = shoal_container(combiner)
    partition = env_of(container)["SHOAL_PARTITION"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert partition == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert "$(SHOAL_PARTITION)" in container["args"]
    parsed = parse_shoal_args(combiner)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in combiner["spec"]["volumeClaimTemplates"]}
    assert mounts[str(parsed.state_dir)] in claims


def test_the_pipeline_config_map_is_a_valid_pipeline() -> None:
    spec = pipeline()
    assert spec.name == "default"
    assert spec.inputs


# -- RBAC ----------------------------------------------------------------------------------------


def test_the_scaler_may_get_and_patch_only_the_workers_scale() -> None:
    scaler = find("Deployment", "shoal-scaler")
    parsed = parse_shoal_args(scaler)
    assert parsed.backend == "kubernetes"
    assert parsed.deployment == "shoal-worker"
    assert parsed.namespace == FIELD_VALUES["metadata.namespace"]
    assert find("Deployment", parsed.deployment)
    account = pod_spec(scaler)["serviceAccountName"]
    assert find("ServiceAccount", account)
    binding = find("RoleBinding", "shoal-scaler")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "shoal-scaler",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    rules = find("Role", binding["roleRef"]["name"])["rules"]
    for rule in rules:
        assert rule["apiGroups"] == ["apps"]
        assert rule["resourceNames"] == [parsed.deployment]
    verbs = {tuple(r["resources"]): set(r["verbs"]) for r in rules}
    assert verbs == {("deployments",): {"get"}, ("deployments/scale",): {"get", "patch"}}


def test_only_the_scaler_gets_an_api_token() -> None:
    for workload in workloads():
        wanted = workload["metadata"]["name"] == "shoal-scaler"
        assert pod_spec(workload)["automountServiceAccountToken"] is wanted


# -- security ------------------------------------------------------------------------------------


def test_every_container_runs_unprivileged_on_a_read_only_root() -> None:
    for workload in workloads():
        pod = pod_spec(workload)["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["runAsUser"] > 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in containers(workload):
            where = f"{workload['metadata']['name']}/{container['name']}"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert {"requests", "limits"} <= set(container["resources"]), where


def test_the_example_secret_is_plainly_a_placeholder() -> None:
    secret = find("Secret", "shoal-credentials")
    assert secret["stringData"]
    for key, value in secret["stringData"].items():
        assert value.startswith("CHANGE-ME"), key
    assert "EXAMPLE ONLY" in (BASE / "secret.example.yaml").read_text()


def test_shoal_images_carry_shoals_version() -> None:
    for workload in workloads():
        for container in containers(workload):
            image = container["image"]
            if image.split(":")[0] == "shoal":
                assert image == f"shoal:{shoal.__version__}"
    (image,) = kustomization(BASE)["images"]
    assert image == {"name": "shoal", "newTag": shoal.__version__}


# -- the broker ------------------------------------------------------------------------------------


def directives(text: str) -> Counter[tuple[str, str]]:
    lines = (line.strip() for line in text.splitlines())
    pairs = (line.partition(" ") for line in lines if line and not line.startswith("#"))
    return Counter((key, value.strip()) for key, _, value in pairs)


def test_the_broker_keeps_every_fixed_setting_of_the_secure_profile() -> None:
    profile = directives((REPO / "broker" / "secure.conf").read_text())
    deployed = directives(find("ConfigMap", "shoal-broker-config")["data"]["mosquitto.conf"])
    fixed = Counter({k: n for k, n in profile.items() if "${" not in k[1]})
    assert ("max_queued_bytes", "134217728") in fixed  # the profile parsed as intended
    missing = fixed - deployed
    assert not missing, f"settings of broker/secure.conf missing or changed: {sorted(missing)}"
    keys = {key for key, _ in deployed}
    assert {"password_file", "acl_file", "persistence_location", "listener"} <= keys


def test_the_broker_files_are_where_its_config_says() -> None:
    broker = find("StatefulSet", "shoal-broker")
    config = dict(
        k for k in directives(find("ConfigMap", "shoal-broker-config")["data"]["mosquitto.conf"])
    )
    (mosquitto,) = pod_spec(broker)["containers"]
    mounts = {m["mountPath"]: m["name"] for m in mosquitto["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(broker)["volumes"]}
    acl = Path(config["acl_file"])
    assert volumes[mounts[str(acl.parent)]]["configMap"]["name"] == "shoal-broker-config"
    assert acl.name in find("ConfigMap", "shoal-broker-config")["data"]
    password_dir = str(Path(config["password_file"]).parent)
    (init,) = pod_spec(broker)["initContainers"]
    assert password_dir in {m["mountPath"] for m in init["volumeMounts"]}
    assert mounts[password_dir] in {m["name"] for m in init["volumeMounts"]}
    data_claim = mounts[config["persistence_location"].rstrip("/")]
    assert data_claim in {c["metadata"]["name"] for c in broker["spec"]["volumeClaimTemplates"]}
    (port,) = mosquitto["ports"]
    assert config["listener"].split()[0] == str(port["containerPort"])


def acl_users() -> list[BrokerUser]:
    """The users of the deployed ACL, with the roles its ``# role`` lines name."""
    text = find("ConfigMap", "shoal-broker-config")["data"]["acl"]
    lines = text.splitlines()
    users = []
    for previous, line in itertools.pairwise(lines):
        if line.startswith("user ") and previous.startswith("# "):
            role = Role.parse(previous[2:])
            if role.kind == "worker":  # reads what the deployed pipeline reads
                role = dataclasses.replace(role, inputs=tuple(pipeline().inputs))
            users.append(BrokerUser(line.split()[1], "unused", role))
    return users


def test_the_acl_is_what_shoal_renders_for_its_users() -> None:
    template = (REPO / "broker" / "secure.acl").read_text()
    rendered = ConfigTemplate(template).substitute(
        root="(none)", users=render_acl(acl_users(), Topics())
    )
    deployed = find("ConfigMap", "shoal-broker-config")["data"]["acl"]
    assert deployed.rstrip("\n") == rendered.rstrip("\n")


def test_every_user_has_a_password_and_every_component_its_role() -> None:
    users = {u.name: u for u in acl_users()}
    assert set(users) == set(find("Secret", "shoal-credentials")["stringData"])
    roles = {"shoal-worker": "worker", "shoal-combiner": "combiner", "shoal-scaler": "admin"}
    for workload in workloads():
        name = workload["metadata"]["name"]
        if name in roles:
            user = env_of(shoal_container(workload))["SHOAL_USERNAME"]["value"]
            role = users[user].role
            assert role is not None
            assert role.kind == roles[name]
            if role.pipeline is not None:
                assert role.pipeline == pipeline().name


# -- KEDA ----------------------------------------------------------------------------------------


class _StillBackend:
    """A backend that reports a fixed worker count (the scaler only needs observe)."""

    name = "still"

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def observe(self) -> int:
        return self.workers

    def scale_to(self, desired: int) -> None:
        self.workers = desired

    def close(self) -> None:
        pass


def scaled_object() -> dict[str, Any]:
    (doc,) = _load(KEDA / "scaledobject.yaml")
    return doc


def lookup(data: Any, location: str) -> Any:
    """A GJSON path of plain keys (what KEDA's valueLocation uses here)."""
    for key in location.split("."):
        assert isinstance(data, dict), f"{location!r}: {data!r} is not an object"
        assert key in data, f"{location!r}: no {key!r} in {data!r}"
        data = data[key]
    return data


def serve_once(scaler: Scaler, path: str) -> tuple[str, dict[str, Any]]:
    """GET ``path`` from the scaler's real HTTP endpoint on a loopback port."""

    async def run() -> tuple[str, dict[str, Any]]:
        server = MetricsServer(scaler.render_metrics, scaler.render_json, "127.0.0.1", 0)
        port = await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: keda\r\n\r\n".encode())
            await writer.drain()
            response = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            await writer.wait_closed()
        finally:
            await server.close()
        head, _, body = response.partition(b"\r\n\r\n")
        return head.decode().splitlines()[0], orjson.loads(body)

    return asyncio.run(run())


def test_the_scaled_object_targets_the_workers() -> None:
    scaled = scaled_object()
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    assert find("Deployment", target["name"])["metadata"]["name"] == "shoal-worker"
    scaler = parse_shoal_args(find("Deployment", "shoal-scaler"))
    assert scaled["spec"]["minReplicaCount"] == scaler.min_workers
    assert scaled["spec"]["maxReplicaCount"] == scaler.max_workers
    assert scaler.min_workers <= scaled["spec"]["fallback"]["replicas"] <= scaler.max_workers


def test_the_trigger_reads_the_scalers_decision_from_its_service() -> None:
    (trigger,) = scaled_object()["spec"]["triggers"]
    assert trigger["type"] == "metrics-api"
    # AverageValue with target 1: the HPA asks for ceil(desired_workers / 1) replicas.
    assert trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["targetValue"] == "1"
    assert meta.get("format", "json") == "json"
    url = urlsplit(meta["url"])
    service = find("Service", "shoal-scaler")
    (port,) = service["spec"]["ports"]
    assert url.scheme == "http"
    assert url.hostname == f"{service['metadata']['name']}.{namespace()}.svc.cluster.local"
    assert url.port == port["port"]
    assert url.path == "/api/v1/scaling"
    scaler_args = parse_shoal_args(find("Deployment", "shoal-scaler"))
    assert scaler_args.port == port["port"]
    assert scaler_args.bind == "0.0.0.0"  # reachable from KEDA's namespace


def test_the_value_location_is_a_number_the_scaler_really_serves() -> None:
    (trigger,) = scaled_object()["spec"]["triggers"]
    location = trigger["metadata"]["valueLocation"]
    args = parse_shoal_args(find("Deployment", "shoal-scaler"))
    config = ScalerConfig(
        spec=pipeline(),
        broker=BrokerSettings.from_url("mqtt://127.0.0.1:1"),  # never connected
        policy=args.policy,
        bounds=Bounds(args.min_workers, args.max_workers),
        http_port=None,
    )
    scaler = Scaler(config, _StillBackend(workers=2))
    scaler.tick()
    status, body = serve_once(scaler, urlsplit(trigger["metadata"]["url"]).path)
    assert status.split()[1] == "200"
    value = lookup(body, location)
    assert isinstance(value, int | float)
    assert not isinstance(value, bool)
    assert args.min_workers <= value <= args.max_workers
    # The figure KEDA follows is the policy's decision, not a raw lag figure.
    assert value == scaler.history[-1].decision.desired


# -- Prometheus ------------------------------------------------------------------------------------


def metrics_flags(workload: dict[str, Any]) -> tuple[str, int]:
    """(host, port) of the workload's /metrics, as shoal's own parser reads its args."""
    args = parse_shoal_args(workload)
    if args.command == "scaler":  # --metrics-host/--metrics-port are aliases of --bind/--port
        return args.bind, args.port
    address = common.metrics_address(args, env={})
    assert address is not None, f"{workload['metadata']['name']}: no --metrics-port"
    return address


@pytest.mark.parametrize("name", sorted(EXPECTED_COMMAND))
def test_every_shoal_process_serves_metrics_where_its_annotations_say(name: str) -> None:
    workload = next(w for w in workloads() if w["metadata"]["name"] == name)
    host, port = metrics_flags(workload)
    assert host == "0.0.0.0"  # reachable by Prometheus, not only from inside the pod
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    ports = {p["name"]: p for p in shoal_container(workload)["ports"]}
    assert ports["metrics"]["containerPort"] == port


def service_monitor() -> dict[str, Any]:
    (doc,) = [d for p, d in documents() if p.parent == MONITORING]
    return doc


def test_the_service_monitor_scrapes_every_shoal_process_through_a_service() -> None:
    monitor = service_monitor()
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint.get("scheme", "http") == "http"
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = set()
    for service in (d for d in base_docs() if d["kind"] == "Service"):
        if not labels_match(selector, service["metadata"]["labels"]):
            continue
        named = {p["name"]: p for p in service["spec"].get("ports", [])}
        if endpoint["port"] not in named:
            continue  # the broker: no metrics port
        (workload,) = [
            w for w in workloads() if labels_match(service["spec"]["selector"], pod_labels(w))
        ]
        assert named[endpoint["port"]]["port"] == metrics_flags(workload)[1]
        scraped.add(workload["metadata"]["name"])
    assert scraped == set(EXPECTED_COMMAND)
    for label in monitor["spec"].get("targetLabels", []):
        assert all(label in s["metadata"]["labels"] for s in base_docs() if s["kind"] == "Service")


def test_the_monitoring_overlay_builds_in_the_base_namespace() -> None:
    (monitor,) = kustomize(MONITORING)
    assert monitor["kind"] == "ServiceMonitor"
    assert monitor["metadata"]["namespace"] == namespace()
