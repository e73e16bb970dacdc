"""Each lab PC's accounts: its own copies of /etc/passwd, group, shadow and sudoers.d, mounted over this machine's
in the PC's namespace only (the PCs share this machine's /usr, not its accounts' homes or keys).

    --user NAME     the PCs' login user for the admin: an account only the PCs have (this machine must not have
                    it), NOPASSWD sudo there, the lab's key
    --users A,B     a class: this machine's own accounts, given the same uid and gid on every PC and the gateway
                    (Slurm and munge trust numbers, not names), a home of their own on each PC (under
                    USERS_POINT), no sudo, and a key, known_hosts and inventory of their own in their home here
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
from pathlib import Path

from cluster.errors import LabError, UsageError
from cluster.lab.net import sh

HOME_POINT = Path("/srv/clusterctl-home")  # the login user's (or root's) home on each PC, mounted in its namespace
USERS_POINT = Path("/srv/clusterctl-users")  # --users: their homes on each PC (one folder per PC, mounted here)
USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\Z")
Mounts = list[tuple[Path, Path]]


def keygen(path: Path, comment: str) -> None:
    """An ed25519 key pair at `path`, made only where there is none: a lab's keys outlive its sshd restarts
    and `lab down` (without --purge)."""
    if not path.exists():
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))


def class_users(names: list[str], login_user: str, lab: str) -> dict[str, str]:
    """--users: each name this machine's account (not root, not the PCs' login user), with its home: name ->
    the folder in that home that gets the user's key, known_hosts and inventory of this lab."""
    folders: dict[str, str] = {}
    for n in names:
        if not USER_RE.match(n):
            raise UsageError(f"--users: {n!r} is not a user name", "lowercase letters, digits, '_' or '-', e.g. alice")
        if n in ("root", login_user):
            raise UsageError(f"--users {n}: the class's users are other than root and --user {login_user}",
                             "name the students' accounts, e.g. --users alice,bob")
        try:
            home = Path(pwd.getpwnam(n).pw_dir)
        except KeyError:
            raise UsageError(f"--users {n}: this machine has no user {n} (the lab gives each PC this machine's "
                             "uid and gid for it)", f"useradd -m {n}; clusterctl never makes accounts here") from None
        if not home.is_dir():
            raise UsageError(f"--users {n}: {n}'s home {home} does not exist on this machine",
                             f"mkhomedir_helper {n}, or useradd -m for a new account")
        folders[n] = str(home / ".clusterctl" / "labs" / lab)
    return folders


def prepare_user(name: str, folder: str, lab: str) -> None:
    """The user's key pair in their own home on this machine (a folder only they read): what the PCs authorize
    for them and what their inventory names."""
    pw = pwd.getpwnam(name)
    d = Path(folder)
    for p in (d.parent.parent, d.parent, d):  # ~/.clusterctl, its labs/, this lab's: theirs if made here
        if not p.exists():
            p.mkdir(mode=0o700)
            os.chown(p, pw.pw_uid, pw.pw_gid)
    keygen(d / "id_ed25519", f"clusterctl-lab-{lab}-{name}")
    for p in (d / "id_ed25519", d / "id_ed25519.pub"):
        os.chown(p, pw.pw_uid, pw.pw_gid)


def pc_accounts(nd: Path, user: str, home: Path, users: dict[str, str], again: bool = False) -> Mounts:
    """The PC's own /etc/passwd (the login user's home: `home`; each class user's under USERS_POINT), and for a
    login user other than root, or a class, its own /etc/group, /etc/shadow (no password: keys only) and
    /etc/sudoers.d (NOPASSWD for the login user only): (file, mount point) pairs.
    The head's Python may live under /root (pyenv), which is 0700: its folder is shown in a /root of the
    PC's own, so that a python_env: existing run as another user finds it.
    `again`: the PC powering on from its own namespace (a magic packet), where /etc is already the PC's:
    the files written at `lab up` are mounted as they are."""
    again = again and (nd / "passwd").exists()
    if not again:
        _write(nd, user, home, users)
    mounts = [(nd / "passwd", Path("/etc/passwd"))]
    if user == "root" and not users:
        return mounts
    mounts += [(nd / "group", Path("/etc/group")), (nd / "shadow", Path("/etc/shadow"))]
    if users:
        _homes(nd, users)
        mounts.append((nd / "users", USERS_POINT))
    if user != "root":
        mounts.append((nd / "sudoers.d", Path("/etc/sudoers.d")))
    pyenv = Path("/root/.pyenv")
    if pyenv.is_dir():
        view = nd / "rootview"
        (view / ".pyenv").mkdir(parents=True, exist_ok=True)
        view.chmod(0o755)
        mounts += [(pyenv, view / ".pyenv"), (view, Path("/root"))]
    return mounts


