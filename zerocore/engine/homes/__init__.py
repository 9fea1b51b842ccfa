"""Where a flat group's shard lives: one home per concept (home.py: the interface, and
``Homes``, what one sharding's homes share; device.py, host_mirror.py, host_window.py, nvme.py,
replicated.py: the homes; choice.py: the choice, once per sharding)."""

from zerocore.engine.homes.choice import choose
from zerocore.engine.homes.home import GatherTarget, Home, Homes

__all__ = ["GatherTarget", "Home", "Homes", "choose"]
