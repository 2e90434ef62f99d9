"""``shoal bench pipeline --window``: the variant spec keeps everything but its windows."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal._resources import resource_dir
from shoal.errors import ConfigError
from shoal.loadtest.bench_windows import WINDOW_PRESETS, write_variant
from shoal.processors.spec import load_pipeline


@pytest.mark.parametrize("kind", sorted(WINDOW_PRESETS))
def test_variant_has_one_window_of_the_kind_and_the_rest_unchanged(
    kind: str, tmp_path: Path
) -> None:
    source = resource_dir("processors") / "baseline-equivalent.toml"
    original = load_pipeline(source)

    variant = load_pipeline(write_variant(source, kind, tmp_path))

    assert [w.kind for w in variant.windows] == [kind]
    assert variant.windows[0].name == WINDOW_PRESETS[kind]["name"]
    assert variant.name == original.name
    assert variant.key == original.key
    assert variant.aggregate_names == original.aggregate_names
    assert variant.lateness_ms == original.lateness_ms
    assert variant.limits == original.limits


def test_unknown_kind_names_the_presets(tmp_path: Path) -> None:
    source = resource_dir("processors") / "default.toml"

    with pytest.raises(ConfigError, match=r"known: .*tumbling") as caught:
        write_variant(source, "spiral", tmp_path)

    assert caught.value.field == "window"
