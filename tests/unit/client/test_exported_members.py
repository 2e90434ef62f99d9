"""The data-science surface is deliberate: adding or removing a name is a visible change."""

import shoal.archive
import shoal.client


def test_client_exports_are_pinned() -> None:
    assert sorted(shoal.client.__all__) == sorted(
        [
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
    )


def test_archive_exports_are_pinned() -> None:
    assert sorted(shoal.archive.__all__) == sorted(
        [
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
    )


def test_every_export_exists_and_errors_join_the_tree() -> None:
    for module in (shoal.client, shoal.archive):
        for name in module.__all__:
            assert hasattr(module, name), name
    assert issubclass(shoal.client.NoSuchPipelineError, shoal.ConfigError)
    assert issubclass(shoal.client.BrokerUnreachableError, shoal.BrokerError)
    assert issubclass(shoal.client.ResultsTimeoutError, shoal.ShoalError)
    assert issubclass(shoal.client.ResultsTimeoutError, TimeoutError)
