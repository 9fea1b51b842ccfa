"""Where a shard lives (zerocore/engine/homes/): the home each ``Offload`` gives trainable and
frozen groups, and the model state a plan counts for it. Training through every home is
tested bitwise against no offload by the offload tests (test_offload.py, test_param_offload.py,
test_nvme_offload.py); this is the table itself."""

import pytest
import torch

import zerocore
from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.homes import choose

# (optimizer, params) -> trainable home in 16 bit, in fp32, frozen home: homes/choice.py's table.
TABLE = {
    (False, False): ("OnDevice", "OnDevice", "OnDevice"),
    (False, "cpu"): ("RoundedWindow", "OnDevice", "HostWindow"),
    (False, "nvme"): ("RoundedWindow", "OnDevice", "NvmeWindow"),
    ("cpu", False): ("HostMirror", "HostMirror", "OnDevice"),
    ("cpu", "cpu"): ("HostWindow", "HostWindow", "HostWindow"),
    ("nvme", False): ("NvmeMirror", "NvmeMirror", "OnDevice"),
    ("nvme", "cpu"): ("NvmeHostWindow", "NvmeHostWindow", "HostWindow"),
    ("nvme", "nvme"): ("NvmeWindow", "NvmeWindow", "NvmeWindow"),
}


def _homes(optimizer, params, dtype):
    path = "." if "nvme" in (optimizer, params) else None
    offload = zerocore.Offload(optimizer=optimizer, params=params, path=path)
    return choose(offload, device=torch.device("cpu"), param_dtype=dtype, streams=None,
                  arena=None, store=None, host_threads=None)


@pytest.mark.parametrize("where", sorted(TABLE, key=str))
def test_each_offload_chooses_its_homes(where):
    sixteen, fp32, frozen = TABLE[where]
    assert _homes(*where, torch.bfloat16).trainable.__name__ == sixteen
    assert _homes(*where, torch.float32).trainable.__name__ == fp32
    assert _homes(*where, torch.bfloat16).frozen.__name__ == frozen


@pytest.mark.parametrize("where", sorted(TABLE, key=str))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_state_is_what_each_home_holds_in_memory(where, dtype):
    # What a plan counts per trainable element, written out from what each home keeps: a model
    # copy unless the window is rounded from a device master (or everything is on NVMe); an
    # fp32 master beside a 16-bit copy and Adam's moments unless they are on NVMe; a mirror
    # when the optimizer is off the device and the parameters are not.
    optimizer, params = where
    n, p = 1000, dtype.itemsize
    sixteen = p != 4
    homes = _homes(optimizer, params, dtype)
    planned = homes.trainable.planned(n, p)
    rounded = sixteen and not optimizer and params
    on_nvme = optimizer == "nvme"
    assert planned.params == (0 if rounded or (on_nvme and params == "nvme") else n * p)
    assert planned.masters == (n * 4 if sixteen and not on_nvme else 0)
    assert planned.optimizer == (0 if on_nvme else n * 8)
    assert planned.mirrors == (n * p if optimizer and not params else 0)
    assert homes.frozen.frozen_in_memory == (params != "nvme")


@pytest.mark.parametrize("optimizer", [False, "cpu"])
@pytest.mark.parametrize("params", [False, "cpu"])
def test_a_replicated_base_is_the_frozen_groups_home(optimizer, params):
    # FrozenWeights(placement="replicated"): frozen groups hold every rank's part, on the
    # device, or with the parameters offloaded in host memory, and gather nothing; the
    # trainable groups' home is Offload's, as without it.
    replicated = zerocore.FrozenWeights("nf4", placement="replicated")
    offload = zerocore.Offload(optimizer=optimizer, params=params)
    homes = choose(offload, device=torch.device("cpu"), param_dtype=torch.bfloat16,
                   streams=None, arena=None, store=None, host_threads=None,
                   frozen_weights=replicated)
    assert homes.frozen.__name__ == ("HostReplicated" if params else "Replicated")
    assert not homes.frozen.gathers
    assert homes.trainable is _homes(optimizer, params, torch.bfloat16).trainable
    layout = FlatLayout.build([("w", (1000,))], 3, block=64)
    assert homes.held_range(False, layout, 1) == (0, layout.padded_numel)
    assert homes.held_range(True, layout, 1) == layout.shard_range(1)
    assert _homes(optimizer, False, torch.bfloat16).held_range(False, layout, 1) == \
        layout.shard_range(1)
