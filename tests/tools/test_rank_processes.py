"""zerocore.tools.rank_processes: a rank's ``stop_heard``, asked by a rank that found another
gone, tells a stop of the launcher's (the other rank left for it, and this one's comes a moment
later: leave silently) from a failure (no stop comes: say so)."""

import signal
import subprocess
import time

from zerocore.tools.rank_processes import LEFT, send, start_rank

# The rank: ties itself to the test (the launcher), then, as if it had just found its peer
# gone, asks stop_heard with the task's wait: leaves silently if a stop came, else speaks.
_RANK = """\
import os, socket, sys, time
from zerocore.tools.rank_processes import LEFT, receive, watch_launcher

def main(rank, fd, launcher):
    link = socket.socket(fileno=fd)
    wait = receive(link)
    stop_heard = watch_launcher(rank, link, launcher)
    began = time.monotonic()
    if stop_heard(wait):
        os._exit(LEFT)  # as neox's ranks do: the launcher says why, once
    print(f"no stop heard after {time.monotonic() - began:.3f}", flush=True)
    os._exit(3)
"""


def _start(tmp_path, monkeypatch, wait_s: float) -> tuple[subprocess.Popen, object]:
    (tmp_path / "stop_heard_rank.py").write_text(_RANK)
    monkeypatch.syspath_prepend(str(tmp_path))
    proc, link = start_rank(0, "stop_heard_rank:main", "zerocore-test-rank")
    send(link, wait_s)
    assert link.recv(3) == b"up\n"  # its watcher runs: a stop is heard from now on
    return proc, link


def test_a_stop_that_comes_within_the_wait_ends_the_rank_silently(tmp_path, monkeypatch,
                                                                   capfd):
    proc, link = _start(tmp_path, monkeypatch, wait_s=30.0)
    try:
        time.sleep(0.2)  # the rank waits in stop_heard; its stop comes later, as in the race
        link.send(f"stop {signal.SIGINT.name}\n".encode())
        assert proc.wait(timeout=30) == LEFT
    finally:
        proc.kill()
        link.close()
    assert "no stop heard" not in capfd.readouterr().out  # it left without a word


def test_no_stop_within_the_wait_lets_the_rank_say_what_it_found(tmp_path, monkeypatch,
                                                                 capfd):
    proc, link = _start(tmp_path, monkeypatch, wait_s=0.3)
    try:
        assert proc.wait(timeout=30) == 3
    finally:
        proc.kill()
        link.close()
    out = capfd.readouterr().out
    assert "no stop heard" in out, out
    # It waited out the wait before speaking (a behaviour, not a speed: 0.25 of the 0.3 s
    # leaves room for the print's rounding).
    assert float(out.split(" after ")[1]) >= 0.25, out


def test_a_rank_whose_launcher_is_gone_ends_at_once(tmp_path, monkeypatch, capfd):
    proc, link = _start(tmp_path, monkeypatch, wait_s=30.0)
    link.close()  # the launcher ended: the rank leaves, saying so
    try:
        assert proc.wait(timeout=30) == LEFT
    finally:
        proc.kill()
    captured = capfd.readouterr()
    assert "no stop heard" not in captured.out
    assert "the launcher ended" in captured.err, captured.err



def test_a_rank_killed_by_a_signal_is_named_before_one_that_exited_after_it(caplog):
    # Rank 1 is SIGKILLed; rank 0, losing contact with it, exits with 3 at once. Both have ended
    # by the launcher's next poll: the killed rank is the cause and is the one named (naming
    # rank 0, the lower, flaked once in CI: test_examples' killed trainer process). Here both
    # end before the first poll, which must still report the failure (it returned 0).
    from zerocore.tools.rank_processes import wait_for_ranks
    exited = subprocess.Popen(["sh", "-c", "exit 3"])
    killed = subprocess.Popen(["sleep", "30"])
    killed.kill()
    exited.wait()
    killed.wait()
    with caplog.at_level("WARNING"):
        code = wait_for_ranks([exited, killed], [], [])
    assert code == 128 + signal.SIGKILL
    assert f"rank 1 (pid {killed.pid}) was killed by SIGKILL" in caplog.text, caplog.text
