"""Tools that check an installation rather than train: ``selftest`` (``python -m
zerocore.selftest``)."""
