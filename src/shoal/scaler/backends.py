"""Where workers run: local child processes (the default) or a Kubernetes Deployment.

A backend is told a desired worker count and makes it so. Scale-down always drains: a worker
told to leave (SIGTERM, which Kubernetes also sends) unsubscribes, works through what the
broker had already queued for it, and only then disconnects (``shoal.runtime.worker``).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from shoal._processes import ChildProcess
from shoal.errors import ConfigError, ShoalError

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Something that runs workers."""

    name: str

    def observe(self) -> int:
        """Reap finished or crashed workers; returns the live (not draining) count."""
        ...

    def scale_to(self, desired: int) -> None:
        """Start or drain workers until ``desired`` are live."""
        ...

    def close(self) -> None:
        """Stop everything this backend started."""
        ...


@dataclass
class BackendStats:
    """What a backend did."""

    started: int = 0
    drained: int = 0
    crashed: int = 0
    replaced: int = 0
    worker_seconds: float = 0.0
    events: list[tuple[float, int]] = field(default_factory=list)


CLOSE_TIMEOUT_S: Final = 6.0
"""How long ``LocalBackend.close`` lets workers drain: a stopping scaler is given 8 s
(``shoal._stopping.STOP_GRACE_S``)."""


class LocalBackend:
    """Workers as child processes of this one.

    Args:
        spawn: starts one worker process and returns it.
        drain_timeout_s: how long a draining worker may take before it is killed.
        clock: monotonic seconds (injected for tests).
    """

    name = "local"

    def __init__(
        self,
        spawn: Callable[[], ChildProcess],
        *,
        drain_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spawn = spawn
        self.drain_timeout_s = drain_timeout_s
        self._clock = clock
        self.live: list[ChildProcess] = []
        self.draining: list[tuple[ChildProcess, float]] = []
        self.stats = BackendStats()
        self._last_observe = clock()

    def observe(self) -> int:
        """Reap drained workers, replace crashed ones, account worker-seconds."""
        now = self._clock()
        self.stats.worker_seconds += (len(self.live) + len(self.draining)) * (
            now - self._last_observe
        )
        self._last_observe = now
        for child, since in list(self.draining):
            if not child.alive():
                self.draining.remove((child, since))
                self.stats.drained += 1
            elif now - since > self.drain_timeout_s:
                log.warning(
                    "worker %s did not drain in %.0f s; killing it",
                    child.name,
                    self.drain_timeout_s,
                )
                child.kill()
        for child in list(self.live):
            if not child.alive():
                log.warning(
                    "worker %s exited unexpectedly (code %s); replacing it",
                    child.name,
                    child.wait(0),
                )
                self.live.remove(child)
                self.stats.crashed += 1
                self.live.append(self._start())
                self.stats.replaced += 1
        return len(self.live)

    def scale_to(self, desired: int) -> None:
        """Start new workers, or drain the newest ones."""
        if desired != len(self.live):
            self.stats.events.append((self._clock(), desired))
        while len(self.live) < desired:
            self.live.append(self._start())
        while len(self.live) > desired:
            child = self.live.pop()
            child.signal(signal.SIGTERM)  # a worker drains on SIGTERM
            self.draining.append((child, self._clock()))

    def _start(self) -> ChildProcess:
        child = self._spawn()
        self.stats.started += 1
        return child

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Drain everything for up to ``timeout_s``, then stop what is left at once.

        A worker still draining then gets a second SIGTERM, which ends it at once (what it
        had not acknowledged comes back from the gateways' spools).
        """
        self.scale_to(0)
        deadline = self._clock() + timeout_s
        while self.draining and self._clock() < deadline:
            self.observe()
            time.sleep(0.1)
        for child, _ in self.draining:
            log.warning("worker %s did not drain in %.0f s; stopping it", child.name, timeout_s)
            child.stop(timeout_s=2.0)
        self.draining.clear()


class KubernetesBackend:
    """Scale a Deployment through the Kubernetes API (the official client).

    The workers' pods drain on SIGTERM (give them a generous
    ``terminationGracePeriodSeconds``); crashed pods are restarted by the Deployment. The
    service account needs ``get`` and ``patch`` on the Deployment's ``deployments/scale``
    (``deploy/kubernetes/scaler.yaml``). API failures become ``ConfigError`` (wrong name,
    namespace or permissions: nothing will work until someone fixes them) or ``ShoalError``
    (anything else, e.g. an unreachable API server).

    Args:
        deployment: name of the workers' Deployment.
        namespace: its namespace.
        api: an ``AppsV1Api`` (None: build one from the in-cluster or kubeconfig settings).
        read_only: observe the Deployment but never patch it, for when KEDA sets the replicas
            from the scaler's ``/api/v1/scaling`` endpoint (``deploy/kubernetes/keda/``).
        request_timeout_s: the longest one API call may take (the scaler's loop waits for it).
        clock: monotonic seconds (injected for tests), the time of each scale event.
    """

    name = "kubernetes"

    def __init__(
        self,
        deployment: str,
        namespace: str = "default",
        api: Any = None,
        *,
        read_only: bool = False,
        request_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deployment = deployment
        self.namespace = namespace
        self.read_only = read_only
        self.request_timeout_s = request_timeout_s
        self._clock = clock
        self._api = api if api is not None else _apps_api()
        self.stats = BackendStats()
        self._replicas: int | None = None

    def observe(self) -> int:
        """Current replicas of the Deployment (its status), as its scale reports them."""
        scale = self._call("read", self._api.read_namespaced_deployment_scale)
        self._replicas = int(scale.spec.replicas or 0)
        return int(scale.status.replicas or 0)

    def scale_to(self, desired: int) -> None:
        """Patch the Deployment's scale subresource (unless read-only or unchanged)."""
        if self.read_only or desired == self._replicas:
            return
        self._call(
            "patch", self._api.patch_namespaced_deployment_scale, {"spec": {"replicas": desired}}
        )
        self._replicas = desired
        self.stats.events.append((self._clock(), desired))

    def close(self) -> None:
        """Nothing to stop: the cluster owns the pods."""

    def _call(self, verb: str, method: Callable[..., Any], *args: Any) -> Any:
        """Call the API for this Deployment; its errors become shoal errors saying what to check."""
        try:
            return method(
                self.deployment, self.namespace, *args, _request_timeout=self.request_timeout_s
            )
        except _api_errors() as exc:
            raise _api_error(exc, verb, self.namespace, self.deployment) from exc


def _api_errors() -> tuple[type[Exception], ...]:
    """The exceptions the official client raises (none to catch if it is not installed)."""
    try:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415
        from urllib3.exceptions import HTTPError  # noqa: PLC0415 - the client's transport
    except ImportError:
        return ()
    return (ApiException, HTTPError)


def _api_error(exc: Exception, verb: str, namespace: str, deployment: str) -> ShoalError:
    status = getattr(exc, "status", None)
    what = f"cannot {verb} the scale of Deployment {namespace}/{deployment}"
    if status == 404:
        return ConfigError(
            f"{what}: the Kubernetes API has no such Deployment (404). Check the scaler's "
            "--deployment and --namespace, and that the workers' Deployment is applied"
        )
    if status in (401, 403):
        return ConfigError(
            f"{what}: the Kubernetes API refused ({status} {getattr(exc, 'reason', '')}). Check "
            "the scaler's ServiceAccount and RBAC: its Role must allow get and patch on "
            f"deployments/scale for {deployment!r} in {namespace!r} "
            "(deploy/kubernetes/scaler.yaml)"
        )
    if status is not None:
        return ShoalError(
            f"{what}: the Kubernetes API answered {status} {getattr(exc, 'reason', '')}"
        )
    return ShoalError(
        f"{what}: the Kubernetes API is unreachable ({exc}). Check the API server address"
    )


def _apps_api() -> Any:
    try:
        from kubernetes import client  # noqa: PLC0415 - optional dependency
        from kubernetes import config as kube_config  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError(
            "the kubernetes backend needs the official client: pip install 'shoal[kubernetes]'"
        ) from exc
    # Its loaders are untyped in some client releases and typed in others.
    config: Any = kube_config
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except config.ConfigException as exc:
            raise ConfigError(
                "the kubernetes backend found no cluster credentials: it is not running in a "
                "pod (no service account) and has no kubeconfig (KUBECONFIG or ~/.kube/config): "
                f"{exc}"
            ) from exc
    return client.AppsV1Api()
