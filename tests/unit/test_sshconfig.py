"""OpenSSH's client config as OpenSSH reads it (`ssh -G`, the real program): Host and Match blocks,
Include, the inventory winning over the file, jump hosts resolved hop by hop, what is not followed."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cluster.errors import InventoryError
from cluster.inventory import loader, sshconfig
from cluster.inventory.model import Host

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's ssh (openssh-client)")


def inventory(tmp_path: Path, config: str, hosts: str, defaults: str = "") -> dict[str, Host]:
    (tmp_path / "ssh_config").write_text(config)
    (tmp_path / "inv.yaml").write_text(f"defaults:\n  ssh_config: {tmp_path / 'ssh_config'}\n{defaults}hosts:\n{hosts}")
    return loader.load(tmp_path / "inv.yaml").hosts


CONFIG = """\
Host gw
  HostName 10.9.0.1
  User admin
  IdentityFile {key}
Host pc*
  User bob
  Port 40005
  ProxyJump gw
  IdentityFile {key}
  UserKnownHostsFile {kh}
Include {more}
"""


def test_host_blocks_include_and_match_are_read_as_openssh_reads_them(tmp_path: Path) -> None:
    key, kh = tmp_path / "lab_key", tmp_path / "kh"
    key.write_text("not read here")
    (tmp_path / "more.conf").write_text("Match host pc03\n  HostKeyAlias pc03-key\nMatch user carol\n  Port 2222\n")
    hosts = inventory(tmp_path, CONFIG.format(key=key, kh=kh, more=tmp_path / "more.conf"),
                      "  pc01: {}\n  pc03: {}\n  other: {address: 10.0.0.5}\n")
    pc01 = hosts["pc01"]
    assert (pc01.address, pc01.user, pc01.port, pc01.identity_file, pc01.known_hosts) == ("pc01", "bob", 40005,
                                                                                         str(key), str(kh))
    assert [(j.address, j.user, j.port, j.identity_file) for j in pc01.jumps] == [("10.9.0.1", "admin", 22, str(key))]
    assert pc01.jumps[0].known_hosts == str(kh)  # the node's: the config sets none for gw
    assert hosts["pc03"].host_key_alias == "pc03-key" and hosts["pc03"].host_key_name == "pc03-key"  # from Include
    other = hosts["other"]
    assert (other.port, other.jumps, other.identity_file, other.host_key_alias) == (22, (), None, None)


def test_the_inventory_wins_and_match_user_sees_its_user(tmp_path: Path) -> None:
    (tmp_path / "more.conf").write_text("Match user carol\n  Port 2222\n")
    hosts = inventory(tmp_path, CONFIG.format(key="~/.ssh/none", kh="~/.ssh/kh", more=tmp_path / "more.conf"),
                      "  pc01: {port: 22, user: alice}\n  pc02: {user: carol, proxy_jump: none}\n")
    assert (hosts["pc01"].port, hosts["pc01"].user) == (22, "alice")  # the inventory's, though the config differs
    assert hosts["pc02"].port == 40005  # `Host pc*` came first: OpenSSH keeps the first value it obtains
    assert hosts["pc02"].jumps == ()  # the inventory's proxy_jump: none overrides the config's ProxyJump


def test_several_hops_and_a_hops_own_jump_host(tmp_path: Path) -> None:
    config = ("Host inner\n  HostName 172.16.0.2\n  ProxyJump outer\n"
              "Host outer\n  HostName 10.0.0.1\n  Port 2201\n"
              "Host n1\n  ProxyJump inner,u@10.1.0.1:2222\n")
    n1 = inventory(tmp_path, config, "  n1: {}\n")["n1"]
    assert [(j.address, j.port, j.user if j.user == "u" else "-") for j in n1.jumps] == [
        ("10.0.0.1", 2201, "-"), ("172.16.0.2", 22, "-"), ("10.1.0.1", 2222, "u")]
    assert n1.route.endswith(f"{n1.user}@n1:22") and n1.route.count("->") == 3


def test_strict_host_key_checking_off_is_not_followed_and_said_once(tmp_path: Path) -> None:
    (tmp_path / "ssh_config").write_text("Host *\n  StrictHostKeyChecking accept-new\n")
    (tmp_path / "inv.yaml").write_text(f"defaults:\n  ssh_config: {tmp_path / 'ssh_config'}\n"
                                      "hosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.2}\n")
    inv = loader.load(tmp_path / "inv.yaml")
    assert len(inv.notes) == 1 and "StrictHostKeyChecking accept-new is not followed" in inv.notes[0]


def test_a_file_openssh_refuses_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="OpenSSH refuses") as e:
        inventory(tmp_path, "Host a\n  NoSuchOption yes\n", "  a: {}\n")
    assert "line 2: bad configuration option: nosuchoption" in str(e.value).lower() and "ssh_config" in str(e.value)


def test_without_an_ssh_program_a_config_is_refused_not_half_read(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sshconfig.shutil, "which", lambda name: None)
    with pytest.raises(InventoryError, match="no `ssh` program") as e:
        inventory(tmp_path, "Host a\n  Port 2\n", "  a: {}\n")
    assert "openssh-client" in str(e.value)


def test_none_reads_no_file_and_a_local_host_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "inv.yaml").write_text("hosts:\n  a: {address: 10.0.0.1, ssh_config: none, proxy_jump: 'u@gw:2,gw2'}\n"
                                      "  b: {connection: local}\n")
    hosts = loader.load(tmp_path / "inv.yaml").hosts
    assert [(j.user, j.address, j.port) for j in hosts["a"].jumps][0] == ("u", "gw", 2)
    assert hosts["a"].jumps[1].address == "gw2" and hosts["b"].jumps == ()
    (tmp_path / "inv.yaml").write_text("hosts:\n  a: {address: 10.0.0.1, ssh_config: none, proxy_jump: none}\n")
    assert loader.load(tmp_path / "inv.yaml").hosts["a"].jumps == ()  # `none`: no jump host, as in OpenSSH


@pytest.mark.parametrize("spec, hops", [
    ("gw", [(None, "gw", None)]),
    ("u@gw:2222,ssh://v@10.0.0.1:22", [("u", "gw", 2222), ("v", "10.0.0.1", 22)]),
    ("[fe80::1]:2200", [(None, "fe80::1", 2200)]),
])
def test_proxy_jump_hops(spec: str, hops: list[tuple[str | None, str, int | None]]) -> None:
    assert sshconfig.hops(spec) == hops


@pytest.mark.parametrize("spec", ["", "a b", "u@", "gw:99999", "gw:22:33"])
def test_bad_hops_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        sshconfig.hops(spec)


def test_proxy_command_tokens_are_expanded_and_quoted() -> None:
    h = Host(name="pc1", address="10.0.0.7", port=2222, user="bob")
    assert sshconfig.expand_proxy_command("ssh -W %h:%p -l %r gw # %n %%", h, "pc1") == \
        "ssh -W 10.0.0.7:2222 -l bob gw # pc1 %"
    with pytest.raises(ValueError, match="%C"):
        sshconfig.expand_proxy_command("nc %C", h, "pc1")


def test_dash_f_names_the_config_for_every_host(tmp_path: Path) -> None:
    """`-F FILE` on any command reading an inventory, as `ssh -F`: `clusterctl hosts` shows what it resolved."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "cfg").write_text("Host pc*\n  Port 40005\n  User bob\n  ProxyJump admin@gw\n")
    (tmp_path / "inv.yaml").write_text("hosts:\n  pc1: {}\n  pc2: {port: 22}\n")
    r = subprocess.run([sys.executable, "-m", "cluster", "hosts", "-i", str(tmp_path / "inv.yaml"), "-F",
                        str(tmp_path / "cfg"), "--json"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    got = {h["name"]: h for h in json.loads(r.stdout)["hosts"]}
    assert (got["pc1"]["port"], got["pc1"]["user"], got["pc2"]["port"]) == (40005, "bob", 22)
    assert "admin@gw:22" in json.dumps(got["pc1"])


def test_a_relative_ssh_config_is_the_inventorys_neighbour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "ssh_config").write_text("Host pc1\n  Port 2201\n")
    (tmp_path / "lab" / "inv.yaml").write_text("defaults:\n  ssh_config: ssh_config\nhosts:\n  pc1: {}\n")
    monkeypatch.chdir(tmp_path)  # not where the inventory is
    assert loader.load(tmp_path / "lab" / "inv.yaml").hosts["pc1"].port == 2201
