"""The lab PCs' systemctl (cluster.lab.units) reads Debian's own unit files (copied from munge 0.5.15 and
slurm-wlm 22.05 into tests/fixtures/units) as systemd does: ExecStart with $VAR expansion, EnvironmentFile
with its `-`, Type, User, RuntimeDirectory, ConditionPathExists, [Install], and the boot order."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.lab import units

FIXTURES = Path(__file__).parent.parent / "fixtures" / "units"


@pytest.fixture
def unit_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fixtures as the PC's /lib/systemd/system, and an empty /etc/systemd/system of its own."""
    etc = tmp_path / "etc"
    etc.mkdir()
    monkeypatch.setattr(units, "UNIT_DIRS", (etc, FIXTURES))
    return etc


def test_munge_is_a_forking_unit_run_as_munge_with_its_runtime_directory(unit_dirs: Path) -> None:
    unit = units.find("munge.service")
    assert unit is not None
    assert (unit.get("Type"), unit.get("User"), unit.get("Group")) == ("forking", "munge", "munge")
    assert (unit.get("RuntimeDirectory"), unit.get("RuntimeDirectoryMode")) == ("munge", "0755")
    assert unit.get("PIDFile") == "/run/munge/munged.pid"
    assert unit.all("Service", "EnvironmentFile") == ["-/etc/default/munge"]
    assert unit.command({"OPTIONS": "--num-threads=2  --force"}) == ["/usr/sbin/munged", "--num-threads=2", "--force"]
    assert unit.command({}) == ["/usr/sbin/munged"]  # an unset $OPTIONS is no word at all
    assert unit.installed_in() == ["multi-user.target.wants"]
    assert unit.all("Unit", "After") == ["network-online.target", "time-sync.target"]  # each line kept


def test_slurmd_and_slurmctld_are_simple_units_that_need_slurm_conf(unit_dirs: Path) -> None:
    for name, daemon, options in (("slurmd", "/usr/sbin/slurmd", "SLURMD_OPTIONS"),
                                  ("slurmctld", "/usr/sbin/slurmctld", "SLURMCTLD_OPTIONS")):
        unit = units.find(f"{name}.service")
        assert unit is not None
        assert unit.get("Type", "simple") == "simple" and unit.get("User") == ""  # root, in the foreground
        assert unit.command({options: "-N node1"}) == [daemon, "-D", "-s", "-N", "node1"]
        assert unit.all("Unit", "ConditionPathExists") == ["/etc/slurm/slurm.conf"]
        assert unit.get("PIDFile") == f"/run/{name}.pid"


def test_conditions_environment_files_and_braced_variables(tmp_path: Path) -> None:
    present = tmp_path / "here"
    present.touch()
    envfile = tmp_path / "default"
    envfile.write_text('# comment\nOPTIONS="--key-file /k"\nEMPTY=\n')
    text = (f"[Unit]\nConditionPathExists={present}\nConditionPathExists=!{tmp_path / 'absent'}\n"
            f"[Service]\nEnvironmentFile=-{tmp_path / 'missing'}\nEnvironmentFile={envfile}\n"
            "Environment=\"A=x y\" B=z\nExecStart=-/bin/echo ${A} $A $OPTIONS pre$B\n")
    (tmp_path / "t.service").write_text(text)
    unit = units.Unit("t.service", tmp_path / "t.service")
    assert unit.conditions_met()
    env = unit.environment()
    assert (env["A"], env["B"], env["OPTIONS"], env["EMPTY"]) == ("x y", "z", "--key-file /k", "")
    assert unit.command(env) == ["/bin/echo", "x y", "x", "y", "--key-file", "/k", "prez"]
    (tmp_path / "absent").touch()
    assert not unit.conditions_met()
    envfile.unlink()
    with pytest.raises(units.UnitError, match="EnvironmentFile"):  # without `-`, a missing file fails the start
        unit.environment()


def test_enable_disable_is_enabled_and_the_boot_order(unit_dirs: Path) -> None:
    assert units.enablement("munge.service") == "disabled"
    for name in ("slurmd.service", "munge.service", "slurmctld.service"):
        units.enable(name)
    link = unit_dirs / "multi-user.target.wants" / "munge.service"
    assert link.is_symlink() and link.resolve() == (FIXTURES / "munge.service").resolve()
    assert units.enablement("munge.service") == "enabled"
    assert units.boot_order()[0] == "munge.service"  # slurmd and slurmctld are After=munge.service
    units.disable("slurmd.service")
    assert units.enablement("slurmd.service") == "disabled" and "slurmd.service" not in units.boot_order()
    with pytest.raises(units.UnitError, match="No such file"):
        units.enablement("nosuch.service")
    with pytest.raises(units.UnitError) as e:
        units.need("nosuch.service")
    assert e.value.code == 5


def test_verbs_exit_codes_and_power_without_a_switch(unit_dirs: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(units, "STATE", tmp_path / "run")
    assert units.main(["systemctl", "is-active", "munge"]) == 3 and capsys.readouterr().out == "inactive\n"
    assert units.main(["systemctl", "is-active", "--quiet", "nosuch"]) == 3 and capsys.readouterr().out == ""
    assert units.main(["systemctl", "is-enabled", "munge"]) == 1
    assert units.main(["systemctl", "daemon-reload"]) == 0 and units.main(["systemctl", "reset-failed"]) == 0
    assert units.main(["systemctl", "--bogus", "start", "munge"]) == 1
    assert units.main(["systemctl", "frobnicate", "munge"]) == 1
    capsys.readouterr()
    assert units.main(["systemctl", "poweroff"]) == 1 and "no power switch" in capsys.readouterr().err
    assert units.main(["/usr/sbin/halt"]) == 1  # the gateway's: SWITCH is empty


def test_at_a_lab_pcs_power_on_slurmd_reports_a_boot(unit_dirs: Path) -> None:
    """A lab PC shares this machine's kernel and boot time: slurmd is told it booted (-b), as slurmctld's
    power saving waits for a resumed node's new boot."""
    slurmd, munge = units.need("slurmd.service"), units.need("munge.service")
    assert slurmd.command(units.boot_env("slurmd.service", {"SLURMD_OPTIONS": "-N n1"}))[-3:] == ["-N", "n1", "-b"]
    assert slurmd.command(units.boot_env("slurmd.service", {}))[-1] == "-b"
    assert munge.command(units.boot_env("munge.service", {})) == ["/usr/sbin/munged"]
