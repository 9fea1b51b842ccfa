"""How ``zerocore.plan`` finds a step's memory: the layers and what a plan reports
(``memory_plan``), the simulated step's bookkeeping (``ledger``), and the step of each front door
on fake tensors (``stack`` for ``shard``, ``model`` for ``shard_model``)."""
