"""Helpers for the catalog tests: raw shared-data paths come through the `shared_data` fixture."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def prices_dir(shared_data: Path) -> Path:
    return shared_data / "prices"


@pytest.fixture
def hardware_dir(shared_data: Path) -> Path:
    return shared_data / "hardware"
