"""One recipe across nodes (neox/run/same_recipe.py): under torchrun every node parses its own
command line; the ranks agree every flag that changes the run before anything is read, built or
written, and refuse on every rank in one line naming each flag that differs with each node's
value.

- Which flags are agreed: every flag of neox.finetune is agreed, declared a node's own
  (``per_node``: a directory on each node's disk) or a launch flag; a new flag must take a side.
- The agreement on gloo ranks (distributed tier), for each flag the issue names: refused on
  every rank, naming only that flag; a per-node flag that differs is accepted; a recipe that
  differs although the flags agree (other files under the same path) is named too; unequal
  ranks per node are named as such.
- End to end (e2e): two torchrun agents on this machine (``--nnodes 2``, c10d rendezvous) started
  with other flags: every rank refuses with the same line, exit 2, nothing written, no rank
  left 2 s after the agents. A rank slower than the others to leave still says its line and
  exits 2 (torchrun's agent terminates a node's ranks once one has exited: the ranks leave
  together, neox.run.launch._leave_together); shown by hand with a rank made to sleep 1 s
  before its line, which without it ended by SIGTERM (-15) without a line. Each such run
  starts 4 processes importing torch (about a minute and a half on this machine), so the
  cases share runs: --lr, --hybrid and unequal --nproc-per-node each have a run of their own
  (their lines differ in form), and one more run starts the agents with every other flag the
  issue names (--seed, --seq-len, --batch-size, --clip, --max-steps, --data) different at
  once, whose one line must name each of them with each node's value; the agreement of each
  flag alone is the distributed test's.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import uuid

import pytest

import zerocore
from neox.commands.finetune import build_parser
from neox.run.launch import RunRequest
from neox.run.recipe import OptimConfig, Recipe, recipe_fields
from neox.run.same_recipe import RUN_FLAGS, agree_request, given_flags
from neox.setting import flag_name, setting_of
from tests.support.neox_testing import EXCERPT
from tests.support.processes import RUN_MARK, left_after
from tests.support.two_nodes import run_two_nodes

WORLD_SIZES = [2, 3]

# The launch's own flags: how this node starts its processes, which changes no result.
LAUNCH_FLAGS = {"--nproc", "--oversubscribe", "--port", "--timeout", "--cpu", "--nodes", "--help"}
ADVICE = "start every torchrun agent with the same flags and the same --nproc-per-node"

# flag -> (its text on even ranks, on odd ranks; None: not given), and how the refusal shows each.
DIFFERING = {
    "--lr": (("0.001", "0.002"), ("0.001", "0.002")),
    "--seed": (("1", "2"), ("1", "2")),
    "--seq-len": (("32", "64"), ("32", "64")),
    "--batch-size": (("4", "8"), ("4", "8")),
    "--clip": (("1", "0.5"), ("1.0", "0.5")),
    "--hybrid": (("hsdp", None), ("hsdp", "none")),
    "--max-steps": (("2", "3"), ("2", "3")),
    "--data": ((str(EXCERPT), None), (str(EXCERPT.resolve()), "(not given)")),
}


def parsed(*argv: str) -> dict:
    return vars(build_parser().parse_args(list(argv)))


def test_every_flag_is_agreed_or_declared_a_nodes_own():
    agreed = set(given_flags(parsed()))
    per_node = {flag_name(f) for _, f in recipe_fields()
                if setting_of(f).flag is not None and setting_of(f).per_node}
    every = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert per_node == {"--data-dir", "--cache-dir", "--offload-path"}
    assert set(DIFFERING) <= agreed
    assert {"--" + f.replace("_", "-") for f in RUN_FLAGS} <= agreed
    # A new flag is agreed by default (it is a recipe field's); otherwise it takes a side here.
    assert every == agreed | per_node | LAUNCH_FLAGS, every ^ (agreed | per_node | LAUNCH_FLAGS)
    assert not agreed & (per_node | LAUNCH_FLAGS)


def _default_request() -> RunRequest:
    return RunRequest(Recipe())


def agree_or_refuse(rank: int, world_size: int, argv: list[str], prepare=_default_request,
                    node: int | None = None, ranks_per_node: int = 1) -> str | None:
    """This rank's flags (``argv``) agreed with the others'; the refusal, or None."""
    try:
        agree_request(given_flags(parsed(*argv)), prepare,
                      node=rank if node is None else node, ranks_per_node=ranks_per_node)
    except zerocore.ValuesDiffer as e:
        return str(e)
    return None


def differing_flag(rank: int, world_size: int, flag: str) -> str | None:
    value = DIFFERING[flag][0][rank % 2]
    return agree_or_refuse(rank, world_size, [] if value is None else [flag, value])


@pytest.mark.parametrize("flag", sorted(DIFFERING))
def test_a_flag_that_differs_is_refused_on_every_rank_naming_it(world, flag):
    shown = DIFFERING[flag][1]
    nodes = "; ".join(f"node {r} (rank {r}): {shown[r % 2]}" for r in range(world.world_size))
    line = f"neox.finetune: {flag} differs across ranks: {nodes}; {ADVICE}"
    assert world.run(differing_flag, flag) == [line] * world.world_size


def per_node_paths(rank: int, world_size: int, tmp: str) -> str | None:
    return agree_or_refuse(rank, world_size, ["--cache-dir", f"{tmp}/cache-{rank}",
                                              "--data-dir", f"{tmp}/data-{rank}"])


def test_a_flag_of_each_nodes_own_may_differ(world, tmp_path):
    assert world.run(per_node_paths, str(tmp_path)) == [None] * world.world_size


def _request_with_lr(rank: int) -> RunRequest:
    return RunRequest(Recipe(optim=OptimConfig(lr=0.001 * (1 + rank % 2))))


def other_files(rank: int, world_size: int) -> str | None:
    # The same flags; what each rank's files gave differs (another checkpoint, same path).
    return agree_or_refuse(rank, world_size, [], prepare=lambda: _request_with_lr(rank))


def test_a_recipe_that_differs_although_the_flags_agree_is_named(world):
    lines = world.run(other_files)
    values = "; ".join(f"node {r} (rank {r}): {0.001 * (1 + r % 2)}"
                       for r in range(world.world_size))
    assert lines == [f"neox.finetune: --lr differs across ranks: {values}; the flags agree, so "
                     f"the files they name differ between nodes (--checkpoint, --resume, "
                     f"--tokenizer): give every node the same files"] * world.world_size


def unequal_nodes(rank: int, world_size: int) -> str | None:
    # Two nodes: ranks 0-1 on node 0, rank 2 alone on node 1.
    return agree_or_refuse(rank, world_size, [], node=rank // 2, ranks_per_node=2 - rank // 2)


def test_unequal_ranks_per_node_are_named_as_such(worlds):
    assert worlds(3).run(unequal_nodes) == [
        f"neox.finetune: ranks per node (torchrun --nproc-per-node) differs across ranks: node 0 "
        f"(ranks 0-1): 2; node 1 (rank 2): 1; {ADVICE}"] * 3


# -- end to end: two torchrun agents ----------------------------------------------------------

# Two agents each start their ranks, which import torch and neox: on 2 loaded cores, minutes.
TIMEOUT_S = 600
# After the agents exit, no rank of theirs may be left running (torchrun ends its workers).
LEFT_AFTER_S = 2.0


@dataclasses.dataclass(frozen=True)
class TwoNodes:
    extra: tuple[tuple[str, ...], tuple[str, ...]]   # each agent's own flags
    nproc: tuple[int, int]
    # The refusal's "X differs across ranks: ..." as a pattern over either numbering of the
    # nodes (the rendezvous numbers them in the order the agents arrive).
    differs: str


E2E = {
    "--lr": TwoNodes((("--lr", "0.001"), ("--lr", "0.002")), (2, 2),
                     r"--lr differs across ranks: node 0 \(ranks 0-1\): (0\.001|0\.002); node 1 "
                     r"\(ranks 2-3\): (0\.001|0\.002)"),
    "--hybrid": TwoNodes((("--hybrid", "hsdp"), ()), (2, 2),
                         r"--hybrid differs across ranks: node 0 \(ranks 0-1\): (hsdp|none); "
                         r"node 1 \(ranks 2-3\): (hsdp|none)"),
    "--nproc-per-node": TwoNodes(((), ()), (2, 1),
                                 r"ranks per node \(torchrun --nproc-per-node\) differs across "
                                 r"ranks: node 0 \((ranks 0-1|rank 0)\): (2|1); node 1 "
                                 r"\((rank 2|ranks 1-2)\): (1|2)"),
}


def _refusals(tmp_path, nproc: tuple[int, int], extra) -> list[str]:
    """Both agents run neox.finetune with ``extra`` (each agent's own flags); checks what every
    refusal shares (every rank exited 2 with one line, no rank left, nothing written) and
    returns each rank's line, by rank, without its "error (rank r): neox.finetune: "."""
    mark = f"same-recipe-{uuid.uuid4().hex}"
    out, cache = tmp_path / "out", tmp_path / "cache"
    agents = run_two_nodes(
        ["-m", "neox.finetune", "--cpu", "--data", EXCERPT, "--output-dir", out, "--cache-dir",
         cache, "--max-steps", 1, "--sample-tokens", 0],
        timeout=TIMEOUT_S, nproc=nproc, extra=extra, env={**os.environ, RUN_MARK: mark})
    assert left_after(mark, LEFT_AFTER_S) == []
    printed = agents.output
    assert agents.codes[0] != 0 and agents.codes[1] != 0, printed[-4000:]
    # Every rank exited 2 (torchrun's report of each failed worker), having said why in one line.
    assert set(re.findall(r"exitcode\s*: (-?\d+)", printed)) == {"2"}, printed[-4000:]
    refusals = [line for line in printed.splitlines() if line.startswith("error")]
    assert len(refusals) == sum(nproc), printed[-4000:]
    assert not out.exists() and not cache.exists()  # nothing read, built or written
    lines = []
    for rank in range(sum(nproc)):
        [line] = [r for r in refusals if r.startswith(f"error (rank {rank}): ")]
        head = f"error (rank {rank}): neox.finetune: "
        assert line.startswith(head) and line.endswith(f"; {ADVICE}"), line
        lines.append(line[len(head):-len(f"; {ADVICE}")])
    return lines


def _node_values(part: str) -> tuple[str, str]:
    """The two nodes' values in "X differs across ranks: node 0 (...): a; node 1 (...): b"."""
    values = re.fullmatch(r".*? differs across ranks: node 0 \(.*?\): (.+?); node 1 \(.*?\): "
                          r"(.+)", part)
    assert values is not None, part
    return values[1], values[2]


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(E2E))
def test_two_nodes_started_with_other_flags_refuse_on_every_rank(case, tmp_path):
    spec = E2E[case]
    for line in _refusals(tmp_path, spec.nproc, spec.extra):
        assert re.fullmatch(spec.differs, line), line
        first, second = _node_values(line)
        assert first != second, line


# Each agent's value of every other flag the issue names: one run refuses them all in one line.
OTHER_FLAGS = {"--seed": ("1", "2"), "--seq-len": ("32", "64"), "--batch-size": ("4", "8"),
               "--clip": ("1", "0.5"), "--max-steps": ("1", "2"), "--data": (None, "other")}


@pytest.mark.e2e
def test_two_nodes_started_with_every_other_flag_different_name_each(tmp_path):
    other = tmp_path / "other.txt"  # the same text under another path: --data differs
    shutil.copyfile(EXCERPT, other)
    extra = tuple(tuple(token for flag, values in OTHER_FLAGS.items() if values[i] is not None
                        for token in (flag, str(other) if flag == "--data" else values[i]))
                  for i in range(2))
    for line in _refusals(tmp_path, (2, 2), extra):
        parts = line.split(". ")
        assert sorted(p.split(" ")[0] for p in parts) == sorted(OTHER_FLAGS), line
        for part in parts:
            assert len(set(_node_values(part))) == 2, part  # each node's own value
