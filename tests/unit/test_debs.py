"""Debian packages for munge and Slurm: resolution on recorded apt-cache/dpkg-query output (tests/fixtures/debs/
README.md), the install scripts (golden text, and the policy-rc.d guard run for real), the bundle carried as a tar."""
from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from cluster import errors
from cluster.cli import main
from cluster.nodes import facts
from cluster.room import debs, debs_carry
from tests.conftest import FIXTURES

F = FIXTURES / "debs"
HEAD = debs.parse_installed((F / "dpkg-query-head.txt").read_text())
BASE = ["gcc-12-base", "libgcc-s1", "libc6", "libbz2-1.0", "libgpg-error0", "libgcrypt20", "libmunge2", "zlib1g",
        "libaudit-common", "libcap-ng0", "libaudit1", "libcrypt1", "debconf", "libpam0g", "libpcre2-8-0",
        "libselinux1", "libsemanage-common", "libsepol2", "libsemanage2", "libdb5.3", "libpam-modules-bin",
        "libpam-modules", "passwd", "adduser", "sysvinit-utils", "lsb-base", "munge", "liblz4-1", "liblzma5",
        "libmd0", "libzstd1", "libacl1", "tar", "dpkg", "readline-common", "libtinfo6", "libreadline8", "libcap2",
        "libsystemd0", "libdbus-1-3", "libudev1", "libhwloc15", "libjson-c5", "libstdc++6", "liblua5.1-0",
        "libnuma1", "libyaml-0-2", "slurm-wlm-basic-plugins", "sensible-utils", "ucf", "slurm-client"]


def graph(role: str) -> debs.Depends:
    return debs.parse_depends((F / f"depends-{role}.txt").read_text())


@pytest.mark.parametrize("role, own", [("controller", "slurmctld"), ("node", "slurmd")])
def test_a_bare_pc_gets_the_roles_packages_and_every_dependency_first(role: str, own: str) -> None:
    dep = graph(role)
    got = debs.resolve(dep, debs.ROLES[role])
    assert sorted(got) == sorted([*BASE, own])
    assert "slurm-wlm-basic-plugins" in got and "libmunge2" in got  # dependencies, not roles' top packages
    for alt in ("cdebconf", "libelogind0"):  # providers apt lists, never chosen over the real first alternative
        assert alt in dep.groups and alt not in got
    for i, p in enumerate(got):  # dependencies first: dpkg -i and the manifest keep this order
        for group in dep.groups[p]:
            assert any(a in got[:i] or a == p for a in group) or set(group) & {"dpkg", "libc6", "libgcc-s1"}


def test_the_roles_top_packages_are_debian_12_names() -> None:
    cands = debs.parse_show((F / "show.txt").read_text())
    assert {p for ps in debs.ROLES.values() for p in ps} <= cands.keys()
    assert cands["munge"].version == "0.5.15-2+deb12u1" and cands["slurmd"].version.startswith("22.05.8")
    assert cands["libaudit1"].file == "libaudit1_1%3a3.0.9-1_amd64.deb"  # the epoch as apt-get download names it


@pytest.mark.parametrize("role", ["controller", "node"])
def test_a_pc_with_everything_needs_nothing(role: str) -> None:
    assert HEAD["munge"] == "0.5.15-2+deb12u1"
    assert debs.resolve(graph(role), debs.ROLES[role], HEAD) == []


def test_only_what_is_missing_and_an_installed_alternative_meets_its_group() -> None:
    dep = graph("node")
    without = {p: v for p, v in HEAD.items() if p not in ("slurmd", "slurm-wlm-basic-plugins", "debconf")}
    # debconf's dependents are installed: their dependencies are met, as dpkg's state says
    assert debs.resolve(dep, debs.ROLES["node"], without) == ["slurm-wlm-basic-plugins", "slurmd"]
    assert dep.groups["ucf"][0] == ["debconf", "debconf-2.0"]  # `|Depends: debconf` `Depends: <debconf-2.0>`
    assert dep.providers["debconf-2.0"] == ["cdebconf", "debconf"]
    with_cdebconf = {**{p: "1" for p in BASE if p not in ("debconf", "ucf")}, "cdebconf": "0.270"}
    assert debs.resolve(dep, ["ucf"], with_cdebconf) == ["ucf"]  # cdebconf provides debconf-2.0: group met
    assert dep.groups["readline-common"] == [["dpkg", "install-info"]]


def test_installed_means_status_ii() -> None:
    text = "munge\t0.5.15-2\tii \nslurmd\t22.05.8-4\trc \nlibc6:amd64\t2.36-9\tii \nucf\t3.0043\tiU \n"
    assert debs.parse_installed(text) == {"munge": "0.5.15-2", "libc6": "2.36-9"}
    assert len(HEAD) == len((F / "dpkg-query-head.txt").read_text().splitlines())


