"""`lab up --users`: the class's accounts are this machine's own, given to every lab PC with the same uid and
gid, a home of their own on the PC, their own key authorized there, and never locked (keys only)."""
from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from cluster.errors import UsageError
from cluster.lab import accounts


def test_a_class_user_this_machine_lacks_is_refused_with_useradd() -> None:
    with pytest.raises(UsageError) as e:
        accounts.class_users(["nosuchstudent"], "student", "lab")
    assert "this machine has no user nosuchstudent" in e.value.message and "useradd -m nosuchstudent" in e.value.fix
    for name in ("root", "student"):  # root, or the PCs' own login user (an account only the PCs have)
        with pytest.raises(UsageError):
            accounts.class_users([name], "student", "lab")
    with pytest.raises(UsageError, match="not a user name"):
        accounts.class_users(["Alice!"], "student", "lab")


@pytest.mark.skipif(os.geteuid() != 0, reason="writes a PC's copy of /etc/shadow and chowns its home (root)")
def test_each_pc_gives_the_user_this_machines_numbers_a_home_and_their_key(tmp_path: Path) -> None:
    user = "nobody"  # an account every Debian machine has, not root
    pw = pwd.getpwnam(user)
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "id_ed25519.pub").write_text("ssh-ed25519 AAAAC3Nza their-key\n")
    nd = tmp_path / "node1"
    (nd / "home").mkdir(parents=True)
    mounts = accounts.pc_accounts(nd, "root", nd / "home", {user: str(folder)})
    line = next(x for x in (nd / "passwd").read_text().splitlines() if x.startswith(f"{user}:"))
    assert line.split(":")[2:4] == [str(pw.pw_uid), str(pw.pw_gid)]  # this machine's numbers, as they are
    assert line.split(":")[5] == f"{accounts.USERS_POINT}/{user}"
    shadow = next(x for x in (nd / "shadow").read_text().splitlines() if x.startswith(f"{user}:"))
    assert shadow.split(":")[1] == "*"  # no password, not locked: sshd lets their key in
    keys = nd / "users" / user / ".ssh" / "authorized_keys"
    assert keys.read_text() == "ssh-ed25519 AAAAC3Nza their-key\n" and keys.stat().st_uid == pw.pw_uid
    assert (nd / "users" / user).stat().st_mode & 0o777 == 0o700
    assert (nd / "users", accounts.USERS_POINT) in mounts and (nd / "shadow", Path("/etc/shadow")) in mounts
    assert not any(dst == Path("/etc/sudoers.d") for _, dst in mounts)  # no sudo for the class


def test_a_field_of_one_user_is_replaced_and_nothing_else() -> None:
    text = "root:x:0:0:root:/root:/bin/bash\nalice:x:1001:1001::/home/alice:/bin/sh\n"
    assert accounts.with_field(text, "alice", 5, "/srv/clusterctl-users/alice") == (
        "root:x:0:0:root:/root:/bin/bash\nalice:x:1001:1001::/srv/clusterctl-users/alice:/bin/sh\n")
