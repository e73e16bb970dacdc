"""`provision --slurm --dry-run`: every command in the order it runs and every file it writes (never the munge
key), golden-tested for a GTX 1050 Ti room from recorded facts, with apt (the PCs' index knows Slurm) and from
the head's bundle (no index: the .deb files sent and one dpkg -i, daemons kept from starting)."""
from __future__ import annotations

from cluster.inventory.model import Host
from cluster.room import debs, plan, state
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
