from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cluster.inventory import ansible_core, loader, model
from cluster.errors import InventoryError
from tests.conftest import ROOT, write

GOOD = """\
name: b204
rank0: pc2
defaults:
  user: student
  workdir: /srv/cluster
  vars: {dataset: digits, epochs: 3}
groups:
  gpu:
    hosts: [pc1, pc2]
    user: gpuuser
    gpu: {count: 1, model: GTX 1050 Ti, compute_capability: "6.1"}
    vars: {epochs: 5}
hosts:
  pc1:
    address: 192.168.1.11
  pc2:
    address: 192.168.1.12
    user: alice
    vars: {epochs: 7}
  pc3:
    address: 192.168.1.13
    port: 2222
    gpu: none
"""


def test_layers_defaults_group_host_cli(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, GOOD), overrides=["vars.epochs=9", "port=2200"])
    pc1, pc2, pc3 = inv.hosts["pc1"], inv.hosts["pc2"], inv.hosts["pc3"]
    assert (pc1.user, pc2.user, pc3.user) == ("gpuuser", "alice", "student")  # group < host
    assert pc1.workdir == "/srv/cluster"  # defaults
    assert pc1.vars == {"dataset": "digits", "epochs": 9}  # command line wins over everything
    assert {h.port for h in inv.hosts.values()} == {2200}
    assert pc1.gpu == model.GpuSpec(1, "GTX 1050 Ti", "6.1")
    assert pc3.gpu == model.GpuSpec(0)
    assert inv.rank0 == "pc2"
    assert [h.name for h in inv.ordered(inv.hosts.values())] == ["pc2", "pc1", "pc3"]
    assert pc1.groups == ("gpu",)


def test_layers_without_cli(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, GOOD))
    assert inv.hosts["pc1"].vars["epochs"] == 5 and inv.hosts["pc2"].vars["epochs"] == 7
    assert inv.hosts["pc3"].vars["epochs"] == 3 and inv.hosts["pc3"].port == 2222


def test_select_limit(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, GOOD))
    assert [h.name for h in inv.select("gpu")] == ["pc1", "pc2"]
    assert [h.name for h in inv.select("pc3,pc1")] == ["pc1", "pc3"]
    assert [h.name for h in inv.select("pc*")] == ["pc1", "pc2", "pc3"]
    with pytest.raises(InventoryError, match="'nope' matches no host or group"):
        inv.select("nope")


def _error(tmp_path: Path, text: str, **kw: Any) -> InventoryError:
    with pytest.raises(InventoryError) as exc:
        loader.load(write(tmp_path, text), **kw)
    return exc.value


def test_unknown_key_names_line_field_and_suggestion(tmp_path: Path) -> None:
    e = _error(tmp_path, "hosts:\n  pc1:\n    address: 10.0.0.1\n    wrokdir: /x\n")
    assert (e.line, e.field) == (4, "hosts.pc1.wrokdir")
    assert "unknown key" in str(e) and "did you mean 'workdir'" in str(e)
    assert str(e).startswith(f"{tmp_path / 'inv.yaml'}:4:")


def test_wrong_type(tmp_path: Path) -> None:
    e = _error(tmp_path, "hosts:\n  pc1:\n    address: 10.0.0.1\n    port: twenty-two\n")
    assert (e.line, e.field) == (4, "hosts.pc1.port")
    assert "expected a port number" in str(e) and "port: 22" in str(e)
    e = _error(tmp_path, "defaults:\n  connect_timeout: -1\nhosts:\n  a: {address: x}\n")
    assert (e.line, e.field) == (2, "defaults.connect_timeout")
    e = _error(tmp_path, "hosts:\n  a:\n    address: [1, 2]\n")
    assert e.field == "hosts.a.address" and "expected a non-empty string, got a list" in str(e)



def test_a_nul_byte_in_a_value_is_refused_naming_where(tmp_path: Path) -> None:
    """A NUL reaches no argv or file name (Python raises ValueError at the first subprocess or os call): found
    by the generated `--set user=\\0`, which ended in a traceback."""
    e = _error(tmp_path, 'hosts:\n  pc1:\n    address: 10.0.0.1\n    user: "a\\0b"\n')
    assert (e.line, e.field) == (4, "hosts.pc1.user") and "NUL byte" in str(e)
    e = _error(tmp_path, 'hosts:\n  pc1:\n    address: 10.0.0.1\n    vars: {a: [1, "x\\0"]}\n')
    assert e.field == "hosts.pc1.vars.a[1]" and "NUL byte" in str(e)
    write(tmp_path, "hosts:\n  pc1: {address: 10.0.0.1}\n")
    for override, field in (("user=\0", "--set user"), ("identity_file=\0", "--set identity_file"),
                            ("vars.x=a\0", "--set vars.x")):
        with pytest.raises(InventoryError, match="NUL byte") as got:
            loader.load(tmp_path / "inv.yaml", overrides=[override])
        assert got.value.field == field and str(got.value).startswith("command line")

