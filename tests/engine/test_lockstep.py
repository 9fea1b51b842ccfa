"""The lockstep's identity (zerocore/comm/lockstep.py): one int64 per step, its fields laid out
as ``_FIELDS`` says; ``Identity.packed`` writes the layout out by hand for speed, so it is
checked here against the layout itself, on fresh random fields, counts past their width
included (they wrap: two ranks a multiple of 2**16 micro-batches apart would pass)."""

from __future__ import annotations

import random

from zerocore.comm.lockstep import _FIELDS, Identity


def _by_the_layout(identity: Identity) -> int:
    value, shift = 0, 0
    for name, bits in _FIELDS:
        value |= (getattr(identity, name) & ((1 << bits) - 1)) << shift
        shift += bits
    return value


def test_packed_is_the_layout_and_fits_a_signed_int64():
    rng = random.Random(0)
    assert sum(bits for _, bits in _FIELDS) == 63
    for _ in range(2000):
        identity = Identity(*(rng.randrange(0, 1 << (bits + 2)) for _, bits in _FIELDS))
        value = identity.packed()
        assert value == _by_the_layout(identity), identity
        assert 0 <= value < 2**63
        masked = Identity(*(v & ((1 << bits) - 1) for v, (_, bits) in zip(identity, _FIELDS)))
        assert Identity.unpacked(value) == masked


def test_fields_keep_their_places():
    # Each field alone at its largest: its bits only, where the layout puts them.
    shift = 0
    for i, (name, bits) in enumerate(_FIELDS):
        fields = [0] * len(_FIELDS)
        fields[i] = (1 << bits) - 1
        assert Identity(*fields).packed() == ((1 << bits) - 1) << shift, name
        shift += bits
