"""Shared pytest fixtures.

``device``: every test that takes it runs once on "cpu" and once on "cuda". The CUDA case is
skipped, with the reason shown by ``pytest -ra``, when no GPU is visible; when a GPU is visible it
always runs, so a CUDA build that is broken or missing fails loudly instead of being skipped.
"""

from __future__ import annotations

import pytest
import torch

import zerocore
from tests.support.dist_utils import worlds_by_size

NO_GPU_REASON = "no CUDA device visible (torch.cuda.is_available() is False)"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU_REASON)),
]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "shared_data: needs ../shared/data (the full corpus, the "
                                       "GPT-NeoX tokenizer); skipped when it is absent")


@pytest.fixture(scope="session")
def worlds():
    """``worlds(n)``: an n-rank gloo World (dist_utils), started on first use and shared by every
    test module of the session. Starting ranks is the largest fixed cost of the multi-process
    tests (each rank imports torch and zerocore); a module that needs a fresh set after a
    failure gets one from the World itself."""
    with worlds_by_size() as get:
        yield get


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """"cpu", then "cuda" when a GPU is present."""
    if request.param == "cuda" and not zerocore.BUILD.has_cuda:
        pytest.fail(f"a GPU is present but {zerocore.BUILD}; rebuild with a CUDA toolkit and a "
                    f"CUDA build of torch, or hide the GPU with CUDA_VISIBLE_DEVICES=")
    return request.param