def test_the_os_fact_holds_the_codename_and_dpkg_architecture() -> None:
    got = facts.parse_os((F / "os-release-head.txt").read_text(), 0)
    assert got == {"name": "Debian GNU/Linux 12 (bookworm)", "id": "debian", "version": "12",
                   "codename": "bookworm", "arch": "amd64"}
    assert facts.parse_os('ID=arch\nNAME="Arch Linux"\nDPKG_ARCHITECTURE=\n', 0)["arch"] is None


GUARD = """set -e
p=/usr/sbin/policy-rc.d; keep=/usr/sbin/policy-rc.d.clusterctl-saved{d}
if [ -e "$p" ] && ! grep -qF '# clusterctl: no daemon starts while packages install' "$p"; then \
mv -f "$p" "$keep"; fi
trap 'rm -f "$p"; if [ -e "$keep" ]; then mv -f "$keep" "$p"; fi{rm}' EXIT
trap 'exit 130' INT TERM HUP
printf '#!/bin/sh\\n%s\\nexit 101\\n' '# clusterctl: no daemon starts while packages install' > "$p"
chmod 755 "$p"
"""


def test_apt_path_installs_only_the_missing_top_packages() -> None:
    i = debs.install("node", {"munge": "0.5.15-2+deb12u1"}, has_index=True)
    assert i.missing == ("slurmd", "slurm-client") and i.copies == () and i.folder is None
    assert i.script == GUARD.format(d="", rm="") + (
        "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmd slurm-client\n")


def test_nothing_missing_is_no_command() -> None:
    for has_index in (True, False):
        i = debs.install("controller", HEAD, has_index, bundle=None if has_index else _bundle_of(graph("controller")))
        assert i.script == "" and i.missing == () and i.copies == ()
        assert i.message == "already installed: munge slurmctld slurm-client"


def _bundle_of(dep: debs.Depends) -> debs.Bundle:
    cands = debs.parse_show((F / "show.txt").read_text())
    names = debs.resolve(dep, dep.groups.keys() & {p for ps in debs.ROLES.values() for p in ps})
    return debs.Bundle("bookworm", "amd64", tuple({"package": n, "version": cands[n].version, "file": cands[n].file,
                                                   "sha256": cands[n].sha256, "size": cands[n].size}
                                                  for n in names), dep)


def test_bundle_path_copies_the_missing_files_and_dpkg_installs_them_in_one_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    without = {p: v for p, v in HEAD.items() if p not in ("slurmd", "slurm-wlm-basic-plugins")}
    i = debs.install("node", without, has_index=False, bundle=_bundle_of(graph("node")), folder="/tmp/deb s")
    files = ["slurm-wlm-basic-plugins_22.05.8-4+deb12u3_amd64.deb", "slurmd_22.05.8-4+deb12u3_amd64.deb"]
    assert i.missing == ("slurm-wlm-basic-plugins", "slurmd") and i.folder == "/tmp/deb s"
    assert i.copies == tuple((tmp_path / "debs" / "bookworm-amd64" / f, f"/tmp/deb s/{f}") for f in files)
    assert i.script == GUARD.format(d="; d='/tmp/deb s'", rm='; rm -rf -- "$d"') + (
        f"DEBIAN_FRONTEND=noninteractive dpkg -i '/tmp/deb s/{files[0]}' '/tmp/deb s/{files[1]}'\n")
    with pytest.raises(errors.ClusterError, match="no package index and the head has no bundle"):
        debs.install("node", without, has_index=False)


def test_the_guard_forbids_daemons_during_the_install_and_is_gone_after_a_failure(tmp_path: Path) -> None:
    policy, folder = tmp_path / "policy-rc.d", tmp_path / "debs"
    folder.mkdir()
    policy.write_text("#!/bin/sh\nexit 0\n")  # the PC's own policy, put back after
    cmd = f'sh "$p" || echo "$?" > {tmp_path}/seen; exit 3'
    script = debs._guarded(cmd, str(folder)).replace(debs.POLICY, str(policy))
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    assert (tmp_path / "seen").read_text() == "101\n"  # invoke-rc.d refuses to start daemons meanwhile
    assert policy.read_text() == "#!/bin/sh\nexit 0\n" and not folder.exists()
    assert not (tmp_path / "policy-rc.d.clusterctl-saved").exists()
    policy.unlink()
    assert subprocess.run(["sh", "-c", script]).returncode == 3 and not policy.exists()


