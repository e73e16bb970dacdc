"""Inventory: YAML (own schema or Ansible's) -> validated, layered hosts.

Layering: defaults < group (in file order) < host < command line (`--set`).
Every error names the file, the line, the dotted field and the fix (docs/inventory.md).
"""
from __future__ import annotations

import difflib
import fnmatch
import getpass
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from cluster import ansible_inventory, ansible_yaml
from cluster.errors import InventoryError
from cluster.yamlfile import Loader as _Loader
from cluster.yamlfile import Map as _Map
from cluster.yamlfile import line_of as _line

# Fields a host may carry; defaults and groups may set all of them except `address`.
HOST_FIELDS = (
    "address",
    "port",
    "user",
    "identity_file",
    "known_hosts",
    "python",
    "workdir",
    "connection",
    "gpu",
    "connect_timeout",
    "command_timeout",
    "vars",
)
TOP_KEYS = ("name", "rank0", "defaults", "groups", "hosts")
GPU_KEYS = ("count", "model", "compute_capability")
CONNECTIONS = ("ssh", "local")


@dataclass(frozen=True)
class GpuSpec:
    """What the inventory says a node's GPUs are (overrides or checks facts)."""

    count: int
    model: str | None = None
    compute_capability: str | None = None


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    port: int = 22
    user: str = field(default_factory=getpass.getuser)
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    python: str = "python3"
    workdir: str = "clusterctl"
    connection: str = "ssh"
    gpu: GpuSpec | None = None
    connect_timeout: float = 5.0
    command_timeout: float = 600.0
    groups: tuple[str, ...] = ()
    vars: Mapping[str, Any] = field(default_factory=dict)

    @property
    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts).expanduser()

    @property
    def key_path(self) -> Path | None:
        return Path(self.identity_file).expanduser() if self.identity_file else None

    @property
    def host_key_name(self) -> str:
        """The name known_hosts files use for this node (OpenSSH's `[addr]:port` form)."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("name",) + HOST_FIELDS}
        d["gpu"] = None if self.gpu is None else vars(self.gpu).copy()
        d["vars"] = dict(self.vars)
        d["groups"] = list(self.groups)
        return d


@dataclass(frozen=True)
class Inventory:
    path: Path
    name: str
    hosts: dict[str, Host]
    groups: dict[str, tuple[str, ...]]
    rank0: str
    format: str = "clusterctl"

    def select(self, limit: str | None) -> list[Host]:
        """Hosts matching a comma-separated list of host names, group names or globs."""
        if not limit:
            return list(self.hosts.values())
        chosen: set[str] = set()
        for pattern in (p.strip() for p in limit.split(",") if p.strip()):
            matched = set(self.groups.get(pattern, ()))
            matched |= {h for h in self.hosts if fnmatch.fnmatchcase(h, pattern)}
            if not matched:
                known = ", ".join(list(self.hosts) + list(self.groups))
                raise InventoryError(
                    str(self.path), None, "--limit", f"'{pattern}' matches no host or group",
                    f"use one of: {known}",
                )
            chosen |= matched
        return [h for n, h in self.hosts.items() if n in chosen]

    def ordered(self, hosts: Iterable[Host]) -> list[Host]:
        """Rank 0 first, then inventory order: the order ranks are given out."""
        hosts = list(hosts)
        return sorted(hosts, key=lambda h: (h.name != self.rank0, list(self.hosts).index(h.name)))


# --------------------------------------------------------------------------- validation


class _Checker:
    """Validates raw YAML values; every failure raises InventoryError naming file/line/field."""

    def __init__(self, file: Path) -> None:
        self.file = str(file)

    def fail(self, line: int | None, path: str, msg: str, fix: str | None = None) -> InventoryError:
        return InventoryError(self.file, line, path, msg, fix)

    def mapping(self, value: Any, line: int | None, path: str) -> _Map:
        if value is None:
            value = _Map()
            value.line, value.lines, value.dups = line or 0, {}, []
        if not isinstance(value, dict):
            raise self.fail(line, path, f"expected a mapping, got {_kind(value)}",
                            f"write `{path.rsplit('.', 1)[-1]}:` followed by indented `key: value` lines")
        if not isinstance(value, _Map):  # a plain dict (Ansible's answer): no lines to keep
            value = _Map(value)
            value.line, value.lines, value.dups = line or 0, {}, []
        if value.dups:
            key, first, again = value.dups[0]
            what = "host" if path.endswith("hosts") else "key"
            raise self.fail(again, f"{path}.{key}", f"duplicate {what} '{key}' (first defined on line {first})",
                            f"keep one '{key}' entry under {path}")
        return value

    def keys(self, m: _Map, allowed: Iterable[str], path: str) -> None:
        allowed = list(allowed)
        for key in m:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(allowed)}"
                raise self.fail(_line(m, key), f"{path}.{key}", "unknown key", hint)

    def host_fields(self, m: _Map, path: str, allow_address: bool) -> dict[str, Any]:
        """Type-check the host fields present in `m` and return them normalised (lines kept)."""
        out = _Map()
        out.line, out.lines, out.dups = m.line, {}, []
        for key, value in m.items():
            if key not in HOST_FIELDS:
                continue
            line, fpath = _line(m, key), f"{path}.{key}"
            if key == "address" and not allow_address:
                raise self.fail(line, fpath, "only a host can have an address", "move it under hosts.<name>")
            out[key] = self.value(key, value, line, fpath)
            out.lines[key] = line
        return out

    def value(self, key: str, value: Any, line: int | None, path: str) -> Any:
        if key == "port":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
                raise self.fail(line, path, f"expected a port number 1-65535, got {value!r}", "e.g. port: 22")
            return value
        if key in ("connect_timeout", "command_timeout"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise self.fail(line, path, f"expected a positive number of seconds, got {value!r}",
                                f"e.g. {key}: 10")
            return float(value)
        if key == "connection":
            if value not in CONNECTIONS:
                raise self.fail(line, path, f"expected one of {', '.join(CONNECTIONS)}, got {value!r}",
                                "use `ssh` for real PCs, `local` for nodes on this machine")
            return value
        if key == "vars":
            return dict(self.mapping(value, line, path))
        if key == "gpu":
            return self.gpu(value, line, path)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool) or value == "":
            raise self.fail(line, path, f"expected a non-empty string, got {_kind(value)}",
                            f"e.g. {key}: {_EXAMPLES.get(key, 'value')}")
        return str(value)

    def gpu(self, value: Any, line: int | None, path: str) -> GpuSpec:
        if value in (None, "none", 0, False):
            return GpuSpec(count=0)
        m = self.mapping(value, line, path)
        self.keys(m, GPU_KEYS, path)
        count = m.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise self.fail(_line(m, "count"), f"{path}.count", f"expected a whole number >= 0, got {count!r}",
                            "e.g. count: 1")
        cc = m.get("compute_capability")
        if cc is not None:
            cc = str(cc)
            try:
                float(cc)
            except ValueError:
                raise self.fail(_line(m, "compute_capability"), f"{path}.compute_capability",
                                f"expected a number like \"6.1\", got {cc!r}",
                                "quote it: compute_capability: \"6.1\"") from None
        model = m.get("model")
        return GpuSpec(count=count, model=None if model is None else str(model), compute_capability=cc)


_EXAMPLES = {
    "address": "192.168.1.11",
    "user": "student",
    "identity_file": "~/.ssh/id_ed25519",
    "known_hosts": "~/.ssh/known_hosts",
    "python": "python3",
    "workdir": "/srv/cluster",
}


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (empty value)"
    return {dict: "a mapping", _Map: "a mapping", list: "a list", bool: "true/false", str: "a string",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` from the command line; the value is read as YAML (so `port=2222` is a number)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise InventoryError("command line", None, "--set", f"expected key=value, got {text!r}",
                             "e.g. --set user=student or --set vars.dataset=digits")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load(path: str | Path, overrides: Iterable[str] = (), check_files: bool = True,
         reader: str | None = None) -> Inventory:
    """Read and validate an inventory. `check_files` verifies key files are readable.

    `reader` (default: $CLUSTERCTL_INVENTORY_READER, else `auto`) chooses how an Ansible inventory is
    read: `ansible` through ansible-core, `builtin` with the exact subset of cluster.ansible_yaml,
    `auto` through ansible-core where it is installed. clusterctl's own schema is always read here.
    """
    path = Path(path)
    reader = reader or os.environ.get("CLUSTERCTL_INVENTORY_READER") or "auto"
    if reader not in READERS:
        raise InventoryError("environment", None, "CLUSTERCTL_INVENTORY_READER", f"unknown reader {reader!r}",
                             f"use one of: {', '.join(READERS)}")
    cli = [parse_override(o) for o in overrides]
    if path.is_dir():
        chk = _Checker(path)
        return _finish(chk, path, _ansible_answer(chk, path, None, reader), cli, check_files)
    text = _read_text(path)
    data, yaml_error = _parse_yaml(path, text)
    chk = _Checker(path)
    is_yaml_file = path.suffix in (".yaml", ".yml", ".json")
    if yaml_error is not None and is_yaml_file:
        raise yaml_error  # Ansible reads these extensions as YAML only: the YAML error is the answer
    if yaml_error is None and isinstance(data, dict) and data and set(data) <= set(TOP_KEYS) \
            and (is_yaml_file or path.suffix == ""):
        return _load_own(chk, path, data, cli, check_files)
    return _finish(chk, path, _ansible_answer(chk, path, data if yaml_error is None else None, reader),
                   cli, check_files)


READERS = ("auto", "ansible", "builtin")


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InventoryError(str(path), None, None, f"cannot read inventory: {e.strerror}",
                             "check the path, or run `clusterctl lab up 3` for a simulated lab") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise InventoryError(str(path), line, None, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})",
                             "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None


def _parse_yaml(path: Path, text: str) -> tuple[Any, InventoryError | None]:
    try:
        return yaml.load(text, Loader=_Loader), None  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        return None, InventoryError(str(path), line, None, f"YAML syntax error: {e.problem or e}",
                                    "check indentation and that every `key: value` has a space after the colon")
    except yaml.YAMLError as e:
        return None, InventoryError(str(path), None, None, f"YAML error: {e}", None)


def _load_own(chk: _Checker, path: Path, data: _Map, cli: list[tuple[str, Any]], check_files: bool) -> Inventory:
    data = chk.mapping(data, 1, "inventory")
    raw_hosts, groups, rank0, name = _from_own(chk, data)
    if name is not None:
        _check_name(chk, name[0], name[1], "name", "write a name of letters, digits, '.', '_' or '-'")
    hosts = {n: _build_host(chk, n, layers, cli, groups) for n, layers in raw_hosts.items()}
    if not hosts:
        raise chk.fail(_line(data), "hosts", "the inventory has no hosts", "add at least one host with an address")
    if rank0 is None:
        rank0 = next(iter(hosts))
    elif rank0[0] not in hosts:
        raise chk.fail(rank0[1], "rank0", f"'{rank0[0]}' is not a host of this inventory",
                       f"use one of: {', '.join(hosts)}")
    else:
        rank0 = rank0[0]
    inv_name = name[0] if name is not None else _default_name(chk, path)
    inv = Inventory(path=path, name=inv_name, hosts=hosts, groups=groups, rank0=rank0, format="clusterctl")
    if check_files:
        _check_files(chk, inv, raw_hosts)
    return inv


# A name clusterctl uses as a file name on the head and as a word in files that shells source.
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def _check_name(chk: _Checker, name: str, line: int | None, where: str, fix: str) -> None:
    if not SAFE_NAME.match(name):
        raise chk.fail(line, where, f"{name!r} cannot be used as a name (it becomes a file name on the head and "
                       "a word in the nodes' shell files): letters, digits, '.', '_' and '-' only, "
                       "not starting with '.' or '-'", fix)


def _default_name(chk: _Checker, path: Path) -> str:
    name = path.name if path.is_dir() else path.stem
    _check_name(chk, name, None, "name", "rename the inventory file (letters, digits, '.', '_', '-'), "
                "or set `name:` in clusterctl's own schema")
    return name


# A host's raw layers: list of (fields, where-it-came-from line/path), lowest precedence first.
_Layers = list[tuple[dict[str, Any], int | None, str]]


def _from_own(chk: _Checker, data: _Map):
    chk.keys(data, TOP_KEYS, "inventory")
    defaults = chk.mapping(data.get("defaults"), _line(data, "defaults"), "defaults")
    chk.keys(defaults, [f for f in HOST_FIELDS if f != "address"], "defaults")
    base = chk.host_fields(defaults, "defaults", allow_address=False)
    hosts_m = chk.mapping(data.get("hosts"), _line(data, "hosts"), "hosts")
    raw: dict[str, _Layers] = {}
    for hname, hval in hosts_m.items():
        hpath = f"hosts.{hname}"
        _check_name(chk, str(hname), _line(hosts_m, hname), hpath,
                    "rename the host (the name is a label: its address goes in `address:`)")
        hm = chk.mapping(hval, _line(hosts_m, hname), hpath)
        chk.keys(hm, HOST_FIELDS, hpath)
        if "address" not in hm:
            raise chk.fail(_line(hosts_m, hname), f"{hpath}.address", "missing address",
                           f"add `address: <IP or DNS name of {hname}>` under {hpath}")
        raw[str(hname)] = [(base, _line(data, "defaults"), "defaults"),
                           (chk.host_fields(hm, hpath, allow_address=True), _line(hosts_m, hname), hpath)]
    groups: dict[str, tuple[str, ...]] = {}
    groups_m = chk.mapping(data.get("groups"), _line(data, "groups"), "groups")
    for gname, gval in groups_m.items():
        gpath = f"groups.{gname}"
        gm = chk.mapping(gval, _line(groups_m, gname), gpath)
        chk.keys(gm, ["hosts"] + [f for f in HOST_FIELDS if f != "address"], gpath)
        members = gm.get("hosts") or []
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise chk.fail(_line(gm, "hosts"), f"{gpath}.hosts", "expected a list of host names",
                           "e.g. hosts: [pc1, pc2]")
        for m in members:
            if m not in raw:
                raise chk.fail(_line(gm, "hosts"), f"{gpath}.hosts", f"'{m}' is not defined under hosts",
                               f"define hosts.{m} with its address, or remove it from the group")
        fields = chk.host_fields(gm, gpath, allow_address=False)
        for m in members:
            raw[m].insert(-1, (fields, _line(groups_m, gname), gpath))
        groups[str(gname)] = tuple(members)
    rank0 = None
    if "rank0" in data:
        rank0 = (str(data["rank0"]), _line(data, "rank0"))
    name = data.get("name")
    return raw, groups, rank0, None if name is None else (str(name), _line(data, "name"))


# --------------------------------------------------------------------------- Ansible inventories
#
# Both readers give one answer shape (cluster.ansible_inventory.child_main): per host its groups,
# the connection fields as Ansible's connection plugin resolves them, and its templated variables.
# _finish maps that answer to hosts, the same for both, so they cannot drift apart.

# Variables that become host fields (consumed: they are not copied into `vars`).
_CONSUMED = frozenset({
    "ansible_host", "ansible_ssh_host", "ansible_port", "ansible_ssh_port", "ansible_user", "ansible_ssh_user",
    "ansible_private_key_file", "ansible_ssh_private_key_file", "ansible_python_interpreter", "ansible_connection",
    "ansible_paramiko_host", "ansible_paramiko_port", "ansible_paramiko_user", "ansible_paramiko_private_key_file",
})
# Secrets: clusterctl never uses passwords (keys and ssh-agent only).
_SECRET = re.compile(r"^ansible_(\w+_)?(pass|password|passphrase)$")
# SSH settings clusterctl's own SSH client cannot honour: connecting without them would be a misread.
_SSH_ARGS = ("ansible_ssh_common_args", "ansible_ssh_extra_args", "ansible_ssh_args", "ansible_ssh_executable",
             "ansible_paramiko_proxy_command")
_ANSIBLE_TRUE = {True, 1, "1", "y", "yes", "on", "true", "t"}  # ansible.module_utils...boolean
_INTERPRETER_DISCOVERY = ("auto", "auto_silent", "auto_legacy", "auto_legacy_silent")


def _ansible_answer(chk: _Checker, path: Path, data: Any, reader: str) -> dict[str, Any]:
    if reader == "ansible" or (reader == "auto" and ansible_inventory.available()):
        if not ansible_inventory.available():
            raise chk.fail(None, None, "ansible-core is not installed (CLUSTERCTL_INVENTORY_READER=ansible)",
                           ansible_inventory.INSTALL_FIX)
        return ansible_inventory.resolve([path])
    if path.is_dir():
        raise chk.fail(None, None, "an inventory directory: not in the subset read without Ansible",
                       ansible_inventory.INSTALL_FIX)
    if path.suffix not in ansible_yaml.YAML_EXTENSIONS or data is None or isinstance(data, str):
        raise chk.fail(None, None, "not a YAML inventory (Ansible reads it as INI): INI inventories are not "
                       "in the subset read without Ansible", ansible_inventory.INSTALL_FIX)
    return ansible_yaml.read(path, data)


def _is_true(value: Any) -> bool:
    return (value.strip().lower() if isinstance(value, str) else value) in _ANSIBLE_TRUE


def _finish(chk: _Checker, path: Path, answer: dict[str, Any], cli: list[tuple[str, Any]],
            check_files: bool) -> Inventory:
    raw_hosts: dict[str, _Layers] = {}
    rank0: list[str] = []
    for h in answer["hosts"]:
        name = h["name"]
        origins = h.get("origins", {})

        def where(var: str) -> tuple[_Checker, int | None, str]:
            o = origins.get(var) or [None, None]
            return (_Checker(Path(o[0])) if o[0] else chk), o[1], f"{name}.{var}"

        def refuse(var: str, msg: str, fix: str) -> InventoryError:
            c, line, field_path = where(var)
            return c.fail(line, field_path, msg, fix)

        _check_name(chk, name, where(name)[1] if name in origins else None, f"hosts.{name}",
                    "rename the host (the name is a label: put its address in ansible_host)")
        values, errors = h["vars"], h["errors"]
        for var in sorted(set(values) | set(errors)):
            if _SECRET.match(var) and (var in errors or values.get(var) not in (None, "")):
                raise refuse(var, "a password in the inventory: clusterctl never uses passwords",
                             "use SSH keys (ssh-copy-id; a passphrase key through ssh-agent) and remove "
                             f"{var} from what clusterctl reads")
            if var in _SSH_ARGS and (var in errors or values.get(var) not in (None, "")):
                raise refuse(var, "extra SSH settings: clusterctl's SSH client (paramiko) cannot honour them, "
                             "it would connect differently from Ansible",
                             "reach the node directly (ansible_host, ansible_port), or use ~/.ssh/config "
                             "with plain `ssh` for jump hosts")
            if var in errors and (var in _CONSUMED or var.startswith("clusterctl_") or var == "ansible_become"):
                raise refuse(var, f"Ansible cannot resolve this value before a play runs: {errors[var]}",
                             "give it a value that does not depend on facts or play variables")
        if _is_true(values.get("ansible_become")):
            raise refuse("ansible_become", "become (sudo/su) is set: clusterctl runs everything as the SSH user "
                         "and never becomes another user",
                         "set ansible_become in your playbooks instead, or give the nodes a workdir that "
                         "user can write")
        conn = h["conn"]
        connection = conn["connection"]
        if connection in ("ssh", "paramiko", "paramiko_ssh"):
            connection = "ssh"
        elif connection != "local":
            raise refuse("ansible_connection", f"connection {connection!r} is not supported",
                         "clusterctl reaches nodes with `ssh` (or `paramiko`), or `local` for this machine")
        fields = _Map()
        fields.line, fields.lines, fields.dups = 0, {}, []

        def put(key: str, value: Any, var: str) -> None:
            c, line, field_path = where(var)
            fields[key] = c.value(key, value, line, field_path)
            fields.lines[key] = line

        put("address", conn["address"], "ansible_host")
        put("connection", connection, "ansible_connection")
        if conn.get("port") is not None:
            put("port", conn["port"], "ansible_port")
        if conn.get("user") is not None:
            put("user", conn["user"], "ansible_user")
        if conn.get("key") is not None:
            put("identity_file", conn["key"], "ansible_ssh_private_key_file")
        interp = values.get("ansible_python_interpreter")
        if interp is not None and interp not in _INTERPRETER_DISCOVERY:
            put("python", interp, "ansible_python_interpreter")
        free: dict[str, Any] = {}
        for var, value in values.items():
            if var in _CONSUMED:
                continue
            if var.startswith("clusterctl_"):
                target = var[len("clusterctl_"):]
                if target == "rank0":
                    if _is_true(value):
                        rank0.append(name)
                    continue
                if target not in HOST_FIELDS or target in ("address", "connection"):
                    c, line, field_path = where(var)
                    allowed = [f for f in HOST_FIELDS if f not in ("address", "connection")]
                    raise c.fail(line, field_path, "unknown clusterctl field",
                                 f"use one of: {', '.join('clusterctl_' + f for f in allowed + ['rank0'])}")
                put(target, value, var)
                continue
            free[var] = value
        if "vars" in fields:
            free.update(fields["vars"])
        fields["vars"] = free
        raw_hosts[name] = [(fields, None, f"hosts.{name}")]
    if not raw_hosts:
        raise chk.fail(None, None, "the inventory has no hosts", "add at least one host")
    groups = {g: tuple(members) for g, members in answer["groups"].items()}
    hosts = {n: _build_host(chk, n, layers, cli, groups) for n, layers in raw_hosts.items()}
    if len(rank0) > 1:
        raise chk.fail(None, "clusterctl_rank0", f"set true on several hosts ({', '.join(rank0)})",
                       "set clusterctl_rank0: true on one host only (not in group vars)")
    inv = Inventory(path=path, name=_default_name(chk, path), hosts=hosts, groups=groups,
                    rank0=rank0[0] if rank0 else next(iter(hosts)), format="ansible")
    if check_files:
        _check_files(chk, inv, raw_hosts)
    return inv


_CLI_CHECKER = _Checker(Path("command line"))


def _build_host(chk: _Checker, name: str, layers: _Layers, cli: list[tuple[str, Any]],
                groups: Mapping[str, tuple[str, ...]]) -> Host:
    merged: dict[str, Any] = {}
    merged_vars: dict[str, Any] = {}
    for fields, _, _ in layers:
        merged_vars.update(fields.get("vars", {}))
        merged.update({k: v for k, v in fields.items() if k != "vars"})
    for key, value in cli:
        path = f"--set {key}"
        if key.startswith("vars."):
            merged_vars[key[5:]] = value
            continue
        if key not in HOST_FIELDS or key == "vars":
            close = difflib.get_close_matches(key, HOST_FIELDS, n=1)
            raise InventoryError("command line", None, path, "unknown field",
                                 f"did you mean '{close[0]}'?" if close else f"use one of: {', '.join(HOST_FIELDS)}")
        merged[key] = _CLI_CHECKER.value(key, value, None, path)
    merged["vars"] = merged_vars
    merged["groups"] = tuple(g for g, members in groups.items() if name in members)
    host = Host(name=name, **merged)
    if host.connection == "ssh" and host.workdir.startswith("~"):
        # Remote commands start in the login directory, so `~/x` (or `~user/x` for the login user
        # itself) is just `x` there. Another user's home is unknown on the head: refused, not guessed.
        owner, _, rest = host.workdir[1:].partition("/")
        if owner not in ("", host.user):
            line, where = _origin(layers, "workdir")
            raise chk.fail(line, f"{where}.workdir", f"{host.workdir!r} is in the home of '{owner}', "
                           f"but clusterctl logs in as '{host.user}' and cannot know where that home is",
                           f"write the absolute path (e.g. /home/{owner}/{rest or ''}), or log in as "
                           f"'{owner}'")
        host = replace(host, workdir=rest.lstrip("/") or ".")
    if host.connection == "local":
        host = replace(host, workdir=os.path.expanduser(host.workdir))
    return host


def _check_files(chk: _Checker, inv: Inventory, raw: dict[str, _Layers]) -> None:
    for host in inv.hosts.values():
        if host.connection != "ssh":
            continue
        key = host.key_path
        if key is not None and not os.access(key, os.R_OK):
            line, where = _origin(raw[host.name], "identity_file")
            why = "does not exist" if not key.exists() else "is not readable by this user"
            raise chk.fail(line, f"{where}.identity_file", f"key file {key} {why}",
                           "create one with `ssh-keygen -t ed25519` or fix the path")
        kh = host.known_hosts_path
        if kh.exists() and not os.access(kh, os.R_OK):
            line, where = _origin(raw[host.name], "known_hosts")
            raise chk.fail(line, f"{where}.known_hosts", f"{kh} is not readable by this user",
                           "fix its permissions or point known_hosts elsewhere")


def _origin(layers: _Layers, key: str) -> tuple[int | None, str]:
    """The line and path of the layer that set `key` last (the one that won)."""
    for fields, line, where in reversed(layers):
        if key in fields:
            return getattr(fields, "lines", {}).get(key, line), where
    return None, "defaults"
