"""Test tiers by marker: ``gpu`` tests skip without CUDA; ``slow`` tests run with ``scripts/test.sh --all``."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
