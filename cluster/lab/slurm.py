"""A real Slurm in the simulated lab (`lab up N --slurm`): Debian's slurm-wlm, as a small university cluster.

    head            munged (the lab's own key), slurmctld (in a mount namespace of its own that sees the
                    nodes' accounts; --gateway: in the gateway PC's network namespace, where the bridge is)
    login           netns <name>-sl at the subnet's .10: its own sshd, the Slurm client, not a compute node
    nodeN           one slurmd inside the node's namespaces (nsenter into its sshd's), port 6818 of its own
    login, nodeN    /etc/slurm (the lab's slurm.conf and cgroup.conf) and /srv/slurm-shared (<dir>/shared:
                    the cluster's shared filesystem) bind-mounted in each one's own mount namespace only

The lab directory is 0700 (its keys), so what the login user's clients must reach by path, the munge socket
and the job completion file, lives in /run/clusterctl-lab/<name> (0755). Every process started here carries
CLUSTERCTL_SLURM_LAB=<name> in its environment: `down` finds a crashed lab's daemons by name.
The host's /etc/slurm, /etc/munge and its own munged are never touched.
"""
from __future__ import annotations

import ipaddress
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import LabError, UsageError
from cluster.lab.net import sh
from cluster.lab.processes import alive, kill, marked, tree
from cluster.lab.slurm_conf import (PARTITION, SLURMD_POINT, SLURMD_PORT, ctld_port, render_cgroup_conf,
                                    render_slurm_conf)
from cluster.lab.state import LabState, NodeState, SlurmState, find_node, probe_ns, save_state

CLUSTER = "slurm"  # the cluster's name in the lab's inventory: `clusterctl launch JOB --on slurm`
SHARED_POINT = Path("/srv/slurm-shared")  # the shared folder, at the same path in the login and compute nodes
ETC_SLURM = Path("/etc/slurm")  # where clients look by default; the lab's folder is mounted there in the PCs
RUN_ROOT = Path("/run/clusterctl-lab")  # world-traversable: the munge socket and the job completion file
MARK = "CLUSTERCTL_SLURM_LAB"
PLAIN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}  # what the lab's Slurm programs run with
BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "sinfo", "squeue", "sacct",
            "scontrol", "nsenter")
INSTALL = "apt-get install slurmctld slurmd slurm-client munge"
USABLE = ("idle", "mixed", "allocated", "completing")  # sinfo %T of a node that runs jobs
UP_TIMEOUT = 30.0  # daemons up and every node idle (well under a second on 2 shared cores)


@dataclass
class SlurmNode:
    """One compute node as `lab status` shows it: its slurmd alive, and the state sinfo gives it."""
    name: str
    slurmd: bool
    state: str | None  # sinfo's %T (idle, allocated, down*...), None when slurmctld does not answer


@dataclass
class SlurmStatus:
    munged: bool
    slurmctld: bool
    nodes: list[SlurmNode]

    @property
    def healthy(self) -> bool:
        """Daemons up and every node able to run jobs (busy or not): what `lab status` exits 0 on."""
        return self.munged and self.slurmctld and all(n.slurmd and n.state in USABLE for n in self.nodes)


def preflight() -> None:
    """Refuse `lab up --slurm` early, with the install line, where slurm-wlm or munge is missing."""
    for tool in BINARIES:
        if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
            pkg = "util-linux" if tool == "nsenter" else "slurmctld slurmd slurm-client munge"
            raise LabError(f"`{tool}` is not installed (`lab up --slurm` runs Debian's slurm-wlm)",
                           f"apt-get install {pkg}" if tool == "nsenter" else INSTALL)
    if not ETC_SLURM.is_dir():  # the packages make it; each PC mounts the lab's folder over it
        raise LabError(f"{ETC_SLURM} does not exist (slurm-wlm's packages make it)", INSTALL)


def _slurm_dir(state: LabState) -> Path:
    return Path(state.dir) / "slurm"


def _env(name: str) -> dict[str, str]:
    """A daemon's environment: a plain PATH and the lab's mark (how `down` finds it again by name)."""
    return {**PLAIN_ENV, MARK: name}


