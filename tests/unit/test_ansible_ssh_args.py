"""Ansible's extra ssh arguments (ansible_ssh_common_args / _extra_args) read as `ssh` reads them: jump hosts,
a ProxyCommand (DeepOps' bastion line), a config file; anything that would connect differently is refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.errors import InventoryError
from cluster.inventory import ansible, ansible_core, loader

READERS = ["builtin", pytest.param("ansible", marks=pytest.mark.skipif(
    not ansible_core.available(), reason="ansible-core is not installed (pip install clusterctl[ansible])"))]


def load(tmp_path: Path, var: str, reader: str):
    (tmp_path / "inv.yaml").write_text("all:\n  vars:\n    clusterctl_ssh_config: none\n"
                                      f"    ansible_ssh_common_args: {var}\n"
                                      "  hosts:\n    pc1: {ansible_host: 10.0.0.11}\n")
    return loader.load(tmp_path / "inv.yaml", check_files=False, reader=reader).hosts["pc1"]


@pytest.mark.parametrize("reader", READERS)
def test_proxy_jump_and_proxy_command_become_the_route(tmp_path: Path, reader: str) -> None:
    pc1 = load(tmp_path, "'-o ProxyJump=student@gw:2222 -o StrictHostKeyChecking=no'", reader)
    assert [(j.user, j.address, j.port) for j in pc1.jumps] == [("student", "gw", 2222)]
    pc1 = load(tmp_path, "'-J gw1,gw2'", reader)
    assert [j.address for j in pc1.jumps] == ["gw1", "gw2"]
    pc1 = load(tmp_path, """'-o ProxyCommand="ssh -W %h:%p -q admin@bastion"'""", reader)
    assert pc1.proxy_command == "ssh -W %h:%p -q admin@bastion" and pc1.jumps == ()


@pytest.mark.parametrize("text, fields", [
    ("-o ProxyJump=gw", {"proxy_jump": "gw"}),
    ("-J u@gw -F /etc/lab/ssh_config -i ~/.ssh/lab -p 2200 -l bob",
     {"proxy_jump": "u@gw", "ssh_config": "/etc/lab/ssh_config", "identity_file": "~/.ssh/lab", "port": "2200",
      "user": "bob"}),
    ("-o 'ProxyCommand ssh -W %h:%p gw' -oHostKeyAlias=pc1 -o UserKnownHostsFile=/k",
     {"proxy_command": "ssh -W %h:%p gw", "host_key_alias": "pc1", "known_hosts": "/k"}),
    ("-C -q -o ControlMaster=auto -o ControlPersist=60s -o StrictHostKeyChecking=accept-new", {}),
])
def test_ssh_args_as_ssh_reads_them(text: str, fields: dict[str, str]) -> None:
    assert ansible.ssh_args_fields(text) == fields


@pytest.mark.parametrize("text", ["-L 8080:localhost:80", "-o LocalForward=8080", "-J", "-R 9000:x:9000", "--weird"])
def test_other_ssh_args_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        ansible.ssh_args_fields(text)


@pytest.mark.parametrize("reader", READERS)
def test_a_refused_argument_names_the_variable(tmp_path: Path, reader: str) -> None:
    with pytest.raises(InventoryError) as e:
        load(tmp_path, "'-L 8080:localhost:80'", reader)
    assert e.value.field == "pc1.ansible_ssh_common_args" and "-L" in str(e.value)


@pytest.mark.parametrize("reader", READERS)
def test_ansible_become_is_sudo_as_root_only(tmp_path: Path, reader: str) -> None:
    def host(extra: str):
        (tmp_path / "inv.yaml").write_text(f"all:\n  vars:\n    clusterctl_ssh_config: none\n{extra}"
                                          "  hosts:\n    pc1: {ansible_host: 10.0.0.11}\n")
        return loader.load(tmp_path / "inv.yaml", check_files=False, reader=reader).hosts["pc1"]

    assert host("    ansible_become: true\n").become is True
    assert host("").become is False
    with pytest.raises(InventoryError) as e:
        host("    ansible_become: true\n    ansible_become_method: su\n")
    assert e.value.field == "pc1.ansible_become_method" and "sudo -n" in str(e.value)
