"""Ansible inventories -> hosts: the answer of either reader mapped to clusterctl's host fields.

Both readers give one answer shape (cluster.inventory.ansible_core.child_main): per host its groups,
the connection fields as Ansible's connection plugin resolves them, and its templated variables.
`finish` maps that answer to hosts, the same for both, so they cannot drift apart.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from cluster.inventory import ansible_core, ansible_yaml
from cluster.inventory.ansible_answer import Answer, AnsweredHost
from cluster.errors import InventoryError
from cluster.inventory.check import Checker, Layers, build_host, check_files, check_name, default_name
from cluster.inventory.model import HOST_FIELDS, Inventory
from cluster.inventory.sshconfig import Resolver
from cluster.yamlfile import Map

# Variables that become host fields (consumed: they are not copied into `vars`).
CONSUMED = frozenset({
    "ansible_host", "ansible_ssh_host", "ansible_port", "ansible_ssh_port", "ansible_user", "ansible_ssh_user",
    "ansible_private_key_file", "ansible_ssh_private_key_file", "ansible_python_interpreter", "ansible_connection",
    "ansible_paramiko_host", "ansible_paramiko_port", "ansible_paramiko_user", "ansible_paramiko_private_key_file",
    "ansible_ssh_common_args", "ansible_ssh_extra_args", "ansible_paramiko_proxy_command",
    "ansible_become", "ansible_become_method", "ansible_become_user",
})
# Secrets: clusterctl never uses passwords (keys and ssh-agent only).
_SECRET = re.compile(r"^ansible_(\w+_)?(pass|password|passphrase)$")
# SSH settings clusterctl's own SSH client cannot honour: connecting without them would be a misread.
_SSH_ARGS = ("ansible_ssh_args", "ansible_ssh_executable")
# Extra ssh arguments Ansible adds to its command line: read as `ssh` reads them, into host fields.
_SSH_EXTRA = ("ansible_ssh_common_args", "ansible_ssh_extra_args")
_SSH_OPTIONS = {"proxyjump": "proxy_jump", "proxycommand": "proxy_command", "userknownhostsfile": "known_hosts",
                "hostkeyalias": "host_key_alias", "identityfile": "identity_file", "port": "port", "user": "user"}
_SSH_FLAGS = {"-J": "proxy_jump", "-F": "ssh_config", "-i": "identity_file", "-p": "port", "-l": "user"}
_SSH_HARMLESS_OPTIONS = ("stricthostkeychecking", "identitiesonly", "batchmode", "controlmaster", "controlpersist",
                         "controlpath", "serveraliveinterval", "serveralivecountmax", "connecttimeout",
                         "compression", "loglevel", "forwardagent")


def ssh_args_fields(text: str) -> dict[str, str]:
    """Ansible's extra ssh arguments as host fields, as `ssh` reads them: -J, -F, -i, -p, -l, and -o for
    ProxyJump, ProxyCommand, UserKnownHostsFile, HostKeyAlias, IdentityFile, Port, User. Options that do not
    change where or as whom clusterctl connects (StrictHostKeyChecking: clusterctl's trust policy stands;
    ControlMaster, ServerAliveInterval, ...) are passed over; anything else raises ValueError naming it."""
    import shlex

    words, out = shlex.split(text), {}
    i = 0
    while i < len(words):
        w = words[i]
        flag, value = (w[:2], w[2:]) if w[:2] in (*_SSH_FLAGS, "-o") and len(w) > 2 else (w, None)
        if flag in ("-q", "-C", "-T", "-n", "-4", "-A", "-a", "-x", "-v"):
            i += 1
            continue
        if flag not in (*_SSH_FLAGS, "-o"):
            raise ValueError(f"{w!r} is not an ssh argument clusterctl follows")
        if value is None:
            if i + 1 >= len(words):
                raise ValueError(f"{w!r} needs a value")
            value, i = words[i + 1], i + 1
        i += 1
        if flag != "-o":
            out[_SSH_FLAGS[flag]] = value
            continue
        key, sep, v = value.partition("=")
        if not sep:
            key, _, v = value.partition(" ")
        key = key.strip().lower()
        if key in _SSH_OPTIONS:
            out[_SSH_OPTIONS[key]] = v.strip()
        elif key not in _SSH_HARMLESS_OPTIONS:
            raise ValueError(f"-o {value!r} is not an ssh option clusterctl follows")
    return out
_ANSIBLE_TRUE = {True, 1, "1", "y", "yes", "on", "true", "t"}  # ansible.module_utils...boolean
_INTERPRETER_DISCOVERY = ("auto", "auto_silent", "auto_legacy", "auto_legacy_silent")
# The host fields a `clusterctl_<field>` variable may set (address and connection come from Ansible's own).
_CLUSTERCTL_FIELDS = [f for f in HOST_FIELDS if f not in ("address", "connection")]


def answer(chk: Checker, path: Path, data: Any, reader: str) -> Answer:
    """The answer of the reader chosen (ansible-core, or the built-in YAML subset), or the refusal."""
    if reader == "ansible" or (reader == "auto" and ansible_core.available()):
        if not ansible_core.available():
            raise chk.fail(None, None, "ansible-core is not installed (CLUSTERCTL_INVENTORY_READER=ansible)",
                           ansible_core.INSTALL_FIX)
        return ansible_core.resolve([path])
    if path.is_dir():
        raise chk.fail(None, None, "an inventory directory: not in the subset read without Ansible",
                       ansible_core.INSTALL_FIX)
    if path.suffix not in ansible_yaml.YAML_EXTENSIONS or data is None or isinstance(data, str):
        raise chk.fail(None, None, "not a YAML inventory (Ansible reads it as INI): INI inventories are not "
                       "in the subset read without Ansible", ansible_core.INSTALL_FIX)
    return ansible_yaml.read(path, data)


def _is_true(value: Any) -> bool:
    return (value.strip().lower() if isinstance(value, str) else value) in _ANSIBLE_TRUE


class _AnsweredHost:
    """One host of the answer on its way to host fields; errors name the file and line that set a variable."""

    def __init__(self, chk: Checker, h: AnsweredHost) -> None:
        self.chk, self.name = chk, h["name"]
        self.origins = h.get("origins", {})
        self.values = h["vars"]
        self.errors = h["errors"]
        self.conn = h["conn"]
        self.fields = Map.new()

    def where(self, var: str) -> tuple[Checker, int | None, str]:
        o = self.origins.get(var) or [None, None]
        return (Checker(Path(o[0])) if o[0] else self.chk), o[1], f"{self.name}.{var}"

    def refuse(self, var: str, msg: str, fix: str) -> InventoryError:
        c, line, field_path = self.where(var)
        return c.fail(line, field_path, msg, fix)

    def put(self, key: str, value: Any, var: str) -> None:
        c, line, field_path = self.where(var)
        self.fields[key] = c.value(key, value, line, field_path)
        self.fields.lines[key] = line

    def set_or_errors(self, var: str) -> bool:
        return var in self.errors or self.values.get(var) not in (None, "")

    def check_vars(self) -> None:
        """Refuse what clusterctl cannot honour: passwords, extra SSH settings, unresolved fields, become."""
        for var in sorted(set(self.values) | set(self.errors)):
            if _SECRET.match(var) and self.set_or_errors(var):
                raise self.refuse(var, "a password in the inventory: clusterctl never uses passwords",
                                  "use SSH keys (ssh-copy-id; a passphrase key through ssh-agent) and remove "
                                  f"{var} from what clusterctl reads")
            if var in _SSH_ARGS and self.set_or_errors(var):
                raise self.refuse(var, "SSH settings that replace how Ansible runs ssh: clusterctl would connect "
                                  "differently from Ansible",
                                  "remove it from what clusterctl reads; jump hosts and the like go in "
                                  "ansible_ssh_common_args (-J, -o ProxyCommand=...) or ~/.ssh/config")
            if var in self.errors and (var in CONSUMED or var.startswith("clusterctl_") or var == "ansible_become"):
                raise self.refuse(var, f"Ansible cannot resolve this value before a play runs: {self.errors[var]}",
                                  "give it a value that does not depend on facts or play variables")
        if _is_true(self.values.get("ansible_become")):
            method = str(self.values.get("ansible_become_method") or "sudo")
            user = str(self.values.get("ansible_become_user") or "root")
            if method != "sudo" or user != "root":
                raise self.refuse("ansible_become_method" if method != "sudo" else "ansible_become_user",
                                  f"become as {user} with {method}: clusterctl becomes root with `sudo -n` only",
                                  "ansible_become_method: sudo and ansible_become_user: root (NOPASSWD), or "
                                  "leave become off")

    def connection_fields(self) -> None:
        """The fields Ansible's connection plugin resolved: connection, address, port, user, key, python."""
        connection = self.conn["connection"]
        if connection in ("ssh", "paramiko", "paramiko_ssh"):
            connection = "ssh"
        elif connection != "local":
            raise self.refuse("ansible_connection", f"connection {connection!r} is not supported",
                              "clusterctl reaches nodes with `ssh` (or `paramiko`), or `local` for this machine")
        self.put("address", self.conn["address"], "ansible_host")
        self.put("connection", connection, "ansible_connection")
        for key, fieldname, var in (("port", "port", "ansible_port"), ("user", "user", "ansible_user"),
                                    ("key", "identity_file", "ansible_ssh_private_key_file")):
            if self.conn.get(key) is not None:
                self.put(fieldname, self.conn[key], var)
        for var in _SSH_EXTRA:
            text = self.values.get(var)
            if var in self.errors or not text:
                continue
            try:
                fields = ssh_args_fields(str(text))
            except ValueError as e:
                raise self.refuse(var, str(e), "keep -J/-o ProxyJump, -o ProxyCommand, -F, -i, -p, -l, -o "
                                  "UserKnownHostsFile/HostKeyAlias there, or put the rest in ~/.ssh/config") from None
            for key, value in fields.items():
                self.put(key, int(value) if key == "port" and value.isdigit() else value, var)
        if _is_true(self.values.get("ansible_become")):
            self.put("become", True, "ansible_become")
        if self.values.get("ansible_paramiko_proxy_command"):
            self.put("proxy_command", self.values["ansible_paramiko_proxy_command"], "ansible_paramiko_proxy_command")
        interp = self.values.get("ansible_python_interpreter")
        if interp is not None and interp not in _INTERPRETER_DISCOVERY:
            self.put("python", interp, "ansible_python_interpreter")

    def other_vars(self) -> bool:
        """`clusterctl_<field>` variables become fields, the others `vars`; True if clusterctl_rank0 is true."""
        free: dict[str, Any] = {}
        rank0 = False
        for var, value in self.values.items():
            if var in CONSUMED:
                continue
            if not var.startswith("clusterctl_"):
                free[var] = value
                continue
            target = var[len("clusterctl_"):]
            if target == "rank0":
                rank0 = rank0 or _is_true(value)
                continue
            if target not in _CLUSTERCTL_FIELDS:
                c, line, field_path = self.where(var)
                raise c.fail(line, field_path, "unknown clusterctl field",
                             f"use one of: {', '.join('clusterctl_' + f for f in _CLUSTERCTL_FIELDS + ['rank0'])}")
            self.put(target, value, var)
        if "vars" in self.fields:
            free.update(self.fields["vars"])
        self.fields["vars"] = free
        return rank0


