"""The fine-tuning run, as a library (no argparse, no command), its concepts in the order a
run uses them:

- ``recipe``: what a run is (typed, versioned; each field declares its flag, ``neox.setting``);
  ``resume``: the recipe of a resumed run; ``planning``: its memory and traffic, planned;
- ``launch``: the processes of a run and their watcher; ``run_dir``: the output directory
  (lock, owner, metrics); ``training``: the whole run of one rank, which goes through
- ``run_data`` (the text, checked on resume), ``build`` (the sharded model, layer by layer;
  ``step``: a micro-batch's loss and the recomputation policy), ``restore`` (from a neox or a
  DeepSpeed checkpoint; ``from_deepspeed``: that checkpoint's names and settings), ``loop``
  (the optimizer steps; ``progress``: the bar and the log), ``save``, ``memory``
  (``--measure-memory``) and ``finish`` (reports, export, a sample); ``failed``: ``RunFailed``;
- afterwards, in one process: ``trained`` (a checkpoint as a model), ``export`` (as a Hugging
  Face directory), ``inference`` (loading a model), ``evaluation``, ``sampling``.
"""
