"""The Parquet archive: record raw batches and results, read them back, replay them offline.

* ``Archiver`` / ``ArchiveConfig`` (``shoal archive``): subscribe to raw batches and/or window
  results and write hive-partitioned Parquet (``layout``), with bounded buffers and atomic file
  rollover (``rollover``, ``writer``);
* ``read_batches`` / ``read_results``: the archive as polars frames (results deduplicated);
* ``replay`` (``shoal replay``): a pipeline spec over archived batches, offline, through the
  same decoding and aggregation code, giving the results the live pipeline emitted;
* ``compare_results``: live vs replayed, counts exact and values within a tolerance.

Talks MQTT only through a ``shoal.broker.session.Session`` (in ``service``); everything else
is pure or file I/O.
"""

from shoal.archive.compare import Comparison, compare_results
from shoal.archive.layout import data_files, partition_dir
from shoal.archive.read import read_batches, read_results
from shoal.archive.records import BATCH_SCHEMA
from shoal.archive.replay import ReplayReport, ReplayResult, replay
from shoal.archive.rollover import RolloverPolicy
from shoal.archive.service import ArchiveConfig, Archiver, ArchiveReport
from shoal.archive.writer import ArchiveWriter, write_parquet_atomically

__all__ = [
    "BATCH_SCHEMA",
    "ArchiveConfig",
    "ArchiveReport",
    "ArchiveWriter",
    "Archiver",
    "Comparison",
    "ReplayReport",
    "ReplayResult",
    "RolloverPolicy",
    "compare_results",
    "data_files",
    "partition_dir",
    "read_batches",
    "read_results",
    "replay",
    "write_parquet_atomically",
]
