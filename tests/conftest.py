from __future__ import annotations

import os
import tempfile

import pytest
import torch

from kernels import dispatch

# without a GPU, Triton kernels are tested through Triton's interpreter on CPU tensors; triton.jit
# reads this when a kernel is defined, so it is set before any test imports one
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the weights-digest cache of this run's own, never the user's ~/.cache (subprocesses inherit it)
os.environ.setdefault("HCW_DIGEST_CACHE", os.path.join(tempfile.mkdtemp(prefix="hcw-digests-"), "weights.json"))

# two cores on the CI machines: more threads only adds contention
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(42)


@pytest.fixture(autouse=True)
def _kernels_auto(monkeypatch):
    """Every test starts on the default kernel choice; what a test (`dispatch.select`, or an engine
    it builds) selects is undone after it."""
    monkeypatch.setattr(dispatch, "_choice", dispatch.Choice())



@pytest.fixture
def native_required(monkeypatch, tmp_path_factory):
    """The native kernels required (a machine where one cannot be built fails the test instead of
    testing the torch path twice), built in the session's temporary folder, launcher outputs
    poisoned with NaN; `_kernels_auto` undoes the choice."""
    monkeypatch.setenv("HCW_NATIVE_CACHE", str(tmp_path_factory.getbasetemp() / "native"))
    monkeypatch.setattr(dispatch, "poison_empty", True)
    dispatch.select("auto", native="1")
