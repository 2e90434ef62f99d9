"""The public surface is deliberate: adding or removing a name is a visible change."""

import shoal


def test_top_level_exports_are_pinned() -> None:
    assert sorted(shoal.__all__) == sorted(
        [
            "Batch",
            "BrokerError",
            "BrokerNotFoundError",
            "ConfigError",
            "DecodeError",
            "DecodeLimits",
            "Encoding",
            "Envelope",
            "InputError",
            "Measurements",
            "PayloadTooLargeError",
            "SchemaError",
            "ShoalError",
            "SpoolError",
            "Topics",
            "__version__",
            "decode_batch",
            "encode_batch",
        ]
    )


def test_every_export_exists() -> None:
    for name in shoal.__all__:
        assert hasattr(shoal, name), name
