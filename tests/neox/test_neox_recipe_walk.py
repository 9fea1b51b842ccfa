"""Issue 42, item 3: a recipe field's walk from neox's flags to ``zerocore.shard`` makes at most
three returns (it made eight through LoopConfig, its helpers and build's translations).

The walks of ``--offload params`` and ``--keep-gathered all``, counted structurally: every
return of a neox function that hands on the field's value, or something holding it (the recipe
part, the recipe, the run request, the engine policy made from it), is recorded by a profile
hook while the command turns its parsed flags into the run's request and the part gives its
policies; and build's one ``zerocore.shard`` call is read from its source, taking those policies
as they are.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest
import torch

import zerocore
from neox.commands.finetune import build_parser, run_request
from neox.commands.flags import explicit_flags
from neox.config import PRESETS
from neox.model import layer_specs
from neox.run import build
from neox.run.launch import RunRequest
from neox.run.recipe import Recipe

NEOX = str(Path(build.__file__).resolve().parents[1])


# flag -> (its text, the part holding it (the recipe's attribute), the part's policies() as a
# function of the part, the engine policy it becomes)
WALKS = {
    "--offload": ("params", "offload", lambda part: part.policies(), zerocore.Offload),
    "--keep-gathered": ("all", "sharding",
                        lambda part: part.policies(dtype=torch.float32,
                                                   specs=layer_specs(PRESETS["tiny"])),
                        zerocore.Prefetch),
}


def _carries(value, text: str, part: type, policy: type) -> bool:
    """Whether a return value hands on the flag's value: the value, or what holds it."""
    if isinstance(value, dict):
        return any(isinstance(v, policy) for v in value.values())
    return (isinstance(value, (part, Recipe, RunRequest, policy))
            or (isinstance(value, str) and value == text))


@pytest.mark.parametrize("flag", sorted(WALKS))
def test_a_flag_reaches_zerocore_shard_in_three_returns(tmp_path, flag):
    text, attr, policies_of, policy = WALKS[flag]
    part = type(getattr(Recipe(), attr))
    argv = [flag, text, "--nproc", "1", "--output-dir", str(tmp_path / "out")]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.explicit = explicit_flags(parser, argv)
    returns: list[str] = []

    def profile(frame, event, arg):
        if (event == "return" and frame.f_code.co_filename.startswith(NEOX)
                and _carries(arg, text, part, policy)):
            returns.append(frame.f_code.co_qualname)
    sys.setprofile(profile)
    try:
        request = run_request(args, False, lambda *a, **k: None, torchrun=False, nodes=1)
        policies = policies_of(getattr(request.recipe, attr))
    finally:
        sys.setprofile(None)
    assert returns == ["recipe_from_flags", "run_request", f"{part.__name__}.policies"], returns
    assert sum(isinstance(v, policy) for v in policies.values()) == 1
    # build hands the part's policies to zerocore.shard as they are: one call, no translation
    # (spread there, or through a name bound to them once).
    tree = ast.parse(inspect.getsource(build.build))
    bound = {node.targets[0].id: ast.unparse(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
    calls = [node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "zerocore.shard"]
    assert len(calls) == 1
    spread = [ast.unparse(k.value) for k in calls[0].keywords if k.arg is None]
    assert any(bound.get(s, s).startswith(f"recipe.{attr}.policies(") for s in spread), spread
