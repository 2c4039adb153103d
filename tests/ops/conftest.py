"""Op tests: `gpu`-marked tests skip without CUDA (so `pytest -m gpu` runs just them on the device)."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and HERE in Path(item.fspath).parents:
            item.add_marker(skip)
