"""Sharding a streamed checkpoint holds about one full layer at a time: when the engine asks for
the next layer, every full parameter tensor of the previous ones has been freed (only this rank's
shard of them is kept)."""

import gc
import weakref

import pytest

from dist_utils import World


def _stream_and_count(rank, world_size):
    import zerocore
    from neox.weights import RandomInit, iter_layers
    from neox.config import NeoXConfig

    config = NeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=256)
    refs: list[weakref.ref] = []
    alive_when_asked = []

    def layers():
        for layer in iter_layers(RandomInit(config, seed=0)):
            gc.collect()
            alive_when_asked.append(sum(r() is not None for r in refs))
            refs.extend(weakref.ref(p) for p in layer.parameters())
            yield layer
            del layer

    model = zerocore.shard(layers())
    gc.collect()
    alive_when_asked.append(sum(r() is not None for r in refs))
    return alive_when_asked, len(model.layers)


@pytest.mark.parametrize("world_size", [1, 2])
def test_streamed_layers_are_freed_one_by_one(world_size):
    world = World(world_size)
    try:
        results = world.run(_stream_and_count)
    finally:
        world.close()
    for alive, n_layers in results:
        assert n_layers == 7  # embed, 4 blocks, final norm, readout
        # Before each layer is built and after the last: no full parameter of an earlier layer.
        assert alive == [0] * 8, alive
