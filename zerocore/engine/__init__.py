"""The sharding engine: ``flat_layout`` (where each parameter sits in a flat buffer),
``flat_group`` (one flat buffer sharded across ranks: gather, free, reduce), ``sharded_param``,
``sharded_layer`` (a layer's trainable and frozen groups, its autograd Function, the backward
coordinator), ``offload``, ``recompute``, ``meta_layer``, ``report`` and ``peak_memory``, and the
two front doors: ``sharded_sequential`` (``zerocore.shard``) and ``sharded_model``
(``zerocore.shard_model``)."""
