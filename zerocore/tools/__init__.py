"""Tools above the engine:
- ``selftest`` (``python -m zerocore.selftest``): checks an installation rather than trains;
- ``job`` (``python -m zerocore.tools.job``): a small job on N ranks of this machine, against
  the unsharded model or on two devices; bench/gpu_check.sh runs it;
- ``rank_processes``: a machine's rank processes tied to the process that starts them, for
  launchers (neox.finetune's, the examples');
- ``rendezvous``: the ranks meet through a store their launcher holds, on a port never left
  free between being chosen and being listened on;
- ``host_allocator``: a CPU rank's malloc keeps the memory its large tensors free, for the next
  step's.

This module is the public face of the launcher's part (docs/api.md): what a launcher and its
ranks call, named here; the modules beneath are implementation."""

from zerocore.tools.host_allocator import keep_freed_memory
from zerocore.tools.rendezvous import RENDEZVOUS_HOST, hold_rendezvous, join_rendezvous
from zerocore.tools.rank_processes import (LEFT, STOP_GRACE_S, STOP_HEARD_WAIT_S,
                                           exit_description, receive, run_ranks,
                                           set_parent_death_signal, watch_launcher)

__all__ = ["run_ranks", "receive", "watch_launcher", "exit_description",
           "set_parent_death_signal", "keep_freed_memory", "LEFT", "STOP_GRACE_S",
           "STOP_HEARD_WAIT_S", "hold_rendezvous", "join_rendezvous", "RENDEZVOUS_HOST"]
