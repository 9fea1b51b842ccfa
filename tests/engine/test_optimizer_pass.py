"""``OptimizerPass``'s waits (zerocore/engine/optimizer_pass.py): a unit's wait returns once the
worker marks the unit done, however long the worker takes, and an event that no pass can set
any more is raised with the pass's state instead of waited for ever (a hang seen under load,
not explained: docs/decisions.md, "Every gloo reduction sums in rank order")."""

from __future__ import annotations

import threading
import time

import torch

from zerocore.engine import optimizer_pass
from zerocore.engine.optimizer_pass import Job, OptimizerPass


def test_a_slow_unit_is_waited_for_past_the_stuck_checks():
    # The worker takes longer than two of the checks: the pass is in flight all along, so the
    # wait goes on until the unit is done.
    shard = torch.nn.Parameter(torch.zeros(3))
    slow = 2.5 * optimizer_pass._STUCK_CHECK_S

    def run(begins, done):
        time.sleep(slow)
        done(id(shard))
    running = OptimizerPass()
    running.start([Job([id(shard)], run)], {})
    began = time.monotonic()
    running.wait_unit(shard)
    assert time.monotonic() - began >= slow * 0.9
    running.finish()


def test_an_event_no_pass_can_set_is_raised_not_waited_for():
    shard = torch.nn.Parameter(torch.zeros(3))
    running = OptimizerPass()
    running._units = {id(shard): threading.Event()}   # the state seen: no pass in flight
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            running.wait_unit(shard)
        except RuntimeError as e:
            raised.append(e)
    # On a thread of its own, so that a wait for ever fails this test instead of hanging it.
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    # Two checks a second apart, then the error: well within 4 checks and 2 s of slack.
    waiter.join(timeout=4 * optimizer_pass._STUCK_CHECK_S + 2)
    assert not waiter.is_alive(), "the wait did not end"
    assert len(raised) == 1
    assert "never marked done: the pass is none, the event is in the pass's units" in str(
        raised[0])