def _sh(*args: str, env: dict[str, str]) -> None:
    """Start a daemon (it forks and returns) with the lab's mark; its own error where it refuses at once."""
    # NOTE: not a pipe: a daemon that kept it open would make run() wait for its end
    with tempfile.TemporaryFile("w+") as errors:
        try:
            proc = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=errors, stderr=errors, env=env, timeout=60)
        except subprocess.TimeoutExpired:
            raise LabError(f"`{shlex.join(args)}` did not return within 60 s") from None
        if proc.returncode != 0:
            errors.seek(0)
            raise LabError(f"`{shlex.join(args)}` failed: {errors.read().strip()}")


def _uid(state: LabState) -> int:
    """The login user's uid, as the PCs' own /etc/passwd copies have it (the same on every PC)."""
    for line in (Path(state.nodes[0].dir) / "passwd").read_text().splitlines():
        parts = line.split(":")
        if len(parts) == 7 and parts[0] == state.user:
            return int(parts[2])
    raise LabError(f"user {state.user} is not in {state.nodes[0].dir}/passwd", "`clusterctl lab up` again")


def start(state: LabState, login: NodeState, python: str = sys.executable) -> SlurmState:
    """Start the lab's Slurm, its nodes and `login` already up (their sshd pids known): the config, munged,
    slurmctld, one slurmd per compute node; returns once every node is idle in sinfo (bounded)."""
    run, shared = RUN_ROOT / state.name, Path(state.dir) / "shared"
    ctl = SlurmState(conf=str(_slurm_dir(state) / "etc" / "slurm.conf"), shared=str(shared),
                     shared_mount=str(SHARED_POINT), login=login, controller=state.gateway,
                     ctld_port=ctld_port(ipaddress.IPv4Network(state.subnet)), slurmd_port=SLURMD_PORT,
                     munge_socket=str(run / "munge" / "munge.socket"), jobcomp=str(run / "jobcomp.txt"),
                     partition=PARTITION, python=python, via=probe_ns(state))
    state.slurm = ctl
    _prepare(state, ctl)
    ctl.munged_pid = _start_munged(state)
    ctl.slurmctld_pid = _start_slurmctld(state)
    mount_into(state, login)
    for node in state.nodes:
        mount_into(state, node)
        ctl.slurmd_pids[node.name] = _start_slurmd(state, node)
    _wait_idle(state)
    return ctl


def _prepare(state: LabState, ctl: SlurmState) -> None:
    """The folders (each reachable by who needs it), the shared folder (the login user's), the job
    completion file and the config."""
    sd, run, shared = _slurm_dir(state), RUN_ROOT / state.name, Path(ctl.shared)
    for p in (sd / "etc", sd / "nodes", run / "munge", shared / "clusterctl", SHARED_POINT, SLURMD_POINT):
        p.mkdir(parents=True, exist_ok=True)  # the two /srv ones: empty mount points on the host, like /srv/cluster
    shutil.rmtree(sd / "ctld", ignore_errors=True)  # a fresh cluster: no jobs of an earlier `up`
    (sd / "ctld").mkdir()
    for p in (RUN_ROOT, run, run / "munge", sd / "etc", sd / "nodes"):
        p.chmod(0o755)  # NOTE: munged refuses a socket folder that is not 0755
    uid = _uid(state)
    for p in (shared, shared / "clusterctl"):
        p.chmod(0o755)
        os.chown(p, uid, uid)
    jobcomp = Path(ctl.jobcomp)
    jobcomp.touch(mode=0o644)
    os.chown(jobcomp, uid, uid)  # NOTE: `sacct -c` opens the file to append (jobcomp/filetxt): the login user's
    (sd / "etc" / "slurm.conf").write_text(render_slurm_conf(
        name=state.name, ctld_host=socket.gethostname().split(".")[0], ctld_addr=ctl.controller,
        ctld_port=ctl.ctld_port, munge_socket=ctl.munge_socket, slurm_dir=str(sd), jobcomp=ctl.jobcomp,
        nodes=[(n.name, n.address) for n in state.nodes]))
    (sd / "etc" / "cgroup.conf").write_text(render_cgroup_conf())
    for f in ("slurm.conf", "cgroup.conf"):
        (sd / "etc" / f).chmod(0o644)


