"""Issue 42, item 3: a recipe field's walk from neox's flags to ``zerocore.shard`` makes at most
three returns (it made eight through LoopConfig, its helpers and build's translations).

The walk of ``--offload params``, counted structurally: every return of a neox function that
hands on the field's value, or something holding it (the recipe part, the recipe, the run
request, the engine policy made from it), is recorded by a profile hook while the command turns
its parsed flags into the run's request and the part gives its policy; and build's one
``zerocore.shard`` call is read from its source, taking that policy as it is.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import zerocore
from neox.commands.finetune import build_parser, run_request
from neox.commands.flags import explicit_flags
from neox.run import build
from neox.run.launch import RunRequest
from neox.run.recipe import OffloadConfig, Recipe

NEOX = str(Path(build.__file__).resolve().parents[1])


def _carries(value) -> bool:
    """Whether a return value hands on --offload's value: the word, or what holds it."""
    if isinstance(value, dict):
        return any(isinstance(v, zerocore.Offload) for v in value.values())
    return (isinstance(value, (OffloadConfig, Recipe, RunRequest, zerocore.Offload))
            or (isinstance(value, str) and value == "params"))


def test_offload_reaches_zerocore_shard_in_three_returns(tmp_path):
    argv = ["--offload", "params", "--nproc", "1", "--output-dir", str(tmp_path / "out")]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.explicit = explicit_flags(parser, argv)
    returns: list[str] = []

    def profile(frame, event, arg):
        if (event == "return" and frame.f_code.co_filename.startswith(NEOX)
                and _carries(arg)):
            returns.append(frame.f_code.co_qualname)
    sys.setprofile(profile)
    try:
        request = run_request(args, False, lambda *a, **k: None, torchrun=False, nodes=1)
        policies = request.recipe.offload.policies()
    finally:
        sys.setprofile(None)
    assert returns == ["recipe_from_flags", "run_request", "OffloadConfig.policies"], returns
    assert policies == {"offload": zerocore.Offload(params=True)}
    # build hands the part's policies to zerocore.shard as they are: one call, no translation.
    calls = [node for node in ast.walk(ast.parse(inspect.getsource(build.build)))
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "zerocore.shard"]
    assert len(calls) == 1
    spread = [ast.unparse(k.value) for k in calls[0].keywords if k.arg is None]
    assert "recipe.offload.policies()" in spread, spread