def test_build_refuses_another_release_with_the_fix() -> None:
    if debs.this_release() != ("bookworm", "amd64"):
        pytest.skip("recorded on Debian 12 amd64")
    with pytest.raises(errors.ClusterError, match="bookworm-amd64, the bundle asked for is trixie-amd64") as e:
        debs.build("trixie")
    assert "clusterctl debs export FILE" in (e.value.fix or "")


@pytest.fixture
def one_deb_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> debs.Bundle:
    """A real bundle of one small package, downloaded by apt-get (the Debian mirror) into the head's folder."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    if shutil.which("apt-get") is None or debs.this_release() != ("bookworm", "amd64"):
        pytest.skip("needs apt on Debian 12 amd64")
    c = debs.parse_show(subprocess.run(["apt-cache", "show", "--no-all-versions", "libmunge2"], text=True,
                                       capture_output=True).stdout)["libmunge2"]
    d = debs.bundle_dir("bookworm", "amd64")
    d.mkdir(parents=True)
    r = subprocess.run(["apt-get", "download", "-q", f"libmunge2={c.version}"], cwd=d, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"apt-get download cannot reach the mirror: {r.stderr.strip()[-200:]}")
    b = debs.Bundle("bookworm", "amd64", ({"package": "libmunge2", "version": c.version, "file": c.file,
                                           "sha256": c.sha256, "size": c.size},), graph("node"))
    (d / debs.MANIFEST).write_text(json.dumps(b.to_dict()))
    assert debs.load("bookworm", "amd64") == b and debs.bundles() == [b]
    return b


def test_export_then_import_verifies_every_sha256(tmp_path: Path, one_deb_bundle: debs.Bundle) -> None:
    tar = tmp_path / "usb" / "debs.tar"
    tar.parent.mkdir()
    report = debs_carry.export(one_deb_bundle, tar)
    assert report["file"] == str(tar) and report["debs"] == 1
    with tarfile.open(tar) as t:
        assert t.getnames() == [debs.MANIFEST, one_deb_bundle.debs[0]["file"]]
    assert debs_carry.import_file(tar) == (one_deb_bundle, "present")
    shutil.rmtree(debs.debs_root())
    assert debs_carry.import_file(tar) == (one_deb_bundle, "imported")
    assert debs.bundles() == [one_deb_bundle]


def _rewrite(src: Path, dest: Path, change: dict[str, bytes], extra: tuple[str, bytes] | None = None) -> None:
    import io

    with tarfile.open(src) as t, tarfile.open(dest, "w") as out:
        for m in t.getmembers():
            data = change.get(m.name, t.extractfile(m).read())  # type: ignore[union-attr]
            m.size = len(data)
            out.addfile(m, io.BytesIO(data))
        if extra:
            info = tarfile.TarInfo(extra[0])
            info.size = len(extra[1])
            out.addfile(info, io.BytesIO(extra[1]))


def test_import_refuses_a_mismatch_naming_the_file_and_changes_nothing(tmp_path: Path,
                                                                       one_deb_bundle: debs.Bundle) -> None:
    good = tmp_path / "good.tar"
    debs_carry.export(one_deb_bundle, good)
    name = one_deb_bundle.debs[0]["file"]
    data = (debs.bundle_dir("bookworm", "amd64") / name).read_bytes()
    bad = tmp_path / "bad.tar"
    _rewrite(good, bad, {name: bytes([data[0] ^ 1]) + data[1:]}, extra=("../evil.deb", b"x"))
    shutil.rmtree(debs.debs_root())
    with pytest.raises(debs_carry.ImportRefusedDebs) as e:
        debs_carry.import_file(bad)
    assert e.value.mismatches == [f"{name}: does not match its sha256 in the manifest",
                                  "'../evil.deb': not in the manifest"]
    assert not (tmp_path / "evil.deb").exists() and debs.bundles() == []
    assert [p.name for p in debs.debs_root().iterdir()] == []  # the staging folder is gone too


def test_a_manifest_naming_a_path_is_refused(tmp_path: Path, one_deb_bundle: debs.Bundle) -> None:
    doc = one_deb_bundle.to_dict()
    doc["debs"][0]["file"] = "../../etc/x.deb"
    with pytest.raises(errors.UsageError, match=r"m\.json: debs\[0\]: no valid file"):
        debs.parse_manifest(json.dumps(doc).encode(), "m.json")


def test_the_cli_lists_and_needs_an_action(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    assert main(["debs", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"dir": str(tmp_path / "debs"), "bundles": []}
    assert main(["debs"]) == errors.EXIT_USAGE
    assert main(["debs", "import", str(tmp_path / "none.tar")]) == errors.EXIT_USAGE
    assert main(["debs", "export", str(tmp_path / "x.tar")]) == errors.EXIT_USAGE  # no bundle to export
