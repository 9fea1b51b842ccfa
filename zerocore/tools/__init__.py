"""Tools above the engine: ``selftest`` (``python -m zerocore.selftest``: checks an installation
rather than trains), ``job`` (``python -m zerocore.tools.job``: a small job on N ranks of this
machine, against the unsharded model or on two devices; bench/gpu_check.sh runs it), and
``rank_processes`` (a machine's rank processes tied to the process that starts them, for
launchers: neox.finetune's, the examples')."""
