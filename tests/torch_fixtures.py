"""Torch fixtures shared by the training tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """One torch thread: on a busy machine an oversubscribed OpenMP pool made codec tests ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
