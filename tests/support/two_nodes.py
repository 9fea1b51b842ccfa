"""Two nodes on this machine: two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d
rendezvous on 127.0.0.1 at a free port), each starting its node's ranks, the way a job starts
on two machines. What each agent printed comes back, with its exit code.

The rendezvous's store is held by this process on a port the system picked
(``zerocore.tools.hold_rendezvous``), kept with the agents: a port learnt free and handed to the
agents could be taken before the first of them bound it. Each agent, finding the endpoint's port
taken, joins the store there as a client (torch's c10d rendezvous backend does so when it cannot
host it), as the agents of a real job's other nodes do."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from zerocore.tools import hold_rendezvous

REPO = Path(__file__).resolve().parents[2]
# Variables of an enclosing launcher that would confuse the agents' own.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Agents:
    codes: list[int]
    outputs: list[str]     # each agent's stdout and stderr together (its ranks' too)

    @property
    def output(self) -> str:
        return "\n".join(self.outputs)


def torchrun_command(port: int, program: Sequence[str], *, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` of one agent of two; ``program``: ``["-m", module,
    ...]`` or a script and its arguments. The rendezvous numbers the nodes."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}",
            *map(str, program)]


def start_two_nodes(program: Sequence[str], *, nproc: int | Sequence[int] = 2,
                    env: dict[str, str] | None = None,
                    extra: Sequence[Sequence[str]] = ((), ())) -> list[subprocess.Popen]:
    """Both agents started on ``program`` (the rendezvous numbers the nodes), the first with
    ``extra[0]`` after it, the second with ``extra[1]`` (two nodes started with other flags),
    ``nproc`` ranks each (or ``nproc[i]`` on agent i); each's stdout and stderr together in a
    pipe."""
    store = hold_rendezvous(timeout_s=300)
    port = store.port
    environ = {k: v for k, v in (env or os.environ).items() if k not in LAUNCHER_VARIABLES}
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), environ.get("PYTHONPATH")) if p)
    nprocs = [nproc, nproc] if isinstance(nproc, int) else list(nproc)
    agents = [subprocess.Popen(torchrun_command(port, [*program, *extra[i]], nproc=nprocs[i]),
                               cwd=REPO, env=environ, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for agent in agents:
        agent.rendezvous_store = store  # (held while either agent object lives)
    return agents


def run_two_nodes(program: Sequence[str], *, timeout: float, nproc: int | Sequence[int] = 2,
                  env: dict[str, str] | None = None,
                  extra: Sequence[Sequence[str]] = ((), ())) -> Agents:
    """Both agents run ``program`` (see ``start_two_nodes``); waits for both (killed past
    ``timeout`` seconds)."""
    agents = start_two_nodes(program, nproc=nproc, env=env, extra=extra)
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout)[0])
    finally:
        stop_agents(agents)
    return Agents([a.returncode for a in agents], outputs)


def stop_agents(agents: Sequence[subprocess.Popen], *, grace: float = 40.0) -> None:
    """Stops the agents still running. SIGTERM first: torchrun then stops its ranks (it starts
    each in a session of its own, so a SIGKILL to the agent alone would leave them running,
    hung in a collective, after the test); SIGKILL past ``grace`` seconds."""
    running = [a for a in agents if a.poll() is None]
    for agent in running:
        agent.terminate()
    for agent in running:
        try:
            agent.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
