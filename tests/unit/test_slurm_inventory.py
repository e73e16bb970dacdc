"""The inventory's `slurm:` section: a cluster's login node, reached like any host, and its defaults; every
error names the file, the line, the dotted field and the fix."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cluster.errors import InventoryError
from cluster.inventory import loader
from tests.conftest import write

# The shape agreed with the lab (cluster/lab writes exactly this), with a default user and key.
AGREED = """\
defaults: {user: student, ssh_config: none, known_hosts: ~/lab/known_hosts, connect_timeout: 7}
hosts:
  node1: {address: 10.77.0.11}
slurm:
  slurm:
    login: {address: 10.77.0.200}
    partition: debug
    account: null
    qos: null
    workdir: /srv/slurm-shared/clusterctl
    python: /opt/venv/bin/python
    env_setup: "module load pytorch/2.3"
"""


def error(tmp_path: Path, text: str, **kw: object) -> InventoryError:
    with pytest.raises(InventoryError) as e:
        loader.load(write(tmp_path, text), check_files=False, **kw)  # type: ignore[arg-type]
    return e.value


def test_the_agreed_section_parses_into_a_cluster(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, AGREED), check_files=False)
    c = inv.clusters["slurm"]
    assert (c.name, c.partition, c.account, c.qos, c.workdir, c.python, c.env_setup) == (
        "slurm", "debug", None, None, "/srv/slurm-shared/clusterctl", "/opt/venv/bin/python", "module load pytorch/2.3")
    # the login node is a host entry: what it does not set comes from `defaults`, as for every host
    assert (c.login.address, c.login.user, c.login.known_hosts, c.login.connect_timeout) == (
        "10.77.0.200", "student", "~/lab/known_hosts", 7.0)
    assert c.login.workdir == c.workdir and list(inv.hosts) == ["node1"]  # a login node is not a compute host
    assert c.to_dict()["login"]["address"] == "10.77.0.200"


def test_the_login_node_is_reached_through_jump_hosts_like_any_host(tmp_path: Path) -> None:
    text = AGREED.replace("login: {address: 10.77.0.200}",
                          "login: {address: login.hpc.example.edu, user: s123, proxy_jump: 'me@gate.example.edu:2222'}")
    c = loader.load(write(tmp_path, text), check_files=False).clusters["slurm"]
    assert [(j.user, j.address, j.port) for j in c.login.jumps] == [("me", "gate.example.edu", 2222)]
    assert c.login.route == "me@gate.example.edu:2222 -> s123@login.hpc.example.edu:22"


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client (ssh -G)")
def test_the_login_node_goes_through_the_openssh_config_as_hosts_do(tmp_path: Path) -> None:
    (tmp_path / "ssh_config").write_text("Host hpc\n  HostName login.hpc.example.edu\n  User s123\n  Port 2022\n"
                                         "  ProxyJump gate.example.edu\n")
    text = AGREED.replace("ssh_config: none", "ssh_config: ssh_config").replace("{address: 10.77.0.200}",
                                                                                "{address: hpc}")
    c = loader.load(write(tmp_path, text), check_files=False).clusters["slurm"]
    # the config where the inventory is silent; the inventory's own `user` (from defaults) wins, as for hosts
    assert (c.login.address, c.login.user, c.login.port) == ("login.hpc.example.edu", "student", 2022)
    assert [j.address for j in c.login.jumps] == ["gate.example.edu"]


def test_host_set_applies_to_the_login_node_as_to_every_host(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, AGREED), ["user=other"], check_files=False)
    assert inv.clusters["slurm"].login.user == "other" == inv.hosts["node1"].user


def test_an_inventory_of_a_cluster_alone_needs_no_hosts(tmp_path: Path) -> None:
    text = "slurm:\n  uni:\n    login: {address: login.example.edu}\n    workdir: /scratch/me/cc\n"
    inv = loader.load(write(tmp_path, text), check_files=False)
    assert inv.hosts == {} and inv.rank0 == "" and inv.clusters["uni"].python == "python3"
    assert inv.clusters["uni"].partition is None  # Slurm's default partition
    e = error(tmp_path, "name: x\n")
    assert "the inventory has no hosts" in str(e)


def test_an_ansible_group_called_slurm_stays_ansible(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, "slurm:\n  hosts:\n    n1: {ansible_host: 10.0.0.1}\n"), check_files=False,
                      reader="builtin")
    assert inv.format != "clusterctl" and list(inv.hosts) == ["n1"] and inv.clusters == {}


@pytest.mark.parametrize("edit, field, words", [
    (("    login: {address: 10.77.0.200}\n", ""), "slurm.slurm.login", "needs its login node"),
    (("{address: 10.77.0.200}", "{user: x}"), "slurm.slurm.login.address", "needs its address"),
    (("{address: 10.77.0.200}", "{address: 10.77.0.200, adress: x}"), "slurm.slurm.login.adress", "did you mean 'address'"),
    (("{address: 10.77.0.200}", "{address: 10.77.0.200, workdir: /x}"), "slurm.slurm.login.workdir", "no workdir of its own"),
    (("    partition: debug\n", "    partiton: debug\n"), "slurm.slurm.partiton", "did you mean 'partition'"),
    (("/srv/slurm-shared/clusterctl", "srv/slurm"), "slurm.slurm.workdir", "expected an absolute path"),
    (("/srv/slurm-shared/clusterctl", "'/srv/my jobs'"), "slurm.slurm.workdir", "cannot go on an #SBATCH line"),
    (("/srv/slurm-shared/clusterctl", "/srv/%u/jobs"), "slurm.slurm.workdir", "cannot go on an #SBATCH line"),
    (("/srv/slurm-shared/clusterctl", "/srv/../etc"), "slurm.slurm.workdir", "cannot go on an #SBATCH line"),
    (("    workdir: /srv/slurm-shared/clusterctl\n", ""), "slurm.slurm.workdir", "needs the folder its jobs use"),
    (("partition: debug", "partition: 'debug; rm'"), "slurm.slurm.partition", "expected a Slurm partition name"),
    (("qos: null", "qos: [a]"), "slurm.slurm.qos", "expected a Slurm qos name"),
    (("python: /opt/venv/bin/python", "python: ''"), "slurm.slurm.python", "expected a non-empty string"),
    (("env_setup: \"module load pytorch/2.3\"", "env_setup: 3"), "slurm.slurm.env_setup", "expected a non-empty string"),
    (("  slurm:\n    login", "  'my cluster':\n    login"), "slurm.my cluster", "cannot be used as a name"),
    (("slurm:\n  slurm:", "slurm: 3\nx:\n  slurm:"), None, None),
])
def test_section_errors_name_the_field_and_the_fix(tmp_path: Path, edit: tuple[str, str], field: str | None,
                                                    words: str | None) -> None:
    old, new = edit
    assert old in AGREED
    text = AGREED.replace(old, new, 1)
    if field is None:  # `slurm: 3` with an unknown top key: not clusterctl's schema at all, Ansible's answer
        with pytest.raises(Exception):
            loader.load(write(tmp_path, text), check_files=False, reader="builtin")
        return
    e = error(tmp_path, text)
    assert e.field == field and words in str(e) and e.fix, str(e)
    assert str(e).startswith(str(tmp_path / "inv.yaml")) and e.line is not None


def test_the_section_itself_must_be_a_mapping(tmp_path: Path) -> None:
    e = error(tmp_path, "hosts:\n  a: {address: 10.0.0.1}\nslurm: [uni]\n")
    assert e.field == "slurm" and "expected a mapping" in str(e)


def test_the_login_node_key_file_is_checked_as_a_host_key_is(tmp_path: Path) -> None:
    text = AGREED.replace("{address: 10.77.0.200}", f"{{address: 10.77.0.200, identity_file: {tmp_path / 'nokey'}}}")
    with pytest.raises(InventoryError) as e:
        loader.load(write(tmp_path, text))
    assert e.value.field == "slurm.slurm.login.identity_file" and "does not exist" in str(e.value)
    (tmp_path / "nokey").write_text("key")
    assert loader.load(write(tmp_path, text)).clusters["slurm"].login.identity_file == str(tmp_path / "nokey")