def _write(nd: Path, user: str, home: Path, users: dict[str, str]) -> None:
    """The PC's account files from this machine's own (see pc_accounts)."""
    passwd = Path("/etc/passwd").read_text()
    group = Path("/etc/group").read_text()
    shadow = Path("/etc/shadow").read_text()
    if user == "root":
        passwd = with_field(passwd, "root", 5, str(HOME_POINT))
    else:
        if not Path("/etc/sudoers.d").is_dir() or not shutil.which("sudo"):
            raise LabError("--user needs sudo on this machine (the nodes share its /usr)", "apt-get install sudo")
        if any(line.split(":")[0] == user for line in passwd.splitlines()):
            raise UsageError(f"--user {user}: this machine has a user {user!r} already (the nodes share its "
                             "accounts)", "pick a name this machine does not have, e.g. --user student")
        taken = {int(line.split(":")[2]) for line in passwd.splitlines() if line.count(":") >= 6}
        uid = next(u for u in range(20000, 60000) if u not in taken)
        passwd += f"{user}:x:{uid}:{uid}::{HOME_POINT}:/bin/bash\n"
        group += f"{user}:x:{uid}:\n"
        shadow += f"{user}:*:19700:0:99999:7:::\n"
        _sudoers(nd, user)
        _authorize(home, (nd.parent / "authorized_keys").read_text(), uid, uid)
    for name in users:  # this machine's uid and gid, a home on the PC, never locked (keys only)
        passwd = with_field(passwd, name, 5, f"{USERS_POINT}/{name}")
        shadow = with_field(shadow, name, 1, "*")
    (nd / "passwd").write_text(passwd)
    (nd / "group").write_text(group)
    (nd / "shadow").write_text(shadow)
    (nd / "shadow").chmod(0o640)


def _sudoers(nd: Path, user: str) -> None:
    sudoers = nd / "sudoers.d"
    if sudoers.exists():
        shutil.rmtree(sudoers)
    shutil.copytree("/etc/sudoers.d", sudoers)
    (sudoers / "clusterctl-lab").write_text(f"{user} ALL=(ALL) NOPASSWD: ALL\n")
    (sudoers / "clusterctl-lab").chmod(0o440)
    sudoers.chmod(0o755)


def _authorize(home: Path, keys: str, uid: int, gid: int) -> None:
    """sshd reads a user's keys as that user: theirs, in the home they own on the PC (the lab folder is 0700)."""
    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    (home / ".ssh" / "authorized_keys").write_text(keys)
    for p in (home, *home.rglob("*")):
        os.chown(p, uid, gid)


def _homes(nd: Path, users: dict[str, str]) -> None:
    """Each class user's home on this PC, with their own key authorized (kept across power cycles)."""
    root = nd / "users"
    root.mkdir(mode=0o755, exist_ok=True)
    for name, folder in users.items():
        pw = pwd.getpwnam(name)
        home = root / name
        home.mkdir(mode=0o700, exist_ok=True)
        if not (home / ".bashrc").exists():
            (home / ".bashrc").write_text("# clusterctl lab PC: its own home, not the head's\n")
        _authorize(home, (Path(folder) / "id_ed25519.pub").read_text(), pw.pw_uid, pw.pw_gid)


def with_field(text: str, user: str, index: int, value: str) -> str:
    """An /etc/passwd or /etc/shadow text with `user`'s field `index` replaced."""
    lines = []
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 7 and parts[0] == user:
            parts[index] = value
        lines.append(":".join(parts))
    return "\n".join(lines) + "\n"
