"""The run's model build says each layer as it is built (issue 33, item 9): its line comes as
soon as the layer is read, before the next one is, and nothing stalls the first layer (the
built-in run showed its seven lines together, after seconds of silence)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import zerocore
from neox.run.build import stream_layers
from neox.run.recipe import ModelRecipe
from neox.weights import RandomInit
from tests.support.neox_testing import REPO, cli_env
from tests.support.slim_weights import small_config


class RecordingInit(RandomInit):
    """Random weights that note each read in ``events``."""

    def __init__(self, config, events: list[str]):
        super().__init__(config)
        self.events = events

    def read(self, kind, index=None):
        self.events.append(f"read {kind} {index}")
        return super().read(kind, index)


def build_events(rank: int, world_size: int) -> list[str]:
    """In a rank: the engine consumes the build's layers; what was read and said, in order."""
    events: list[str] = []
    reader = RecordingInit(small_config(), events)

    def log(line: str) -> None:
        events.append(f"said {line.split(':')[0].strip()}")  # "said layer 1/6"
    model = zerocore.shard(stream_layers(reader, reader.config, ModelRecipe(), log=log))
    events.append(f"sharded {len(model.layers)} layers")
    return events


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_layer_is_said_as_it_is_built(worlds, world_size):
    for events in worlds(world_size).run(build_events):
        assert events == ["read embed None", "said layer 1/6",
                          "read block 0", "said layer 2/6",
                          "read block 1", "said layer 3/6",
                          "read block 2", "said layer 4/6",
                          "read final_norm None", "said layer 5/6",
                          "read readout None", "said layer 6/6",
                          "sharded 6 layers"]


def test_the_first_layer_is_not_held_up_by_torchs_compiler():
    """Building the embedding on the meta device (how every run builds its layers) does not
    import torch's compiler: nn.Embedding's own initialisation on the meta device did, on its
    first call (1.4-2.9 s here, 9 s on a busy machine), before the first layer's line."""
    code = ("import sys; from neox.model import build_layer; "
            "from tests.support.slim_weights import small_config; "
            "layer = build_layer('embed', small_config(), device='meta'); "
            "assert layer.embed_in.weight.is_meta and layer.embed_in.weight.requires_grad; "
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
