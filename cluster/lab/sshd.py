"""One PC of the lab (a node, the gateway, a --slurm login node): its sshd in namespaces of its own, with its
hostname, /srv/cluster, home and accounts (cluster.lab.lifecycle shows the layout), so that each PC is reached
and used as a PC of its own, and stopped or restarted as one (failure injection for tests and teaching)."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import time
from pathlib import Path

from cluster.errors import LabError, UsageError
from cluster.lab import pc as lab_pc
from cluster.lab import slurm as lab_slurm
from cluster.lab.net import answers, sh
from cluster.lab.processes import alive, kill
from cluster.lab.state import LabState, NodeState, find_node, probe_ns, save_state
from cluster.lab.switch import power_bin

SSHD = "/usr/sbin/sshd"
MOUNT_POINT = Path("/srv/cluster")
HOME_POINT = Path("/srv/clusterctl-home")  # each node's own home directory is mounted here, in its namespace
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


def keygen(path: Path, comment: str) -> None:
    """An ed25519 key pair at `path`, made only where there is none: a lab's keys outlive its sshd restarts
    and `lab down` (without --purge)."""
    if not path.exists():
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))


def start_sshd(node: NodeState, d: Path, user: str = "root", lab: str | None = None, again: bool = False,
               pc: bool = False) -> int:
    """Start the node's sshd in its namespace (own hostname, /srv/cluster, /etc/hosts, home and accounts);
    returns its pid. `again`: its accounts as `lab up` wrote them (see _accounts). A node (`lab` given) or
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
    mounts = _accounts(nd, user, home, again)
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


def _accounts(nd: Path, user: str, home: Path, again: bool = False) -> list[tuple[Path, Path]]:
    """The node's own /etc/passwd (the login user's home: `home`), and for a user other than root its own
    /etc/group, /etc/shadow (no password: keys only) and /etc/sudoers.d (NOPASSWD for that user), written
    beside the node and mounted over the host's in the node's namespace only: (file, mount point) pairs.
    The head's Python may live under /root (pyenv), which is 0700: its folder is shown in a /root of the
    node's own, so that a python_env: existing run as that user finds it.
    `again`: the node powering on from its own namespace (a magic packet), where /etc is already the node's:
    the files written at `lab up` are mounted as they are."""
    again = again and (nd / "passwd").exists()
    if user == "root":
        if not again:
            (nd / "passwd").write_text(_passwd_with_home(Path("/etc/passwd").read_text(), "root", str(HOME_POINT)))
        return [(nd / "passwd", Path("/etc/passwd"))]
    if not again:
        _write_accounts(nd, user, home)
    mounts = [(nd / "passwd", Path("/etc/passwd")), (nd / "group", Path("/etc/group")),
              (nd / "shadow", Path("/etc/shadow")), (nd / "sudoers.d", Path("/etc/sudoers.d"))]
    pyenv = Path("/root/.pyenv")
    if pyenv.is_dir():
        view = nd / "rootview"
        (view / ".pyenv").mkdir(parents=True, exist_ok=True)
        view.chmod(0o755)
        mounts += [(pyenv, view / ".pyenv"), (view, Path("/root"))]
    return mounts


def _write_accounts(nd: Path, user: str, home: Path) -> None:
    """A non-root login user's files for the node (see _accounts), from this machine's own."""
    passwd = Path("/etc/passwd").read_text()
    if not Path("/etc/sudoers.d").is_dir() or not shutil.which("sudo"):
        raise LabError("--user needs sudo on this machine (the nodes share its /usr)", "apt-get install sudo")
    taken = {int(line.split(":")[2]) for line in passwd.splitlines() if line.count(":") >= 6}
    uid = next(u for u in range(20000, 60000) if u not in taken)
    if any(line.split(":")[0] == user for line in passwd.splitlines()):
        raise UsageError(f"--user {user}: this machine has a user {user!r} already (the nodes share its accounts)",
                         "pick a name this machine does not have, e.g. --user student")
    (nd / "passwd").write_text(passwd + f"{user}:x:{uid}:{uid}::{HOME_POINT}:/bin/bash\n")
    (nd / "group").write_text(Path("/etc/group").read_text() + f"{user}:x:{uid}:\n")
    (nd / "shadow").write_text(Path("/etc/shadow").read_text() + f"{user}:*:19700:0:99999:7:::\n")
    (nd / "shadow").chmod(0o640)
    sudoers = nd / "sudoers.d"
    if sudoers.exists():
        shutil.rmtree(sudoers)
    shutil.copytree("/etc/sudoers.d", sudoers)
    (sudoers / "clusterctl-lab").write_text(f"{user} ALL=(ALL) NOPASSWD: ALL\n")
    (sudoers / "clusterctl-lab").chmod(0o440)
    sudoers.chmod(0o755)
    # sshd reads a user's keys as that user: the lab's key, in the home it can read (the lab folder is 0700)
    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(nd.parent / "authorized_keys", home / ".ssh" / "authorized_keys")
    for p in (home, *home.rglob("*")):
        os.chown(p, uid, uid)


def _passwd_with_home(passwd: str, user: str, home: str) -> str:
    """/etc/passwd with `user`'s home directory (the sixth field) replaced."""
    lines = []
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) == 7 and parts[0] == user:
            parts[5] = home
        lines.append(":".join(parts))
    return "\n".join(lines) + "\n"


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
    start_sshd(n, Path(state.dir), state.user, lab=state.name)
    if state.slurm:  # a new sshd, a new mount namespace: the lab's /etc/slurm and shared folder again
        lab_slurm.mount_into(state, n)
    wait_listening(n, probe_ns(state))
    save_state(state)


def start_node_sshd(state: LabState, node: NodeState) -> None:
    """A node's sshd as at boot (`lab power on`, a magic packet), and wait until it answers, then its enabled
    units (cluster.lab.units); on a --slurm lab its slurmd too. Also run from the node's own namespaces (its
    Wake-on-LAN listener)."""
    start_sshd(node, Path(state.dir), state.user, lab=state.name, again=True)
    wait_listening(node, probe_ns(state))
    lab_pc.boot(node)
    if state.slurm:
        lab_slurm.mount_into(state, node)
        lab_slurm.restart_slurmd(state, node.name)
