"""Windowed aggregation, pure: specs, windows, aggregates, sketch, partials, combining.

Imports ``schemas`` but never ``broker``: nothing here does I/O. The worker and combiner
runtimes (``shoal.runtime``) feed it messages and publish what it returns.
"""

from shoal.processors.aggregates import AggregateSpec
from shoal.processors.combine import Combiner, CombinerCounters, LateRows, Step
from shoal.processors.partials import BatchInfo, KeyRouter, Partial, PartialBuilder
from shoal.processors.spec import PipelineSpec, load_pipeline, parse_pipeline
from shoal.processors.state import ClosedWindows
from shoal.processors.windows import WindowSpec

__all__ = [
    "AggregateSpec",
    "BatchInfo",
    "ClosedWindows",
    "Combiner",
    "CombinerCounters",
    "KeyRouter",
    "LateRows",
    "Partial",
    "PartialBuilder",
    "PipelineSpec",
    "Step",
    "WindowSpec",
    "load_pipeline",
    "parse_pipeline",
]
