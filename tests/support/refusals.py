"""What every rank of a divergence test must have got: the lockstep's refusal
(comm/lockstep.py), never a timeout's advice."""

from __future__ import annotations

# The start of the lockstep's advice, in every refusal of diverged ranks.
ADVICE = "every rank must run the same forwards and backwards"


def assert_refused(got: list[str], *words: str) -> None:
    """``got``: what each rank raised, as "Type: message"; each names every one of ``words``."""
    for rank, outcome in enumerate(got):
        assert outcome.startswith("Diverged: zerocore: the ranks diverged"), (rank, outcome)
        assert ADVICE in outcome, (rank, outcome)
        assert "raise the timeout" not in outcome, (rank, outcome)
        for word in words:
            assert word in outcome, (rank, word, outcome)
