"""Shared test fixtures: the build cache shared by every test in a session, and the shared/ data folder."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory) -> Path:
    """One build cache for the whole session, so each distinct extension compiles once."""
    return tmp_path_factory.mktemp("build-cache")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present (a fresh clone has no shared/)")
    return SHARED_DATA
