"""A lab PC's own system folders, so that Debian's munge and Slurm packages are configured and run in it as on a
real PC (by clusterctl over SSH, with sudo), never on this machine.

In each node's and the gateway's own mount namespace (cluster.lab.sshd's start):

    /etc/slurm /etc/munge /var/lib/munge /var/log/munge     the PC's own, from <pc>/system/..., made as the
    /var/lib/slurm /var/log/slurm /var/spool/slurmd         packages leave them here (this machine's owners
    /etc/systemd/system /var/log/clusterctl-units           and modes), empty of config; systemctl's own state;
    /usr/local/lib/clusterctl                               the room's power program (provision --slurm)
    /run                                                    <pc>/run, emptied at each boot: slurmd's and
                                                            slurmctld's default pid files are each PC's own
    /var/lib/dpkg                                           this machine's, read-only: `dpkg -i` fails

The PC's /run keeps what the lab needs there: /run/sshd, this machine's /run/netns (a node powers itself on
through `ip netns exec`) and /run/clusterctl-lab (a --slurm lab's munge socket).
"""
from __future__ import annotations

import os
import pwd
import shlex
import shutil
from pathlib import Path

from cluster.lab import units
from cluster.lab.net import sh
from cluster.lab.slurm import RUN_ROOT
from cluster.lab.state import NodeState

# path -> (owner, mode) where this machine has no such folder (its own owner and mode win where it has)
OWN = {"/etc/slurm": ("root", 0o755), "/etc/munge": ("munge", 0o700), "/var/lib/munge": ("munge", 0o711),
       "/var/log/munge": ("munge", 0o700), "/var/lib/slurm": ("slurm", 0o755),
       "/var/lib/slurm/slurmd": ("slurm", 0o755), "/var/lib/slurm/slurmctld": ("slurm", 0o755),
       "/var/log/slurm": ("slurm", 0o755), "/var/spool/slurmd": ("root", 0o755),
       "/etc/systemd/system": ("root", 0o755), str(units.LOGS): ("root", 0o755),
       "/usr/local/lib/clusterctl": ("root", 0o755)}
MOUNTED = [p for p in OWN if not any(p.startswith(q + "/") for q in OWN)]  # the others are inside these
# empty mount points made on this machine, like /srv/cluster (the last: the room's power program, a PC's own)
MAKE_POINTS = ("/var/spool/slurmd", str(units.LOGS), "/usr/local/lib/clusterctl")
# the PC's /run at boot: (name, owner, mode); "netns" and "clusterctl-lab" are this machine's, mounted there
RUN = [("sshd", "root", 0o755), ("lock", "root", 0o1777), ("user", "root", 0o755), ("munge", "munge", 0o755),
       (units.STATE.name, "root", 0o755), ("netns", "root", 0o755), ("clusterctl-lab", "root", 0o755)]
HOSTS_RUN = ("netns", "clusterctl-lab")
DPKG = "/var/lib/dpkg"


def _ids(owner: str) -> tuple[int, int]:
    try:
        pw = pwd.getpwnam(owner)
    except KeyError:  # the package that makes this user is not installed: root's, as a bare folder
        return 0, 0
    return pw.pw_uid, pw.pw_gid


def _make(path: Path, owner: str, mode: int, like: str | None = None) -> None:
    """A folder of the PC's, made once (its contents are the PC's from then on), owned as `like` is here."""
    if path.exists():
        return
    path.mkdir(parents=True)
    uid, gid = _ids(owner)
    if like and Path(like).is_dir():
        st = os.stat(like)
        uid, gid, mode = st.st_uid, st.st_gid, st.st_mode & 0o7777
    os.chown(path, uid, gid)
    path.chmod(mode)


def mount_script(node: NodeState) -> str:
    """Make the PC's folders and return the shell commands (each ending in `&& `) that mount them in its own
    mount namespace, before its sshd starts. A PC whose network namespace runs nothing yet is booting: its
    /run starts empty."""
    nd = Path(node.dir)
    system, run = nd / "system", nd / "run"
    for path, (owner, mode) in OWN.items():
        _make(system / path.lstrip("/"), owner, mode, like=path)
    for point in MAKE_POINTS:
        Path(point).mkdir(mode=0o755, parents=True, exist_ok=True)
    RUN_ROOT.mkdir(mode=0o755, parents=True, exist_ok=True)
    others = [p for p in sh("ip", "netns", "pids", node.netns, check=False).stdout.split() if int(p) != os.getpid()]
    if not others and run.exists():
        for entry in run.iterdir():  # NOTE: not the folders this machine's are mounted on (the caller may see them)
            if entry.name not in HOSTS_RUN:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    run.mkdir(mode=0o755, exist_ok=True)
    for name, owner, mode in RUN:
        _make(run / name, owner, mode)
    if not (run / "shm").is_symlink():
        (run / "shm").symlink_to("/dev/shm")
    q = shlex.quote
    cmds = [f"mount --rbind /run/netns {q(str(run / 'netns'))}",
            f"mount --rbind {q(str(RUN_ROOT))} {q(str(run / 'clusterctl-lab'))}", f"mount --rbind {q(str(run))} /run"]
    cmds += [f"mount --bind {q(str(system / p.lstrip('/')))} {q(p)}" for p in MOUNTED if Path(p).is_dir()]
    cmds += [f"mount --bind {DPKG} {DPKG}", f"mount -o remount,bind,ro {DPKG}"]
    return "".join(f"{c} && " for c in cmds)


def shim(switch: Path | None) -> str:
    """The PC's systemctl (cluster.lab.units as a script), with its power switch (None: the gateway's, none)."""
    text = Path(units.__file__).read_text()
    return text.replace('SWITCH = ""', f"SWITCH = {str(switch or '')!r}", 1)


def boot(node: NodeState) -> str:
    """Start the PC's enabled units inside it, as at boot (after its sshd: in its namespaces); their errors."""
    if node.pid is None:
        return ""
    proc = sh("nsenter", "-t", str(node.pid), "-n", "-u", "-m", "/usr/bin/python3", "-I",
              str(Path(node.dir) / "power-bin" / "systemctl"), "lab-boot", check=False)
    return proc.stderr
