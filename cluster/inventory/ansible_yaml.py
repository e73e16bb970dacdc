"""The built-in reader of Ansible YAML inventories: a small subset, read exactly as Ansible reads it.

Used where ansible-core is not installed. It gives the same answer as cluster.inventory.ansible_core
(Ansible itself) or refuses with exit 2, file:line, the feature by name and the fix "install
clusterctl[ansible]"; it never guesses. What it reads, with Ansible's own rules (ansible-core 2.19:
plugins/inventory/yaml.py, inventory/data.py, group.py, vars/manager.py):
- `GROUP: {hosts, vars, children}` at the top level (`all:` or not), nested children, a host named
  in several groups (its host vars merged key by key in file order, later wins);
- group vars layered as Ansible does: `all`, then the host's groups sorted by depth (longest path
  from `all`), `ansible_group_priority`, then name; host vars last;
- hosts that are in no group but `all` are in `ungrouped`; groups without a parent are children of
  `all`;
- the connection fields as the ssh connection plugin resolves them (of the aliases it lists for an
  option, the last one set wins: `ansible_ssh_host` over `ansible_host`, and so on).
Refused: INI files, directories, group_vars/ and host_vars/ beside the file, host ranges, `host:port`
keys, Jinja (`{{`, `{%`, `{#`), YAML tags (`!vault`, `!unsafe`), keys Ansible would skip with a
warning, a host named like a group, an ansible.cfg or ANSIBLE_* setting that changes defaults.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.inventory.ansible_answer import Answer, AnsweredHost, Conn
from cluster.errors import InventoryError
from cluster.yamlfile import Map
from cluster.yamlfile import line_of as _line

INSTALL_FIX = "install clusterctl[ansible] to read this inventory with Ansible's own rules"
YAML_EXTENSIONS = ("", ".yaml", ".yml", ".json")
# Host names the subset takes verbatim (Ansible's parse_address leaves these unchanged).
PLAIN_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*\Z")
JINJA = ("{{", "{%", "{#")
# The ssh connection plugin's variables per option, in its own order (the last one set wins).
SSH_OPTION_VARS = {
    "address": ("inventory_hostname", "ansible_host", "ansible_ssh_host"),
    "port": ("ansible_port", "ansible_ssh_port"),
    "user": ("ansible_user", "ansible_ssh_user"),
    "key": ("ansible_private_key_file", "ansible_ssh_private_key_file"),
}
PARAMIKO_OPTION_VARS = {
    "address": ("inventory_hostname", "ansible_host", "ansible_ssh_host", "ansible_paramiko_host"),
    "port": ("ansible_port", "ansible_ssh_port", "ansible_paramiko_port"),
    "user": ("ansible_user", "ansible_ssh_user", "ansible_paramiko_user"),
    "key": ("ansible_private_key_file", "ansible_ssh_private_key_file", "ansible_paramiko_private_key_file"),
}
# ANSIBLE_* settings that change what the answer would be (defaults of the fields clusterctl uses).
ANSIBLE_ENV = ("ANSIBLE_REMOTE_USER", "ANSIBLE_REMOTE_PORT", "ANSIBLE_PRIVATE_KEY_FILE", "ANSIBLE_TRANSPORT",
               "ANSIBLE_CONFIG", "ANSIBLE_INVENTORY_ENABLED", "ANSIBLE_HASH_BEHAVIOUR", "ANSIBLE_VARS_ENABLED",
               "ANSIBLE_PRECEDENCE")


@dataclass
class _Node:
    """What groups and hosts share: a name, where it was written, its variables and their lines."""

    name: str
    line: int | None
    vars: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, int | None] = field(default_factory=dict)


@dataclass
class _Group(_Node):
    priority: int = 1
    children: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)


@dataclass
class _Host(_Node):
    groups: list[str] = field(default_factory=list)  # direct membership, in the order added


def ansible_cfg() -> Path | None:
    """The ansible.cfg an installed Ansible would read (its search order)."""
    env = os.environ.get("ANSIBLE_CONFIG")
    candidates = [Path(env).expanduser()] if env else []
    candidates += [Path.cwd() / "ansible.cfg", Path("~/.ansible.cfg").expanduser(), Path("/etc/ansible/ansible.cfg")]
    return next((c for c in candidates if c.is_file()), None)


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.groups: dict[str, _Group] = {"all": _Group("all", None), "ungrouped": _Group("ungrouped", None)}
        self.hosts: dict[str, _Host] = {}
        self._add_child("all", "ungrouped", None)

    def refuse(self, line: int | None, where: str | None, feature: str) -> InventoryError:
        return InventoryError(str(self.path), line, where, f"{feature}: not in the subset read without Ansible",
                              INSTALL_FIX)

    # --- values

    def check_value(self, value: Any, line: int | None, where: str) -> None:
        """Plain YAML data only: Ansible would template a string with Jinja in it."""
        if isinstance(value, str):
            if any(j in value for j in JINJA):
                raise self.refuse(line, where, "a Jinja template (Ansible resolves it at run time)")
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise self.refuse(_line(value, k) or line, f"{where}.{k}", "a mapping key that is not a string")
                self.check_value(k, _line(value, k) or line, where)
                self.check_value(v, _line(value, k) or line, f"{where}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                self.check_value(v, line, f"{where}[{i}]")
        elif not (value is None or isinstance(value, (bool, int, float))):
            raise self.refuse(line, where, f"a {type(value).__name__} value (Ansible keeps YAML types this reader does not)")

    def mapping(self, m: Any, line: int | None, where: str) -> dict[Any, Any] | None:
        """A section as Ansible accepts it: a mapping or nothing (a plain string means {string: None})."""
        if m is None:
            return None
        if isinstance(m, str):
            return Map.new({m: None}, line=line or 0, lines={m: line or 0})
        if not isinstance(m, dict):
            raise self.refuse(line, where, f"a {type(m).__name__} where Ansible expects a mapping "
                              "(Ansible skips it with a warning)")
        if isinstance(m, Map) and m.dups:
            key, first, again = m.dups[0]
            raise self.refuse(again, f"{where}.{key}", f"'{key}' written twice (first on line {first}; "
                              "Ansible keeps the last one with a warning)")
        return m

    # --- the inventory model, as Ansible builds it

    def _add_group(self, name: Any, line: int | None, where: str) -> str:
        if not isinstance(name, str) or not name:
            raise self.refuse(line, where, f"a group name that is not a string ({name!r})")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise self.refuse(line, where, f"group name '{name}' (Ansible warns about its characters)")
        if name in self.hosts:
            raise self.refuse(line, where, f"'{name}' is both a host and a group")
        self.groups.setdefault(name, _Group(name, line))
        return name

    def _add_child(self, parent: str, child: str, line: int | None) -> None:
        p, c = self.groups[parent], self.groups[child]
        if child == parent or parent in self._descendants(child):
            raise self.refuse(line, f"{parent}.children.{child}", "a loop of groups (Ansible refuses it)")
        if child not in p.children:
            p.children.append(child)
            if parent not in c.parents:
                c.parents.append(parent)

    def _descendants(self, name: str) -> set[str]:
        return self._reach(name, "children")

    def _ancestors(self, name: str) -> set[str]:
        return self._reach(name, "parents")

    def _reach(self, name: str, edge: str) -> set[str]:
        """Every group reachable from `name` along `edge` (children or parents), `name` itself excluded."""
        seen: set[str] = set()
        todo = [name]
        while todo:
            for other in getattr(self.groups[todo.pop()], edge):
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        return seen

    def _add_host(self, name: Any, group: str, line: int | None, where: str) -> _Host:
        if not isinstance(name, str):
            raise self.refuse(line, where, f"host {name!r} is not a string (Ansible refuses it)")
        if any(c in name for c in "[]:"):
            feature = "a host range" if "[" in name else "a `host:port` key or an IPv6 address"
            raise self.refuse(line, where, f"{feature} ('{name}')")
        if not PLAIN_HOST.match(name):
            raise self.refuse(line, where, f"host name '{name}' (Ansible may read it as a pattern)")
        if name in self.groups:
            raise self.refuse(line, where, f"'{name}' is both a host and a group")
        host = self.hosts.setdefault(name, _Host(name, line))
        if group not in host.groups:
            host.groups.append(group)
            self.groups[group].hosts.append(name)
        return host

    # --- the walk of plugins/inventory/yaml.py

    def read(self, data: Any) -> None:
        if not data:
            raise InventoryError(str(self.path), 1, None, "the inventory is empty", "add `all:` with `hosts:`")
        if not isinstance(data, dict):
            raise self.refuse(1, None, "a file that is not a YAML mapping (Ansible would try it as INI)")
        if data.get("plugin"):
            raise self.refuse(_line(data, "plugin"), "plugin", "an inventory plugin configuration")
        data = self.mapping(data, 1, "inventory")
        assert data is not None
        for gname in data:
            self.group(gname, data[gname], _line(data, gname), str(gname))

    def group(self, name: Any, body: Any, line: int | None, where: str) -> str:
        if not isinstance(body, (dict, type(None))):
            raise self.refuse(line, where, "a group that is not a mapping (Ansible skips it with a warning)")
        gname = self._add_group(name, line, where)
        if body is None:
            return gname
        body = self.mapping(body, line, where)
        assert body is not None
        for key in body:
            kline, kwhere = _line(body, key), f"{where}.{key}"
            if key not in ("hosts", "vars", "children"):
                raise self.refuse(kline, kwhere, f"key '{key}' in a group (Ansible skips it with a warning; "
                                  "only hosts, vars and children are read)")
            section = self.mapping(body[key], kline, kwhere)
            if section is None:
                continue
            if key == "vars":
                for var in section:
                    self.set_var(self.groups[gname], var, section[var], _line(section, var), f"{kwhere}.{var}")
            elif key == "children":
                for sub in section:
                    child = self.group(sub, section[sub], _line(section, sub), f"{kwhere}.{sub}")
                    self._add_child(gname, child, _line(section, sub))
            else:
                for hname in section:
                    hline, hwhere = _line(section, hname), f"{kwhere}.{hname}"
                    host = self._add_host(hname, gname, hline, hwhere)
                    hvars = self.mapping(section[hname], hline, hwhere) or {}
                    for var in hvars:
                        self.set_var(host, var, hvars[var], _line(hvars, var), f"{hwhere}.{var}")
        return gname

    def set_var(self, obj: _Node, var: Any, value: Any, line: int | None, where: str) -> None:
        if not isinstance(var, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            raise self.refuse(line, where, f"variable name {var!r} (Ansible deprecates it)")
        self.check_value(value, line, where)
        if isinstance(obj, _Group) and var == "ansible_group_priority":
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.refuse(line, where, f"ansible_group_priority {value!r} that is not a whole number")
            obj.priority = value
            return
        obj.vars[var] = value  # combine_vars with Ansible's default hash_behaviour=replace: per key
        obj.origins[var] = line

    # --- after parsing: InventoryData.reconcile_inventory, then VariableManager.get_vars

    def reconcile(self) -> None:
        for g in list(self.groups.values()):
            if g.name != "all" and not self._ancestors(g.name):
                self._add_child("all", g.name, g.line)
        ungrouped = self.groups["ungrouped"]
        for h in self.hosts.values():
            mine = set(h.groups) | {a for g in h.groups for a in self._ancestors(g)}
            if "ungrouped" in mine and mine - {"all", "ungrouped"}:
                ungrouped.hosts.remove(h.name)
                h.groups.remove("ungrouped")
            elif mine <= {"all"}:
                ungrouped.hosts.append(h.name)
                h.groups.append("ungrouped")

    def depth(self, name: str, memo: dict[str, int]) -> int:
        """Ansible's Group.depth: the longest path from `all`."""
        if name not in memo:
            parents = self.groups[name].parents
            memo[name] = 0 if not parents else 1 + max(self.depth(p, memo) for p in parents)
        return memo[name]

    def answer(self) -> Answer:
        """The same shape as cluster.inventory.ansible_core's answer."""
        memo: dict[str, int] = {}
        order = list(self.hosts)
        hosts_out: list[AnsweredHost] = []
        for h in self.hosts.values():
            mine = set(h.groups) | {a for g in h.groups for a in self._ancestors(g)}
            ranked = sorted((self.groups[g] for g in mine),
                            key=lambda g: (self.depth(g.name, memo), g.priority, g.name))
            values: dict[str, Any] = {}
            origins: dict[str, list[Any] | None] = {}
            nodes: list[_Node] = [*ranked, h]
            for node in nodes:
                for k, v in node.vars.items():
                    values[k] = v
                    origins[k] = [str(self.path), node.origins.get(k)]
            conn = _connection(h.name, values)
            hosts_out.append({"name": h.name, "groups": sorted(g for g in mine if g != "all"), "conn": conn,
                              "vars": values, "errors": {}, "origins": origins})
        groups: dict[str, list[str]] = {}
        for gname in self.groups:
            if gname == "all":
                continue
            members = set(self.groups[gname].hosts) | {m for d in self._descendants(gname)
                                                       for m in self.groups[d].hosts}
            groups[gname] = [n for n in order if n in members]
        return {"ansible": None, "config_file": None, "default_transport": "ssh", "plugins": {str(self.path): "yaml"},
                "warnings": [], "hosts": hosts_out, "groups": groups}


