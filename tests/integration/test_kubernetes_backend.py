"""KubernetesBackend through the official client against a fake API server on 127.0.0.1."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from shoal.errors import ConfigError, ShoalError
from shoal.scaler.backends import KubernetesBackend
from tests.support.fake_kubernetes import FakeDeployment, FakeKubernetes

NAMESPACE = "shoal"
WORKERS = "shoal-worker"
SCALE_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{WORKERS}/scale"


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    with FakeKubernetes({(NAMESPACE, WORKERS): FakeDeployment(replicas=2)}) as server:
        yield server


@pytest.fixture
def apps(fake: FakeKubernetes) -> Iterator[client.AppsV1Api]:
    configuration = client.Configuration(host=fake.url)
    with client.ApiClient(configuration) as api_client:
        yield client.AppsV1Api(api_client)


def backend(apps: client.AppsV1Api, name: str = WORKERS, **kwargs: bool) -> KubernetesBackend:
    return KubernetesBackend(name, NAMESPACE, api=apps, **kwargs)


def test_observe_reads_the_running_replicas(fake: FakeKubernetes, apps: client.AppsV1Api) -> None:
    fake.deployments[NAMESPACE, WORKERS].status_replicas = 3  # a scale-up still starting
    assert backend(apps).observe() == 3
    assert [(r.method, r.path) for r in fake.requests] == [("GET", SCALE_PATH)]


def test_scale_to_patches_spec_replicas_once(fake: FakeKubernetes, apps: client.AppsV1Api) -> None:
    workers = backend(apps)
    workers.observe()
    workers.scale_to(5)
    (patch,) = fake.patches()
    assert patch.path == SCALE_PATH
    assert patch.body == {"spec": {"replicas": 5}}
    # A merge patch: the API server would refuse an object sent as a JSON patch.
    assert patch.content_type in (
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
    )
    assert fake.deployments[NAMESPACE, WORKERS].replicas == 5
    assert workers.observe() == 5
    assert [desired for _, desired in workers.stats.events] == [5]


def test_scale_to_the_current_count_sends_no_patch(
    fake: FakeKubernetes, apps: client.AppsV1Api
) -> None:
    workers = backend(apps)
    workers.observe()
    workers.scale_to(2)
    workers.scale_to(4)
    workers.scale_to(4)  # remembered from its own patch
    assert [p.body for p in fake.patches()] == [{"spec": {"replicas": 4}}]


def test_scale_down_to_zero_and_back(fake: FakeKubernetes, apps: client.AppsV1Api) -> None:
    workers = backend(apps)
    workers.observe()
    workers.scale_to(0)
    assert workers.observe() == 0  # the API omits replicas: 0 in the Scale's spec
    workers.scale_to(0)
    workers.scale_to(1)
    assert [p.body for p in fake.patches()] == [
        {"spec": {"replicas": 0}},
        {"spec": {"replicas": 1}},
    ]


def test_read_only_observes_but_never_patches(fake: FakeKubernetes, apps: client.AppsV1Api) -> None:
    workers = backend(apps, read_only=True)
    assert workers.observe() == 2
    workers.scale_to(6)
    assert fake.patches() == []
    assert fake.deployments[NAMESPACE, WORKERS].replicas == 2


def test_unknown_deployment_is_a_config_error_saying_what_to_check(
    apps: client.AppsV1Api,
) -> None:
    with pytest.raises(ConfigError) as caught:
        backend(apps, name="shoal-workers").observe()
    message = str(caught.value)
    assert "shoal/shoal-workers" in message
    assert "404" in message
    assert "--deployment" in message
    assert "--namespace" in message
    assert isinstance(caught.value.__cause__, client.ApiException)


def test_forbidden_patch_points_at_rbac(fake: FakeKubernetes, apps: client.AppsV1Api) -> None:
    fake.forbidden.add("patch")
    workers = backend(apps)
    workers.observe()
    with pytest.raises(ConfigError, match=r"403 .*RBAC.*patch on deployments/scale"):
        workers.scale_to(3)
    assert fake.deployments[NAMESPACE, WORKERS].replicas == 2


def test_unreachable_api_server_is_a_shoal_error(fake: FakeKubernetes) -> None:
    url = fake.url
    fake.close()  # nothing listens there any more
    configuration = client.Configuration(host=url)
    configuration.retries = False
    with client.ApiClient(configuration) as api_client:
        workers = KubernetesBackend(WORKERS, NAMESPACE, api=client.AppsV1Api(api_client))
        with pytest.raises(ShoalError, match="unreachable"):
            workers.observe()


def test_a_hung_api_server_cannot_stall_the_scaler(
    fake: FakeKubernetes, apps: client.AppsV1Api
) -> None:
    fake.delay_s = 1.0
    workers = KubernetesBackend(WORKERS, NAMESPACE, api=apps, request_timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(ShoalError, match="unreachable"):
        workers.observe()
    assert time.monotonic() - started < 1.5


def test_without_the_client_package_the_message_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(ConfigError, match=r"pip install 'shoal\[kubernetes\]'"):
        KubernetesBackend(WORKERS, NAMESPACE)


def test_without_cluster_credentials_the_message_says_where_it_looked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(
        config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing")
    )
    with pytest.raises(ConfigError, match=r"no cluster credentials.*kubeconfig"):
        KubernetesBackend(WORKERS, NAMESPACE)