def test_duplicate_host(tmp_path: Path) -> None:
    e = _error(tmp_path, "hosts:\n  pc1:\n    address: 10.0.0.1\n  pc1:\n    address: 10.0.0.2\n")
    assert (e.line, e.field) == (4, "hosts.pc1")
    assert "duplicate host 'pc1' (first defined on line 2)" in str(e)


def test_the_address_defaults_to_the_name_as_in_ansible(tmp_path: Path) -> None:
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  pc1:\n    user: bob\n    ssh_config: none\n")
    assert loader.load(p).hosts["pc1"].address == "pc1"


def test_unreadable_key_file(tmp_path: Path) -> None:
    e = _error(tmp_path, "defaults:\n  identity_file: /nonexistent/id_ed25519\nhosts:\n  a: {address: x}\n")
    assert (e.line, e.field) == (2, "defaults.identity_file")
    assert "does not exist" in str(e) and "ssh-keygen" in str(e)
    key = tmp_path / "key"
    key.write_text("secret")
    key.chmod(0)
    if os.geteuid() != 0:  # root reads anything: only the missing-file case applies there
        e = _error(tmp_path, f"hosts:\n  a:\n    address: x\n    identity_file: {key}\n")
        assert "not readable" in str(e)
    # parsing alone (as tests of example inventories do) does not look at key files
    loader.load(write(tmp_path, "defaults:\n  identity_file: /nonexistent/k\nhosts:\n  a: {address: x}\n"),
                   check_files=False)


def test_yaml_syntax_error(tmp_path: Path) -> None:
    e = _error(tmp_path, "hosts:\n  pc1:\n    address: 10.0.0.1\n   port: 22\n")
    assert e.line == 4 and "YAML syntax error" in str(e) and "indentation" in str(e)


def test_other_errors(tmp_path: Path) -> None:
    assert "no hosts" in str(_error(tmp_path, "name: x\n"))
    e = _error(tmp_path, "rank0: pc9\nhosts:\n  pc1: {address: a}\n")
    assert e.field == "rank0" and "use one of: pc1" in str(e)
    e = _error(tmp_path, "groups:\n  g: {hosts: [pc2]}\nhosts:\n  pc1: {address: a}\n")
    assert e.field == "groups.g.hosts" and "'pc2' is not defined" in str(e)
    e = _error(tmp_path, "defaults:\n  address: 1.2.3.4\nhosts:\n  pc1: {address: a}\n")
    assert e.field == "defaults.address"
    e = _error(tmp_path, "hosts:\n  pc1: {address: a, gpu: {count: two}}\n")
    assert e.field == "hosts.pc1.gpu.count"
    with pytest.raises(InventoryError, match="cannot read inventory"):
        loader.load(tmp_path / "missing.yaml")
    with pytest.raises(InventoryError, match="unknown field"):
        loader.load(write(tmp_path, "hosts:\n  a: {address: x}\n"), overrides=["colour=red"])


ANSIBLE = """\
all:
  vars:
    ansible_user: student
    clusterctl_workdir: /srv/cluster
    dataset: digits
  hosts:
    head:
      ansible_host: 10.0.0.1
      clusterctl_rank0: true
  children:
    gpu:
      vars:
        ansible_ssh_private_key_file: ~/.ssh/lab_key
        batch: 32
      hosts:
        pc1:
          ansible_host: 10.0.0.11
        pc2:
          ansible_host: 10.0.0.12
          ansible_port: 2222
          ansible_python_interpreter: /usr/bin/python3.11
    cpu:
      hosts:
        pc3:
        pc2:
          batch: 16
"""


READERS = ["builtin", pytest.param("ansible", marks=pytest.mark.skipif(
    not ansible_core.available(), reason="ansible-core is not installed (pip install clusterctl[ansible])"))]


