"""Results for data scientists: a pipeline's window results as polars (or pandas) DataFrames.

``ResultsClient`` (blocking; scripts and notebooks) and ``AsyncResultsClient`` (asyncio)
connect with the same ``BrokerSettings`` as every shoal component and offer:

* ``windows(pipeline)``: a live iterator, one frame per closed window, partitions assembled
  and re-published windows dropped (deduplicated on ``(pipeline, window, start, partition,
  revision)``);
* ``latest(pipeline, n)``: the latest ``n`` windows as one frame; window messages are not
  retained, so it waits for the next ``n`` to close, or takes them from a ``shoal archive``
  folder first (``archive=``);
* ``latest_per_key(pipeline)``: the broker's retained latest result of every key.

Errors: ``NoSuchPipelineError`` (nothing on the broker names the pipeline),
``BrokerUnreachableError``, ``ResultsTimeoutError``. Frames have the result layout described
in ``shoal.schemas.results``. Talks MQTT only through a ``shoal.broker.session.Session``.
"""

from shoal.client._async import DEFAULT_BROKER_URL, AsyncResultsClient
from shoal.client._sync import ResultsClient
from shoal.client.assemble import AssembledWindow, WindowAssembler
from shoal.client.errors import BrokerUnreachableError, NoSuchPipelineError, ResultsTimeoutError
from shoal.client.messages import parse_key_message, to_pandas
from shoal.schemas.results import (
    HEADER_SCHEMA,
    IDENTITY,
    Deduplicator,
    WindowMessage,
    empty_results,
    parse_window_message,
)

__all__ = [
    "DEFAULT_BROKER_URL",
    "HEADER_SCHEMA",
    "IDENTITY",
    "AssembledWindow",
    "AsyncResultsClient",
    "BrokerUnreachableError",
    "Deduplicator",
    "NoSuchPipelineError",
    "ResultsClient",
    "ResultsTimeoutError",
    "WindowAssembler",
    "WindowMessage",
    "empty_results",
    "parse_key_message",
    "parse_window_message",
    "to_pandas",
]