def _start_munged(state: LabState) -> int:
    """The lab's munged with a key of its own (never the host's /etc/munge)."""
    sd = _slurm_dir(state)
    key = sd / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    pidfile = sd / "munged.pid"
    pidfile.unlink(missing_ok=True)
    _sh("munged", f"--key-file={key}", f"--socket={_slurm_of(state).munge_socket}", f"--pid-file={pidfile}",
       f"--log-file={sd / 'munged.log'}", f"--seed-file={sd / 'munged.seed'}", env=_env(state.name))
    return _wait_pidfile(pidfile, "munged", sd / "munged.log")


def _start_slurmctld(state: LabState) -> int:
    """slurmctld on the head, in a mount namespace of its own where /etc/passwd and /etc/group are the PCs'
    (it refuses jobs of a uid it cannot name: the login user exists only on the PCs). --gateway: in the
    gateway PC's network namespace, the one with the controller's address on the lab's bridge."""
    sd, ctl = _slurm_dir(state), _slurm_of(state)
    login = ctl.login
    pidfile = sd / "slurmctld.pid"
    pidfile.unlink(missing_ok=True)
    q = shlex.quote
    binds = "".join(f"mount --bind {q(str(Path(login.dir) / f))} /etc/{f} && "
                    for f in ("passwd", "group") if (Path(login.dir) / f).exists())
    script = f"{binds}exec slurmctld -f {q(ctl.conf)}"
    via = ["nsenter", "-t", str(state.jump.pid), "-n"] if state.jump else []
    _sh(*via, "unshare", "--mount", "--propagation", "private", "sh", "-c", script, env=_env(state.name))
    return _wait_pidfile(pidfile, "slurmctld", sd / "slurmctld.log")


def mount_into(state: LabState, pc: NodeState) -> None:
    """The lab's /etc/slurm and the shared folder in a PC's own mount namespace (its sshd's); a compute node
    also gets its slurmd folder. Called again after a PC's sshd restarts (a new mount namespace)."""
    if pc.pid is None:
        raise LabError(f"{pc.name} has no sshd: cannot enter its namespaces", "`clusterctl lab up` again")
    sd = _slurm_dir(state)
    mounts = [(sd / "etc", ETC_SLURM), (Path(state.dir) / "shared", SHARED_POINT)]
    if any(n.name == pc.name for n in state.nodes):
        own = sd / "nodes" / pc.name
        (own / "spool").mkdir(parents=True, exist_ok=True)
        for p in (own, own / "spool"):
            p.chmod(0o755)  # a job's script in the spool is run as the login user
        mounts.append((own, SLURMD_POINT))
    script = " && ".join(f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}" for src, dst in mounts)
    sh("nsenter", "-t", str(pc.pid), "-m", "sh", "-c", script)


def _start_slurmd(state: LabState, node: NodeState) -> int:
    """One slurmd inside the node's namespaces (network, hostname, mounts: those of its sshd)."""
    pidfile = _slurm_dir(state) / "nodes" / node.name / "slurmd.pid"
    pidfile.unlink(missing_ok=True)
    _sh("nsenter", "-t", str(node.pid), "-n", "-u", "-m", "slurmd", "-f", str(ETC_SLURM / "slurm.conf"),
       env=_env(state.name))
    return _wait_pidfile(pidfile, f"slurmd of {node.name}", pidfile.parent / "slurmd.log")