@pytest.mark.parametrize("reader", READERS)
def test_ansible_inventory(tmp_path: Path, reader: str) -> None:
    inv = loader.load(write(tmp_path, ANSIBLE), check_files=False, reader=reader)
    assert inv.format == "ansible"
    assert list(inv.hosts) == ["head", "pc1", "pc2", "pc3"]  # the order hosts first appear
    assert inv.rank0 == "head"
    # as Ansible: `head` is only in `all`, so in `ungrouped`; members in inventory order
    assert inv.groups == {"ungrouped": ("head",), "gpu": ("pc1", "pc2"), "cpu": ("pc2", "pc3")}
    pc2 = inv.hosts["pc2"]
    assert (pc2.address, pc2.port, pc2.user, pc2.python) == ("10.0.0.12", 2222, "student", "/usr/bin/python3.11")
    assert pc2.identity_file == "~/.ssh/lab_key" and pc2.workdir == "/srv/cluster"
    assert pc2.vars == {"dataset": "digits", "batch": 16}  # later group's host entry wins
    assert inv.hosts["pc1"].vars == {"dataset": "digits", "batch": 32}
    assert inv.hosts["pc3"].address == "pc3"  # no ansible_host: the name is the address, as in Ansible
    assert set(pc2.groups) == {"gpu", "cpu"}


@pytest.mark.parametrize("reader", READERS)
def test_ansible_bad_clusterctl_field(tmp_path: Path, reader: str) -> None:
    e = _error(tmp_path, "all:\n  hosts:\n    a:\n      clusterctl_wrkdir: /x\n", check_files=False, reader=reader)
    assert (e.line, e.field) == (4, "a.clusterctl_wrkdir")
    assert e.file == str(tmp_path / "inv.yaml")


def test_example_lab_inventory_parses() -> None:
    """The example of a real lab is parsed, never connected to."""
    inv = loader.load(ROOT / "inventory" / "lab.yaml", check_files=False)
    assert len(inv.hosts) == 4 and inv.rank0 == "pc1"
    assert [h.gpu.count if h.gpu else None for h in inv.hosts.values()] == [1, 1, 1, 0]
    assert all(h.gpu and h.gpu.compute_capability == "6.1" for h in inv.select("gpu"))
    assert inv.hosts["pc4"].port == 2222 and inv.hosts["pc4"].host_key_name == "[192.168.1.14]:2222"


def test_local_inventory_parses() -> None:
    inv = loader.load(ROOT / "inventory" / "local.yaml")
    assert {h.connection for h in inv.hosts.values()} == {"local"}
    assert all(os.path.isabs(h.workdir) for h in inv.hosts.values())
    assert len({h.workdir for h in inv.hosts.values()}) == 2


def test_ssh_home_relative_workdir(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, "hosts:\n  a: {address: x, workdir: ~/cluster}\n"))
    assert inv.hosts["a"].workdir == "cluster"  # remote commands start in the login directory


# --------------------------------------------------------------------------- names, encodings, workdir (issue 11)


@pytest.mark.parametrize("text, field", [
    ('hosts:\n  "pc1\\ntouch /tmp/x": {address: a}\n', 'hosts.pc1\ntouch /tmp/x'),
    ("hosts:\n  ../../evil: {address: a}\n", "hosts.../../evil"),
    ("hosts:\n  a/b: {address: a}\n", "hosts.a/b"),
    ("name: ../../outside\nhosts:\n  pc1: {address: a}\n", "name"),
    ('name: "lab\\u0007"\nhosts:\n  pc1: {address: a}\n', "name"),
])
def test_names_that_would_become_paths_or_commands_are_refused(tmp_path: Path, text: str, field: str) -> None:
    """Host names and the inventory name become file names on the head and words in sourced files."""
    e = _error(tmp_path, text, check_files=False)
    assert e.field == field and e.line is not None and "cannot be used as a name" in str(e)


@pytest.mark.parametrize("reader", READERS)
def test_ansible_host_name_with_a_newline_is_refused(tmp_path: Path, reader: str) -> None:
    e = _error(tmp_path, 'all:\n  hosts:\n    "pc1\\nreboot":\n      ansible_host: 10.0.0.1\n',
               check_files=False, reader=reader)
    assert "cannot be used as a name" in str(e) or "install clusterctl[ansible]" in str(e)


