"""The shipped tables are exactly what build_data derives from the shared data, and stay small."""
from __future__ import annotations

from pathlib import Path

import pytest

from orbit_dagster.catalog import CatalogError, shipped_file
from orbit_dagster.catalog.build_data import build_all, main

ATTRIBUTION = Path(shipped_file("epoch_gpu_specs.csv")).parent / "ATTRIBUTION.md"


def test_shipped_files_are_rebuilt_byte_for_byte(shared_data, tmp_path):
    files = build_all(shared_data)
    for name, data in files.items():
        assert shipped_file(name).read_bytes() == data, f"{name} is stale: rerun build_data"
    assert main([str(shared_data), "--out", str(tmp_path)]) == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_shipped_tables_are_small_and_attributed(shared_data):
    names = list(build_all(shared_data))
    assert sum(shipped_file(n).stat().st_size for n in names) < 1_000_000
    text = ATTRIBUTION.read_text(encoding="utf-8")
    for name in names:
        assert name in text
    for licence in ("Apache-2.0", "CC-BY"):
        assert licence in text


def test_the_non_redistributable_history_is_not_shipped():
    data_dir = ATTRIBUTION.parent
    assert not list(data_dir.glob("*spot_price_history*"))


def test_missing_shared_data_is_a_clear_error(tmp_path):
    with pytest.raises(CatalogError) as e:
        build_all(tmp_path)
    assert e.value.field == "SHARED_DATA_DIR"
