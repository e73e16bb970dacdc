"""`provision --slurm --dry-run`: every command in the order it runs and every file it writes (never the munge
key), golden-tested for a GTX 1050 Ti room from recorded facts, with apt (the PCs' index knows Slurm) and from
the head's bundle (no index: the .deb files sent and one dpkg -i, daemons kept from starting), and the power-saving part of a
room with `suspend_after` (the program, its key and files on the controller, each PC's poweroff-only login)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from cluster.inventory.model import Host
from cluster.room import debs, plan, slurm_power, state
from cluster.room import power as room_power
from tests import goldens
from tests.conftest import ROOT
from tests.unit.test_debs import HEAD, _bundle_of, graph
from tests.unit.test_room_conf import ROOMS

GOLDEN = ROOT / "tests" / "golden" / "room"
KEY = bytes(range(256)) * 4
CTL = Host(name="teacher", address="192.168.10.2", user="admin", become=True)
NODES = [Host(name=f"pc{i}", address=f"192.168.10.1{i}", user="admin", become=True) for i in (1, 2, 3)]
# A PC with Debian 12 and nothing of Slurm (the probe's output there), with or without an index that knows Slurm.
BARE = "".join(f"@@room file {p} -\n" for p in ("/etc/slurm/slurm.conf", "/etc/slurm/cgroup.conf",
                                                "/etc/slurm/gres.conf", "/etc/munge/munge.key"))
BARE += "".join(f"@@room unit {u} unknown not-found\n" for u in ("munge", "slurmd", "slurmctld"))


def _plan(index: bool) -> plan.Plan:
    st = state.parse(BARE + ("@@room candidate 22.05.8-4+deb12u3\n" if index else "@@room candidate (none)\n"))
    states = {h.name: st for h in [CTL, *NODES]}

    def install(h: Host, role: str, s: state.PcState) -> debs.Install:
        if index:
            return debs.install(role, s.installed, has_index=True)
        # a Debian 12 PC as the recorded one, without munge and Slurm
        have = {p: v for p, v in HEAD.items() if not p.startswith(("slurm", "munge", "libmunge"))}
        return debs.install(role, have, has_index=False,
                            bundle=_bundle_of(graph(role)), folder="clusterctl/debs-incoming")

    return plan.make(CTL, NODES, states, ROOMS["gtx1050ti"](), KEY, install)


def test_the_dry_run_with_apt_matches_golden_and_never_shows_the_key() -> None:
    text = plan.dry_run_text("lab214", _plan(index=True).actions)
    goldens.check(GOLDEN / "dry-run-apt.txt", text, "the dry run of a bare GTX room with apt")
    assert "apt-get install -y --no-install-recommends munge slurmctld slurm-client" in text
    assert "(the room's munge key, 1024 bytes, not shown)" in text and KEY[:64].hex() not in text
    assert "| NodeName=pc1 NodeAddr=192.168.10.11 CPUs=4" in text and "policy-rc.d" in text


def test_the_dry_run_from_the_bundle_sends_the_debs_and_installs_them_in_one_dpkg_call() -> None:
    p = _plan(index=False)
    text = plan.dry_run_text("lab214", p.actions)
    goldens.check(GOLDEN / "dry-run-bundle.txt", text, "the dry run of a bare GTX room from the head's bundle")
    node = next(a for a in p.phase("install") if a.pc == "pc1")
    sent = [remote for _, remote in node.copies]
    assert sent and all(r.startswith("clusterctl/debs-incoming/") and r.endswith(".deb") for r in sent)
    assert any("slurmd_" in r for r in sent) and not any("slurmctld_" in r for r in sent)
    assert node.command.count("dpkg -i") == 1 and "apt-get" not in node.command


# ----------------------------------------------------------------------------- power saving (suspend_after)

POWER = room_power.Material(key=b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot shown\n", public="ssh-ed25519 AAAAC3Nza "
                            "clusterctl-power:lab214\n", known_hosts="192.168.10.11 ssh-ed25519 AAAAhost1\n",
                            pcs='{"nodes": {"pc1": {"address": "192.168.10.11"}}}\n')


def _power(states: dict[str, state.PcState]) -> list[plan.Action]:
    return room_power.actions(CTL, NODES, states, POWER, "lab214")


def test_the_power_dry_run_installs_the_program_its_files_and_each_pcs_poweroff_login() -> None:
    st = state.parse(BARE)
    actions = _power({h.name: st for h in [CTL, *NODES]})
    text = plan.dry_run_text("lab214", actions)
    goldens.check(GOLDEN / "dry-run-power.txt", text, "the power-saving part of a bare room's dry run")
    ctl = [a for a in actions if a.pc == "teacher"]
    assert [a.what for a in ctl] == ["/usr/local/lib/clusterctl/slurm-power",
                                     "slurm-suspend, slurm-resume, slurm-resume-fail -> slurm-power",
                                     "/etc/slurm/clusterctl-power", "/etc/slurm/clusterctl-power/id_ed25519",
                                     "/etc/slurm/clusterctl-power/known_hosts", "/etc/slurm/clusterctl-power/pcs.json"]
    assert ctl[0].stdin == Path(slurm_power.__file__).read_bytes() and "0755" in ctl[0].command
    assert all("slurm:slurm" in a.command and "0400" in a.command for a in ctl[3:])
    assert "not shown" not in text.replace("(the room's power key, not shown)", "")  # the key never printed
    pc1 = [a for a in actions if a.pc == "pc1"]
    assert pc1[0].shown == "# clusterctl provision --slurm: the power key's login may switch this PC off, nothing " \
                           "else\nadmin ALL=(root) NOPASSWD: /usr/sbin/poweroff\n"
    assert pc1[1].shown == ('restrict,command="sudo -n /usr/sbin/poweroff" ssh-ed25519 AAAAC3Nza '
                            "clusterctl-power:lab214\n")
    assert not pc1[1].command.startswith("sudo")  # the login user's own file


def test_a_room_whose_power_files_are_in_place_plans_none_and_undo_removes_them(tmp_path: Path) -> None:
    program = Path(slurm_power.__file__).read_bytes()
    digests = {room_power.PROGRAM: program, room_power.KEY: POWER.key, room_power.KNOWN_HOSTS: POWER.known_hosts.encode(),
               room_power.PCS: POWER.pcs.encode()}
    ctl = state.parse("".join(f"@@room file {p} {plan.sha256(d)}\n" for p, d in digests.items()))
    node = state.parse(f"@@room file {room_power.SUDOERS} {plan.sha256(room_power.sudoers(NODES[0]).encode())}\n"
                       f"@@room authorized {plan.sha256(room_power.entry(POWER.public, 'lab214').encode())}\n")
    states = {"teacher": ctl, **{h.name: node for h in NODES}}
    assert _power(states) == []
    undo = plan.undo(CTL, NODES, states, None).actions + room_power.undo_actions(CTL, NODES, states)
    text = plan.dry_run_text("lab214", undo, undoing=True)
    assert "rm -f /usr/local/lib/clusterctl/slurm-power" in text and "rm -f /etc/sudoers.d/clusterctl-power" in text
    assert "rm -rf /etc/slurm/clusterctl-power" in text
    assert [a.what for a in undo if a.pc == "pc2"][-1] == "~admin/.ssh/authorized_keys: remove the power key"


def test_the_pcs_login_side_as_a_real_shell_runs_it(tmp_path: Path) -> None:
    """The authorized_keys action replaces an older power key's line and keeps the user's own, the probe then
    reads what the plan expects (a rerun plans nothing), undo removes it; the sudoers line passes visudo."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    auth = home / ".ssh" / "authorized_keys"
    auth.write_text("ssh-ed25519 AAAAmine me@head\nrestrict,command=\"x\" ssh-ed25519 AAAAold clusterctl-power:lab214\n")
    bare = state.parse(BARE)
    [_, add] = [a for a in _power({h.name: bare for h in [CTL, *NODES]}) if a.pc == "pc1"]
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    for _ in range(2):
        subprocess.run(["sh", "-c", add.command], input=add.stdin, env=env, check=True)
    assert auth.read_text() == "ssh-ed25519 AAAAmine me@head\n" + room_power.entry(POWER.public, "lab214")
    assert oct(auth.stat().st_mode & 0o777) == "0o600"
    probed = subprocess.run(["sh", "-c", state.AUTHORIZED_PROBE], env=env, capture_output=True, text=True)
    assert state.parse(probed.stdout).authorized == plan.sha256(room_power.entry(POWER.public, "lab214").encode())
    [remove] = room_power.undo_actions(CTL, [NODES[0]], {"teacher": state.parse(""), "pc1": state.parse(probed.stdout)})
    subprocess.run(["sh", "-c", remove.command], env=env, check=True)
    assert auth.read_text() == "ssh-ed25519 AAAAmine me@head\n"
    sudoers = tmp_path / "clusterctl-power"
    sudoers.write_text(room_power.sudoers(NODES[0]))
    r = subprocess.run(["visudo", "-cf", str(sudoers)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