def test_unsafe_file_name_gives_no_default_name(tmp_path: Path) -> None:
    bad = tmp_path / "my lab.yaml"
    bad.write_text("hosts:\n  pc1: {address: a}\n")
    with pytest.raises(InventoryError, match="rename the inventory file"):
        loader.load(bad)


def test_non_utf8_inventory_is_exit_2_with_its_line(tmp_path: Path) -> None:
    p = tmp_path / "inv.yaml"
    p.write_bytes(b"hosts:\n  pc1:\n    address: caf\xe9\n")
    with pytest.raises(InventoryError) as exc:
        loader.load(p)
    assert exc.value.line == 3 and "not UTF-8" in str(exc.value) and exc.value.exit_code == 2


def test_list_as_yaml_key_is_exit_2_with_its_line(tmp_path: Path) -> None:
    e = _error(tmp_path, "hosts:\n  pc1:\n    ? [a, b]\n    : 1\n")
    assert e.line == 3 and "YAML syntax error" in str(e) and "as a key" in str(e)


def test_cli_gives_exit_2_not_a_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    p = tmp_path / "inv.yaml"
    p.write_bytes(b"hosts:\n  pc1: {address: \xff}\n")
    q = write(tmp_path, "hosts:\n  ? [x]\n  : {address: a}\n", name="list.yaml")
    for inv in (p, q):
        r = subprocess.run([sys.executable, "-m", "cluster", "check", str(inv)], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        assert r.returncode == 2 and "Traceback" not in r.stderr and str(inv) in r.stderr + r.stdout


def test_workdir_in_the_login_users_home(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, "hosts:\n  a: {address: x, user: student, workdir: ~student/cluster}\n"))
    assert inv.hosts["a"].workdir == "cluster"  # the login directory of student: not `student/cluster`


def test_workdir_in_another_users_home_is_refused(tmp_path: Path) -> None:
    e = _error(tmp_path, "defaults:\n  workdir: ~student/cluster\nhosts:\n  a: {address: x, user: bob}\n")
    assert (e.line, e.field) == (2, "defaults.workdir")
    assert "home of 'student'" in str(e) and "/home/student/cluster" in str(e)


def test_workdir_tilde_user_on_a_local_node_is_that_users_home(tmp_path: Path) -> None:
    import pwd

    me = pwd.getpwuid(os.getuid())
    inv = loader.load(write(tmp_path, f"hosts:\n  a: {{address: x, connection: local, workdir: ~{me.pw_name}/c}}\n"))
    assert inv.hosts["a"].workdir == os.path.join(me.pw_dir, "c")


def test_builtin_reader_refuses_what_it_cannot_read_exactly(tmp_path: Path) -> None:
    cases = {
        "all:\n  hosts:\n    pc[1:3]:\n": "a host range",
        "all:\n  hosts:\n    pc1:2222:\n": "host:port",
        "all:\n  vars:\n    ansible_user: '{{ u }}'\n  hosts:\n    pc1:\n": "Jinja",
        "all:\n  hosts:\n    pc1:\n  host:\n    pc2:\n": "key 'host' in a group",
        "plugin: aws_ec2\n": "inventory plugin configuration",
        "all:\n  hosts:\n    pc1:\n    pc1:\n": "written twice",
        "lab:\n  hosts:\n    lab:\n": "both a host and a group",
    }
    for text, feature in cases.items():
        e = _error(tmp_path, text, check_files=False, reader="builtin")
        assert feature in str(e) and "install clusterctl[ansible]" in str(e) and e.line, text
    (tmp_path / "hosts.ini").write_text("[lab]\npc1\n")
    with pytest.raises(InventoryError, match="INI"):
        loader.load(tmp_path / "hosts.ini", reader="builtin")
    (tmp_path / "host_vars").mkdir()
    with pytest.raises(InventoryError, match="host_vars/ beside the inventory"):
        loader.load(write(tmp_path, "all:\n  hosts:\n    pc1:\n"), reader="builtin")


