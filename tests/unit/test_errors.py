"""Every error shoal raises on purpose is one of ``shoal.errors``, and the tree is as drawn."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import errors
from shoal.clock import FakeClock
from shoal.gateway._sealer import NotStoredError
from shoal.schemas import DictColumn, Measurements, Topics
from shoal.schemas.topics import check_segment


def test_every_error_joins_the_tree_and_is_drawn_in_its_docstring() -> None:
    doc = errors.__doc__ or ""
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ShoalError), name
        assert f" {name} " in doc or f"{name}\n" in doc, name
    assert issubclass(NotStoredError, errors.SpoolError)
    assert "NotStoredError" in doc


def test_refusals_are_typed() -> None:
    with pytest.raises(errors.UsageError, match="forward"):
        FakeClock().advance(-1)
    with pytest.raises(errors.TopicError, match="not a valid name") as bad_name:
        check_segment("a/b", "stream")
    assert isinstance(bad_name.value, errors.ConfigError)
    with pytest.raises(errors.TopicError, match="topic root"):
        Topics(root="$SYS")
    rows = DictColumn(("s",), np.zeros(2, dtype=np.uint32))
    with pytest.raises(errors.SchemaError, match="differ in length") as short:
        Measurements(rows, np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.float64))
    assert short.value.reason == "length_mismatch"