def _connection(name: str, values: dict[str, Any]) -> Conn:
    """The fields as the connection plugin resolves them from the host's variables."""
    connection = values.get("ansible_connection")
    connection = "ssh" if connection in (None, "smart") else connection
    table = PARAMIKO_OPTION_VARS if connection in ("paramiko", "paramiko_ssh") else SSH_OPTION_VARS
    scope = {**values, "inventory_hostname": name}
    conn: Conn = {"connection": connection}
    for fieldname, names in table.items():
        chosen = None
        for var in names:  # config manager's _loop_entries: every set entry overwrites the previous one
            if scope.get(var) is not None:
                chosen = scope[var]
        conn[fieldname] = chosen
    if conn["port"] is None and table is PARAMIKO_OPTION_VARS:
        conn["port"] = 22
    return conn


def _typed(path: Path, answer: Answer) -> None:
    """Option types as Ansible's config manager converts them (int port, string user/key/address)."""
    for h in answer["hosts"]:
        conn = h["conn"]
        port = conn["port"]
        if port is not None:
            if isinstance(port, str) and port.strip().isascii() and port.strip().isdigit():  # int('²') raises
                port = int(port)
            if isinstance(port, bool) or not isinstance(port, int):
                line = (h["origins"].get("ansible_port") or h["origins"].get("ansible_ssh_port") or [None, None])[1]
                raise InventoryError(str(path), line, f"{h['name']}.ansible_port",
                                     f"expected a port number, got {port!r}", "e.g. ansible_port: 22")
            conn["port"] = port
        for k in ("address", "user", "key"):
            v = conn[k]
            if isinstance(v, bool) or isinstance(v, (dict, list)):
                raise InventoryError(str(path), None, f"{h['name']}.{k}", f"{v!r} is not a string",
                                     INSTALL_FIX)
            if v is not None:
                conn[k] = str(v)


def read(path: Path, data: Any) -> Answer:
    """Ansible's answer for the YAML inventory `path` (parsed as `data`), or InventoryError."""
    for env in ANSIBLE_ENV:
        if os.environ.get(env):
            raise InventoryError(str(path), None, None, f"{env} is set: it changes Ansible's answer and is "
                                 "not read without Ansible", INSTALL_FIX)
    cfg = ansible_cfg()
    if cfg is not None:
        raise InventoryError(str(path), None, None, f"an ansible.cfg is in effect ({cfg}): its defaults "
                             "are not read without Ansible", INSTALL_FIX)
    for d in ("group_vars", "host_vars"):
        if (path.parent / d).exists():
            raise InventoryError(str(path), None, None, f"{d}/ beside the inventory ({path.parent / d}): "
                                 "not in the subset read without Ansible", INSTALL_FIX)
    reader = _Reader(path)
    reader.read(data)
    reader.reconcile()
    answer = reader.answer()
    _typed(path, answer)
    return answer