@pytest.mark.parametrize("text, field, message", [
    ("connect_timeout: .nan", "connect_timeout", "expected a finite number > 0 and <= 600, got nan"),
    ("connect_timeout: .inf", "connect_timeout", "expected a finite number > 0 and <= 600, got inf"),
    ("connect_timeout: 601", "connect_timeout", "expected a number <= 600, got 601"),
    ("command_timeout: .inf", "command_timeout", "expected a finite number > 0 and <= 86400, got inf"),
    ("command_timeout: -.inf", "command_timeout", "expected a finite number > 0 and <= 86400, got -inf"),
    ("command_timeout: 86401", "command_timeout", "expected a number <= 86400, got 86401"),
    ("port: .nan", "port", "expected a port number 1-65535, got nan"),
    ("gpu: {count: .nan}", "gpu.count", "expected a whole number >= 0 and <= 64, got nan"),
    ("gpu: {count: 65}", "gpu.count", "expected a whole number <= 64, got 65"),
    ("gpu: {compute_capability: nan}", "gpu.compute_capability", "expected a number like \"6.1\""),
    ("gpu: {compute_capability: \"inf\"}", "gpu.compute_capability", "expected a number like \"6.1\""),
])
def test_numbers_must_be_finite_and_within_their_bounds(tmp_path: Path, text: str, field: str, message: str) -> None:
    """NaN passed `value <= 0` (then a traceback, exit 70, where a socket got it); infinity removed the bound."""
    e = _error(tmp_path, f"defaults:\n  {text}\nhosts:\n  a: {{address: x}}\n", check_files=False)
    assert (e.line, e.field, e.exit_code) == (2, f"defaults.{field}", 2)
    assert message in str(e) and e.fix and "e.g." in e.fix


def test_numbers_set_on_the_command_line_pass_the_same_check(tmp_path: Path) -> None:
    for value in (".nan", ".inf", "0", "1e9"):
        with pytest.raises(InventoryError) as exc:
            loader.load(write(tmp_path, GOOD), overrides=[f"command_timeout={value}"], check_files=False)
        assert exc.value.field == "--set command_timeout" and "--set command_timeout=600" in (exc.value.fix or "")
    inv = loader.load(write(tmp_path, GOOD), overrides=["connect_timeout=600", "command_timeout=86400"],
                         check_files=False)
    assert {(h.connect_timeout, h.command_timeout) for h in inv.hosts.values()} == {(600.0, 86400.0)}


def test_a_nan_timeout_is_exit_2_not_an_internal_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    p = write(tmp_path, "defaults:\n  connect_timeout: .nan\nhosts:\n  pc1: {address: 127.0.0.1}\n")
    r = subprocess.run([sys.executable, "-m", "cluster", "check", str(p)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert f"{p}:2: defaults.connect_timeout" in r.stderr


@pytest.mark.parametrize("text, field", [
    ('hosts:\n  "pc1\\n": {address: a}\n', "hosts.pc1\n"),
    ('name: "lab\\n"\nhosts:\n  pc1: {address: a}\n', "name"),
])
def test_a_name_ending_in_a_newline_is_refused(tmp_path: Path, text: str, field: str) -> None:
    """`$` in a re.match pattern accepts a final newline: SAFE_NAME anchors with \\Z."""
    e = _error(tmp_path, text, check_files=False)
    assert e.field == field and "cannot be used as a name" in str(e)


@pytest.mark.parametrize("reader", READERS)
def test_ansible_host_name_ending_in_a_newline_is_refused(tmp_path: Path, reader: str) -> None:
    e = _error(tmp_path, 'all:\n  hosts:\n    "pc1\\n":\n      ansible_host: 10.0.0.1\n',
               check_files=False, reader=reader)
    assert "cannot be used as a name" in str(e) or "install clusterctl[ansible]" in str(e)


@pytest.mark.parametrize("reader", READERS)
def test_ansible_port_in_non_ascii_digits_is_exit_2(tmp_path: Path, reader: str) -> None:
    """'²'.isdigit() is true but int('²') raises: the built-in reader gave a traceback (exit 70)."""
    e = _error(tmp_path, 'all:\n  hosts:\n    pc1:\n      ansible_host: 10.0.0.1\n      ansible_port: "\u00b2"\n',
               check_files=False, reader=reader)
    assert e.exit_code == 2 and ("ansible_port" in str(e) or "port" in str(e))


def test_an_inventory_keeps_the_overrides_it_was_read_with() -> None:
    """A room run's waiter reads the inventory again later: with the launch's --host-set, not without it."""
    inv = loader.load(ROOT / "inventory" / "local.yaml", ["python=/opt/env/bin/python"])
    assert inv.overrides == ("python=/opt/env/bin/python",)
    assert all(h.python == "/opt/env/bin/python" for h in inv.hosts.values())
    assert loader.load(ROOT / "inventory" / "local.yaml").overrides == ()
