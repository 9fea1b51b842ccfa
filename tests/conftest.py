"""Shared pytest fixtures and the test tiers.

``device``: every test that takes it runs once on "cpu" and once on "cuda". The CUDA case is
skipped, with the reason shown by ``pytest -ra``, when no GPU is visible; when a GPU is visible it
always runs, so a CUDA build that is broken or missing fails loudly instead of being skipped.

``worlds`` and ``world``: gloo ranks for the multi-process tests (tests/support/dist_utils.py).
``world`` is the one fixture of that name: a module takes it and says which world sizes it runs
at with a module-level ``WORLD_SIZES`` list (default ``DEFAULT_WORLD_SIZES``; 3 makes the padding
uneven); each test taking it then runs once per size, ids ``ws1``, ``ws2``, ...

Tiers (markers registered in pyproject.toml): a test that takes ``world`` or ``worlds`` is marked
``distributed`` here; tests that start rank processes otherwise carry the mark themselves, and
end-to-end runs of commands in subprocesses carry ``e2e``. The fast tier is
``-m "not distributed and not e2e"``; .ci/run runs the three tiers in turn.
"""

from __future__ import annotations

import pytest
import torch

import zerocore
from tests.support.dist_utils import stop_forkserver, worlds_by_size

NO_GPU_REASON = "no CUDA device visible (torch.cuda.is_available() is False)"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU_REASON)),
]

# The world sizes of a module that takes ``world`` without naming its own ``WORLD_SIZES``.
DEFAULT_WORLD_SIZES = [1, 2, 3]
# Fixtures that start gloo rank processes: a test taking one is in the distributed tier.
RANK_FIXTURES = {"worlds", "world"}


def pytest_generate_tests(metafunc) -> None:
    # ``world`` is parametrized indirectly, at module scope, so that each size's ranks serve the
    # whole module before the next size's (pytest groups a module-scoped parameter's tests).
    if "world" in metafunc.fixturenames:
        sizes = getattr(metafunc.module, "WORLD_SIZES", DEFAULT_WORLD_SIZES)
        metafunc.parametrize("world", sizes, indirect=True, scope="module",
                             ids=lambda n: f"ws{n}")


# The modules whose tests take minutes, longest first (the sums of their tests' durations in
# CI's e2e tier, 2026-12-06, loaded: the neox fault runs 645 s, the README's built-in run and
# the commands after it 491 s, the offload plans 297 s, the GPU check's dry run 281 s, the
# examples 267 s, the finetune CLI 203 s, HSDP under torchrun 163 s, DeepSpeed's outputs 156 s,
# the identity attacks 127 s). They come first in the collection, so that CI's xdist workers
# (``--no-loadscope-reorder``: files in this order) start them first instead of ending the tier
# with one of them running alone.
LONGEST_FIRST = ["tests/neox/test_neox_faults.py", "tests/tools/test_readme_commands.py",
                 "tests/neox/test_neox_plan_offload.py", "tests/tools/test_job.py",
                 "tests/tools/test_examples.py", "tests/neox/test_neox_finetune.py",
                 "tests/neox/test_neox_hybrid.py", "tests/neox/test_neox_from_deepspeed.py",
                 "tests/neox/test_neox_identity.py"]


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if RANK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.distributed)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_sessionfinish(session) -> None:
    stop_forkserver()  # the ranks' CPU time is counted (tests/support/dist_utils.py)


def pytest_addoption(parser) -> None:
    parser.addoption("--count-tier", action="append", default=[], metavar="EXPR",
                     help="print how many of the collected tests the -m expression EXPR selects "
                          "(a line 'tier count: N: EXPR'), then the files that hold them (a line "
                          "'tier files: FILE ...'); repeatable: with --collect-only, .ci/run "
                          "checks in one collection that its tiers are the whole suite, and runs "
                          "each tier on its files only")


def pytest_collection_finish(session) -> None:
    # pytest's own -m matching (the expression language it evaluates against each test's
    # markers), so that the counts are those of the tiers' runs.
    from _pytest.mark.expression import Expression
    for expr in session.config.getoption("count_tier"):
        compiled = Expression.compile(expr)
        files = {}  # dict: the files in collection order
        for item in session.items:
            names = {mark.name for mark in item.iter_markers()}
            if compiled.evaluate(lambda name, /, **_: name in names):
                path = item.nodeid.split("::", 1)[0]
                files[path] = files.get(path, 0) + 1
        print(f"\ntier count: {sum(files.values())}: {expr}")
        print(f"tier files: {' '.join(files)}")


@pytest.fixture(scope="session")
def worlds():
    """``worlds(n)``: an n-rank gloo World (tests/support/dist_utils.py), started on first use
    and shared by every test module of the session. Starting ranks is the largest fixed cost of
    the multi-process tests (each rank imports torch and zerocore); a module that needs a fresh
    set after a failure gets one from the World itself."""
    with worlds_by_size() as get:
        yield get


@pytest.fixture(scope="module")
def world(request, worlds):
    """The ``request.param``-rank World: parametrized by ``pytest_generate_tests`` above over
    the module's ``WORLD_SIZES``."""
    return worlds(request.param)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """"cpu", then "cuda" when a GPU is present."""
    if request.param == "cuda" and not zerocore.BUILD.has_cuda:
        pytest.fail(f"a GPU is present but {zerocore.BUILD}; rebuild with a CUDA toolkit and a "
                    f"CUDA build of torch, or hide the GPU with CUDA_VISIBLE_DEVICES=")
    return request.param
