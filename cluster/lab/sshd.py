"""One PC of the lab (a node, the gateway, a --slurm login node): its sshd in namespaces of its own, with its
hostname, /srv/cluster, home and accounts (cluster.lab.lifecycle shows the layout), so that each PC is reached
and used as a PC of its own, and stopped or restarted as one (failure injection for tests and teaching)."""
from __future__ import annotations

import shlex
import signal
import time
from pathlib import Path

from cluster.errors import LabError
from cluster.lab import pc as lab_pc
from cluster.lab.accounts import HOME_POINT, keygen, pc_accounts
from cluster.lab import slurm as lab_slurm
from cluster.lab.net import answers, sh
from cluster.lab.processes import alive, kill
from cluster.lab.state import LabState, NodeState, find_node, probe_ns, save_state
from cluster.lab.switch import power_bin

SSHD = "/usr/sbin/sshd"
MOUNT_POINT = Path("/srv/cluster")
SSHD_CONFIG = """\
# sshd for one node of a clusterctl simulated lab (written by `clusterctl lab up`)
Port 22
AuthorizedKeysFile {authorized_keys} .ssh/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The lab directory may sit under a group-writable tree; keys are ours, made 0600.
StrictModes no
UseDNS no
PrintMotd no
MaxStartups 200:30:400
MaxSessions 64
Subsystem sftp internal-sftp
"""


def start_sshd(node: NodeState, d: Path, user: str = "root", lab: str | None = None, again: bool = False,
               pc: bool = False, users: dict[str, str] | None = None) -> int:
    """Start the node's sshd in its namespace (own hostname, /srv/cluster, /etc/hosts, home and accounts);
    returns its pid. `again`: its accounts as `lab up` wrote them; `users`: the class's (cluster.lab.accounts). A node (`lab` given) or
    `pc` (the gateway) also gets its own system folders and systemctl (cluster.lab.pc, cluster.lab.units)."""
    nd = Path(node.dir)
    (nd / "srv").mkdir(parents=True, exist_ok=True)
    keygen(nd / "hostkey", f"clusterctl-lab-{node.hostname}")
    pidfile = nd / "sshd.pid"
    pidfile.unlink(missing_ok=True)
    # A PC of its own: its home directory (root's, in this node's copy of /etc/passwd), with a fresh shell's
    # ~/.bashrc (the head's, with pyenv or conda, would run before every command), so that a workdir in
    # the login directory is the node's own, not one folder shared by every node.
    home = nd / "home"
    home.mkdir(exist_ok=True)
    (home / ".bashrc").write_text("# clusterctl lab node: its own home, not the head's\n")
    mounts = pc_accounts(nd, user, home, users or {}, again)
    if lab is not None or pc:  # a node or the gateway (not a login node): its systemctl, a node's power switch
        mounts += power_bin(node, lab, d)
    # Debian's installer writes the hostname on 127.0.1.1, and nothing resolves the other PCs' names.
    (nd / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{node.hostname}\n"
                              "::1\tlocalhost ip6-localhost ip6-loopback\n")
    q = shlex.quote
    script = (
        f"hostname {q(node.hostname)} && mount --bind {q(str(nd / 'srv'))} {q(str(MOUNT_POINT))} && "
        f"mount --bind {q(str(home))} {q(str(HOME_POINT))} && "
        + "".join(f"mount --rbind {q(str(src))} {q(str(dst))} && " for src, dst in mounts) +  # rbind: the view's .pyenv
        f"mount --bind {q(str(nd / 'hosts'))} /etc/hosts && "
        + (lab_pc.mount_script(node) if lab is not None or pc else "") +
        f"exec {SSHD} -f {q(str(d / 'sshd_config'))} -h {q(str(nd / 'hostkey'))} "
        f"-o PidFile={q(str(pidfile))} -o ListenAddress={q(node.address)} -E {q(str(nd / 'sshd.log'))}"
    )
    sh("ip", "netns", "exec", node.netns, "unshare", "--uts", "--mount", "--propagation", "private",
        "sh", "-c", script)
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            node.pid = int(pidfile.read_text())
            return node.pid
        time.sleep(0.05)
    raise LabError(f"sshd of {node.name} did not start; see {nd / 'sshd.log'}")


def wait_listening(node: NodeState, via: str | None = None, timeout: float = 10.0) -> None:
    """Until the PC's sshd answers (bounded): `up` hands out an inventory only of PCs that can be reached."""
    deadline = time.monotonic() + timeout
    while not answers(via, node.address, 22, 1.0):
        if time.monotonic() > deadline:
            raise LabError(f"{node.name} ({node.address}) does not answer on port 22")
        time.sleep(0.05)


def stop_sshd(state: LabState, node: str) -> None:
    """Stop one node's sshd (the PC is 'off' for SSH; its namespace stays)."""
    n = find_node(state, node)
    if n.pid and alive(n.pid):
        kill([n.pid], (signal.SIGTERM,), timeout=2.0)


def restart_sshd(state: LabState, node: str, new_host_key: bool = False) -> None:
    """Start a node's sshd again; with `new_host_key`, as if the PC had been reinstalled."""
    n = find_node(state, node)
    stop_sshd(state, node)
    if new_host_key:
        for suffix in ("", ".pub"):
            (Path(n.dir) / f"hostkey{suffix}").unlink(missing_ok=True)
    start_sshd(n, Path(state.dir), state.user, lab=state.name, users=state.users)
    if state.slurm:  # a new sshd, a new mount namespace: the lab's /etc/slurm and shared folder again
        lab_slurm.mount_into(state, n)
    wait_listening(n, probe_ns(state))
    save_state(state)


def start_node_sshd(state: LabState, node: NodeState) -> None:
    """A node's sshd as at boot (`lab power on`, a magic packet), and wait until it answers, then its enabled
    units (cluster.lab.units); on a --slurm lab its slurmd too. Also run from the node's own namespaces (its
    Wake-on-LAN listener)."""
    start_sshd(node, Path(state.dir), state.user, lab=state.name, again=True, users=state.users)
    wait_listening(node, probe_ns(state))
    lab_pc.boot(node)
    if state.slurm:
        lab_slurm.mount_into(state, node)
        lab_slurm.restart_slurmd(state, node.name)
