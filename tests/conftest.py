from __future__ import annotations

import os

import pytest
import torch

# two cores on the CI machines: more threads only adds contention
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(42)