def finish(chk: Checker, path: Path, ans: Answer, cli: list[tuple[str, Any]],
           check_files_too: bool) -> Inventory:
    """The validated inventory of an Ansible answer, with the command line's overrides on top."""
    raw_hosts: dict[str, Layers] = {}
    rank0: list[str] = []
    for h in ans["hosts"]:
        host = _AnsweredHost(chk, h)
        name = host.name
        check_name(chk, name, host.where(name)[1] if name in host.origins else None, f"hosts.{name}",
                   "rename the host (the name is a label: put its address in ansible_host)")
        host.check_vars()
        host.connection_fields()
        if host.other_vars():
            rank0.append(name)
        raw_hosts[name] = [(host.fields, None, f"hosts.{name}")]
    if not raw_hosts:
        raise chk.fail(None, None, "the inventory has no hosts", "add at least one host")
    groups = {g: tuple(members) for g, members in ans["groups"].items()}
    ssh = Resolver(str(path))
    hosts = ssh.resolve_all(lambda n: build_host(chk, n, raw_hosts[n], cli, groups, ssh), raw_hosts)
    if len(rank0) > 1:
        raise chk.fail(None, "clusterctl_rank0", f"set true on several hosts ({', '.join(rank0)})",
                       "set clusterctl_rank0: true on one host only (not in group vars)")
    inv = Inventory(path=path, name=default_name(chk, path), hosts=hosts, groups=groups,
                    rank0=rank0[0] if rank0 else next(iter(hosts)), format="ansible", notes=tuple(ssh.notes),
                    ansible_core=ans["ansible"])
    if check_files_too:
        check_files(chk, inv, raw_hosts)
    return inv
