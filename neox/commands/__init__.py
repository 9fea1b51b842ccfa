"""The commands, thin over the library (``neox.run``): each parses its flags (the recipe's
are declared on the recipe's fields; ``flags`` makes them into arguments), checks what can be
checked before anything starts, and calls the run. ``python -m neox.<command>`` runs
``neox/<command>.py``, which only calls the ``main`` here:

- ``finetune``: flags -> recipe -> checks -> ``neox.run.launch``;
- ``evaluate``, ``generate``: a model loaded by ``neox.run.inference``;
- ``export``: a run's checkpoint as a Hugging Face directory (``neox.run.export``);
- ``plan``: memory and traffic of a run before renting GPUs (``neox.run.planning``);
- ``flags``: what they share (the parser, argparse types, the recipe's flags);
- ``entry``: how ``neox/<command>.py`` runs one (Ctrl-C before it runs: one line).

Only these modules import argparse; no library module imports them.
"""
