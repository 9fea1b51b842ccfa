"""The ranks of one machine meet through a store their launcher holds
(zerocore/tools/rendezvous.py): the port is never free between being chosen and being listened
on. Every world of the test harness (tests/support/dist_utils.py) and every neox run without
torchrun joins one, so joining is exercised by the whole distributed suite; here, what holding
means."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest

from tests.support.neox_testing import cli_env
from zerocore.tools import RENDEZVOUS_HOST, hold_rendezvous


def _bind(port: int, reuse: bool = False) -> None:
    with socket.socket() as s:
        if reuse:  # (the store's own connection to itself may linger in TIME_WAIT)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((RENDEZVOUS_HOST, port))


def _listening_addresses(port: int) -> set[str]:
    """The local addresses listening on TCP ``port`` (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_a_held_port_stays_taken_until_the_store_is_let_go():
    store = hold_rendezvous()
    port = store.port
    assert port > 0
    with pytest.raises(OSError) as caught:
        _bind(port)  # what another run's rank 0, or a connection's ephemeral port, would try
    assert caught.value.errno == errno.EADDRINUSE
    store.set("key", "value")  # a working store, not only a bound socket
    assert store.get("key") == b"value"
    if sys.platform.startswith("linux"):
        # Only this machine's loopback (127.0.0.1 as /proc writes it), not every interface.
        assert _listening_addresses(port) == {"0100007F"}
    del store
    _bind(port, reuse=True)  # let go: the port is free again


def test_a_port_in_use_is_refused_at_once():
    with socket.socket() as s:
        s.bind((RENDEZVOUS_HOST, 0))
        s.listen()
        with pytest.raises(OSError, match="cannot listen on"):
            hold_rendezvous(s.getsockname()[1], timeout_s=5)
    with pytest.raises(OSError, match="cannot listen on"):
        hold_rendezvous(70000, timeout_s=5)  # not a port


@pytest.mark.e2e
def test_finetune_on_a_port_in_use_says_so_and_touches_nothing(tmp_path):
    out = tmp_path / "out"
    with socket.socket() as s:
        s.bind((RENDEZVOUS_HOST, 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "neox.finetune", "--max-steps", "1",
                               "--port", str(port), "--output-dir", str(out)],
                              env=cli_env(), cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and f"rendezvous port {port}" in errors[0], proc.stderr
    assert "--port" in errors[0], errors
    assert not out.exists()  # refused before the output directory was taken

