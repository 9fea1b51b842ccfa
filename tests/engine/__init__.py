"""zerocore.shard and its engine: parity with unsharded training, offload, overlap, recomputation,
units kept gathered, int8 frozen weights, planning, loss scaling, devices, failures."""
