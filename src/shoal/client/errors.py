"""Errors of the results client, placed in shoal's one exception tree.

::

    ShoalError
    ├── ConfigError
    │   └── NoSuchPipelineError      nothing on the broker names this pipeline
    ├── BrokerError
    │   └── BrokerUnreachableError   no MQTT broker answers at the configured address
    └── ResultsTimeoutError          fewer results than asked for arrived in time (a TimeoutError)
"""

from __future__ import annotations

from shoal.errors import BrokerError, ConfigError, ShoalError


class NoSuchPipelineError(ConfigError):
    """No combiner heartbeat, confirmation or result on the broker names this pipeline.

    Attributes:
        pipeline: the name asked for.
        known: pipelines that were seen on the broker.
    """

    def __init__(self, pipeline: str, known: list[str], where: str, waited_s: float) -> None:
        self.pipeline = pipeline
        self.known = known
        seen = ", ".join(known) if known else "none"
        super().__init__(
            f"no pipeline named {pipeline!r} on {where}: no combiner heartbeat, confirmation "
            f"or result named it within {waited_s:g} s. Pipelines seen: {seen}. Check the "
            "name, the topic root, and that the pipeline's combiners are running."
        )


class BrokerUnreachableError(BrokerError):
    """No MQTT broker answered at the configured address (or it refused the login)."""


class ResultsTimeoutError(ShoalError, TimeoutError):
    """Fewer window results than asked for arrived within the timeout.

    Attributes:
        pipeline: the pipeline.
        wanted: how many windows were asked for.
        got: how many arrived.
    """

    def __init__(self, message: str, *, pipeline: str, wanted: int, got: int) -> None:
        self.pipeline = pipeline
        self.wanted = wanted
        self.got = got
        super().__init__(message)
