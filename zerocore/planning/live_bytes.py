"""``LiveBytes``: the bytes of every storage that the tensors of a fake run keep alive, at every
operation, and the largest sum: what ``zerocore.plan`` reads off the engine's own step (as
``zerocore.PeakMemory`` reads a real step's off torch's allocator).

A storage lives while a Python tensor viewing it lives (tensors that C++ still holds keep their
Python object: torch preserves it) or while autograd keeps it for backward (the saved-tensor
hooks hold a detached alias and say when autograd lets go). The engine's gathered buffers are
storages resized in place, which no operation shows: the engine reports each resize
(``resized``, engine/rehearsal.py's ``StorageWatch``).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages created under it that are alive; ``on_peak(live)`` is
    called whenever the count passes its largest value since ``open_window``."""

    def __init__(self, on_peak: Callable[[int], None]):
        super().__init__()
        self._on_peak = on_peak
        self._holders: dict[int, int] = {}   # storage key -> live tensors and saved aliases
        self._nbytes: dict[int, int] = {}
        # Each tensor seen: id -> [its storage's key, a weak reference whose callback lets the
        # storage go]. Keyed by id, as a weakref's hash and equality are its tensor's
        # (elementwise, for a tensor); the reference itself must live for its callback to run.
        self._tensors: dict[int, list] = {}
        self._excluded: set[int] = set()     # storages never counted (the step's inputs)
        self.live = 0
        self.peak: int | None = None         # None: no window open yet

    def exclude(self, t: torch.Tensor) -> None:
        """Never counts ``t``'s storage (an input the caller holds anyway)."""
        self._excluded.add(t.untyped_storage()._cdata)

    def open_window(self) -> None:
        """The peak is taken from here on (what is alive now counts)."""
        self.peak = self.live
        self._on_peak(self.live)

    def close_window(self) -> int:
        """Ends the window: its peak (no more is taken until the next ``open_window``)."""
        peak, self.peak = self.peak, None
        return peak

    def _seen(self) -> None:
        if self.peak is not None and self.live > self.peak:
            self.peak = self.live
            self._on_peak(self.live)

    def _hold(self, t: torch.Tensor) -> int | None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._excluded:
            return None
        if key not in self._holders:
            self._holders[key] = 0
            self._nbytes[key] = storage.nbytes()
            self.live += self._nbytes[key]
        self._holders[key] += 1
        return key

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live -= self._nbytes.pop(key)

    def resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._nbytes:
            self.live += storage.nbytes() - self._nbytes[key]
            self._nbytes[key] = storage.nbytes()
            self._seen()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self._seen()
        return out

    def _track(self, t: torch.Tensor) -> None:
        """Holds ``t``'s storage while ``t`` lives: once per tensor, whatever number of
        in-place operations return it; again when one gave it another storage (``set_``), the
        old one let go (its address may then serve a new storage, which must not pass for it)."""
        key = t.untyped_storage()._cdata
        entry = self._tensors.get(id(t))
        if entry is not None:
            if entry[0] == key:
                return
            self._release(entry[0])
            held = self._hold(t)
            if held is None:
                del self._tensors[id(t)]
            else:
                entry[0] = held
            return
        held = self._hold(t)
        if held is None:
            return
        ident = id(t)

        def gone(ref: weakref.ref) -> None:
            dead = self._tensors.pop(ident, None)
            if dead is not None:
                self._release(dead[0])
        self._tensors[ident] = [held, weakref.ref(t, gone)]

    def saved_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        tracker = self

        class Saved:
            def __init__(self, t: torch.Tensor):
                # An alias without autograd history: holding the tensor itself would make a
                # cycle through its grad_fn and delay its release until a garbage collection.
                self.t = t.detach()
                self.key = tracker._hold(t)

            def __del__(self) -> None:
                if self.key is not None:
                    tracker._release(self.key)

        return torch.autograd.graph.saved_tensors_hooks(Saved, lambda s: s.t)
