"""Kernel fixtures: the native CPU ops' OpenMP loops run on two threads, as before the suite's
default went to one (tests/conftest.py), so their parallel paths stay tested."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def two_threads():
    """torch's intra-op thread count (which the native ops ask for) at 2 for the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
