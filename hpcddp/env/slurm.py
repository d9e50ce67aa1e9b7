"""Tasks started by srun that MPI does not connect (srun --mpi=none or pmi2 singletons)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Mapping

from .base import ClusterEnvironment, RankLayout, Rendezvous, read_int
from .launcher import expand_tasks_per_node, slurm_step_numbers
from .network import interface_towards, list_interfaces
from .settings import read_slurm_node_address

__all__ = ["SlurmEnvironment", "expand_nodelist", "expand_tasks_per_node", "node_address"]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``node[01-03,07],gpu5`` or ``r[1-2]n[3-4]`` into host names.

    Args:
        nodelist: the value of ``SLURM_JOB_NODELIST``.
    """
    hosts: list[str] = []
    # Split on commas that are not inside brackets.
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        hosts.extend(_expand_item(item))
    return hosts


def _expand_item(item: str) -> list[str]:
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    # The rest may hold more brackets (r[1-2]n[3-4]): expand it the same way.
    suffixes = _expand_item(rest)
    hosts = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        width = len(lo)
        for number in range(int(lo), int(hi or lo) + 1):
            hosts.extend(f"{prefix}{number:0{width}d}{suffix}" for suffix in suffixes)
    return hosts


#: the ports a task derives from its job and step ids when MASTER_PORT is unset
FIRST_DERIVED_PORT, NUM_DERIVED_PORTS = 15000, 15000
# A re-init's move: ~1,000 job ids away from a derived port, prime to NUM_DERIVED_PORTS
_DERIVED_PORT_STEP = 7001


class SlurmEnvironment(ClusterEnvironment):
    """Rank layout from SLURM_* variables, rendezvous through torch.distributed's TCP store."""

    name = "slurm"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        # Only a job step (srun) sets SLURM_STEP_NUM_TASKS; a batch script that runs
        # python directly is one process even when the job has many tasks.
        if "TORCHELASTIC_RUN_ID" in environ:  # torchrun inside srun: its variables describe the workers
            return False
        return "SLURM_PROCID" in environ and (read_int(environ, "SLURM_STEP_NUM_TASKS") or 1) > 1

    def layout(self) -> RankLayout:
        return RankLayout(*slurm_step_numbers(self.environ))

    def rendezvous(self, interface: str | None = None) -> Rendezvous:
        """The first node's address (Slurm's NodeAddr: no DNS needed) and a port from the job id.

        Every task derives the same answer without talking to the others. The address
        comes from HPCDDP_SLURM_NODE_ADDR, which slurm/train.sh looks up once per job,
        else from ``scontrol show node`` in every task (one slurmctld request per task).
        """
        env = self.environ
        address = env.get("MASTER_ADDR")
        if not address:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
            first = expand_nodelist(nodelist)[0] if nodelist else None
            if first is None or self.layout().num_nodes == 1:
                address = "127.0.0.1"
            else:
                address = node_address(first, read_slurm_node_address(env))
        port = read_int(env, "MASTER_PORT")
        if port is None:
            # The job id spreads concurrent jobs on one node over 15000-30000.
            job_id = read_int(env, "SLURM_JOB_ID", 0)
            step_id = read_int(env, "SLURM_STEP_ID", 0) or 0
            port = FIRST_DERIVED_PORT + (job_id * 7 + step_id) % NUM_DERIVED_PORTS
        chosen = interface_towards(address, interface, list_interfaces())
        return Rendezvous(address, port, chosen.name if chosen else None, bool(interface))

    def away_from(self, rendezvous: Rendezvous, taken: set[int]) -> Rendezvous:
        """Move a port derived from the job id past ``taken``: it is the same at every ``init()``.

        Every task chose the same ports before, so every task moves to the same new one. It
        stays in the derived range, out of the kernel's ephemeral ports (32768-60999, which
        outgoing connections take), and moves far: one port up is the job's next step's.
        """
        if self.environ.get("MASTER_PORT"):  # the user's: kept
            return rendezvous
        port = rendezvous.port
        for _ in range(NUM_DERIVED_PORTS):  # the step is prime to the range's width: every port once
            if port not in taken:
                break
            port = FIRST_DERIVED_PORT + (port - FIRST_DERIVED_PORT + _DERIVED_PORT_STEP) % NUM_DERIVED_PORTS
        return rendezvous if port == rendezvous.port else dataclasses.replace(rendezvous, port=port)


def node_address(node: str, known: tuple[str, str] | None = None) -> str:
    """Return Slurm's NodeAddr for ``node`` (``scontrol show node``), or ``node`` itself.

    Slurm reaches its nodes by NodeAddr, so that address works where the node's
    name is not in DNS.

    Args:
        node: the node's name.
        known: a (node, address) the batch script looked up already: no request to
            slurmctld when it names ``node``.
    """
    if known is not None and known[0] == node:
        return known[1]
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=15
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return node
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else node