def _wait_pidfile(pidfile: Path, what: str, log: Path, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int(pidfile.read_text().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and alive(pid):
            return pid
        time.sleep(0.05)
    raise LabError(f"{what} did not start within {timeout:g} s", f"see {log}")


def client(state: LabState, *argv: str, timeout: float = 30.0) -> str:
    """Run a Slurm client (sinfo, squeue, sacct, scontrol, ...) on the head against the lab's cluster, as
    root: its stdout. --gateway: from the gateway's network namespace (the head has no route to the bridge)."""
    ctl = _slurm_of(state)
    via = ["ip", "netns", "exec", ctl.via] if ctl.via else []
    env = {**PLAIN_ENV, "SLURM_CONF": ctl.conf}
    try:
        proc = subprocess.run([*via, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise LabError(f"`{shlex.join(argv)}` gave no answer within {timeout:g} s",
                       f"is slurmctld up? `clusterctl lab status --name {state.name}`") from None
    if proc.returncode != 0:
        raise LabError(f"`{shlex.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}",
                       f"see {_slurm_dir(state) / 'slurmctld.log'}")
    return proc.stdout


def node_states(state: LabState) -> dict[str, str]:
    """nodeN -> sinfo's state (idle, allocated, down*...)."""
    out = client(state, "sinfo", "-h", "-N", "-o", "%N %T", timeout=10)
    return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)


def _wait_idle(state: LabState, timeout: float = UP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    seen: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            seen = node_states(state)
        except LabError:
            seen = {}
        if seen and all(seen.get(n.name) == "idle" for n in state.nodes):
            return
        time.sleep(0.1)
    raise LabError(f"the lab's Slurm nodes are not idle within {timeout:g} s (sinfo: {seen or 'no answer'})",
                   f"see {_slurm_dir(state)}/slurmctld.log and nodes/*/slurmd.log")


def status(state: LabState) -> SlurmStatus | None:
    """munged, slurmctld and each slurmd alive, and sinfo's state of each node (None: not a --slurm lab)."""
    ctl = state.slurm
    if ctl is None:
        return None
    ctld = ctl.slurmctld_pid is not None and alive(ctl.slurmctld_pid)
    try:
        states = node_states(state) if ctld else {}
    except LabError:
        states = {}
    rows = [SlurmNode(n.name, n.name in ctl.slurmd_pids and alive(ctl.slurmd_pids[n.name]), states.get(n.name))
            for n in state.nodes]
    return SlurmStatus(ctl.munged_pid is not None and alive(ctl.munged_pid), ctld, rows)


def stop(name: str) -> list[str]:
    """Stop lab `name`'s munged, slurmctld and slurmd (found by their mark, so a crashed lab's too) and
    remove its /run folder. Idempotent. The nodes' job tasks end with their namespaces (`lab down`)."""
    removed = []
    pids = marked(f"{MARK}={name}")
    if pids:
        # NOTE: slurmctld takes ~3 s to exit on SIGTERM once it has run jobs; the lab's Slurm state is thrown
        # away (`up` starts a fresh cluster), so it gets a second, then SIGKILL
        kill(pids, timeout=1.0)
        removed.append(f"slurm daemons {' '.join(map(str, sorted(pids)))}")
    run = RUN_ROOT / name
    if run.exists():
        shutil.rmtree(run, ignore_errors=True)
        removed.append(f"directory {run}")
    return removed


# --------------------------------------------------------------------------- failure injection (tests, teaching)


def crash_node(state: LabState, node: str) -> list[int]:
    """A crashed compute node, as Slurm sees one: its slurmd, slurmstepd and job tasks killed (SIGKILL), its
    sshd left alone. Returns the pids killed. slurmctld marks it DOWN after SlurmdTimeout (25-33 s)."""
    _slurm_of(state)
    n = find_node(state, node)
    keep = tree(n.pid) if n.pid else set()  # the sshd and its sessions: the PC is up, its Slurm is not
    ns_pids = [int(p) for p in sh("ip", "netns", "pids", n.netns, check=False).stdout.split()]
    victims = [p for p in ns_pids if p not in keep]
    kill(victims, (signal.SIGKILL,), timeout=5.0)
    return victims


def restart_slurmd(state: LabState, node: str) -> int:
    """Start a crashed node's slurmd again (ReturnToService=2 brings the node back); returns its pid."""
    ctl, n = _slurm_of(state), find_node(state, node)
    pid = ctl.slurmd_pids.get(n.name)
    if pid and alive(pid):
        kill([pid])
    ctl.slurmd_pids[n.name] = _start_slurmd(state, n)
    save_state(state)
    return ctl.slurmd_pids[n.name]


def _slurm_of(state: LabState) -> SlurmState:
    """The lab's Slurm, or the error that says the lab has none and how to start one that has."""
    if state.slurm is None:
        raise UsageError(f"lab {state.name} has no Slurm", f"`clusterctl lab up N --name {state.name} --slurm`")
    return state.slurm
