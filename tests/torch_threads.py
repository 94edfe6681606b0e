"""One torch thread for a folder's tests (its conftest imports the fixture): the models are
tiny and gain nothing from threads (on a shared machine a second thread mostly spin-waits),
and a resumed run must match the uninterrupted one bit for bit, which holds for equal thread
counts."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
