"""Inventory: YAML (own schema or Ansible's) -> validated, layered hosts.

Layering: defaults < group (in file order) < host < command line (`--set`).
Every error names the file, the line, the dotted field and the fix (docs/inventory.md).
"""
from __future__ import annotations

import difflib
import fnmatch
import getpass
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

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


def load(path: str | Path, overrides: Iterable[str] = (), check_files: bool = True) -> Inventory:
    """Read and validate an inventory. `check_files` verifies key files are readable."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise InventoryError(str(path), None, None, f"cannot read inventory: {e.strerror}",
                             "check the path, or run `clusterctl lab up 3` for a simulated lab") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise InventoryError(str(path), line, None, f"YAML syntax error: {e.problem or e}",
                             "check indentation and that every `key: value` has a space after the colon") from None
    except yaml.YAMLError as e:
        raise InventoryError(str(path), None, None, f"YAML error: {e}", None) from None
    chk = _Checker(path)
    data = chk.mapping(data, 1, "inventory")
    if "all" in data and not (set(data) & set(TOP_KEYS)):
        raw_hosts, groups, rank0, name, fmt = _from_ansible(chk, data)
    else:
        raw_hosts, groups, rank0, name, fmt = _from_own(chk, data, path)
    cli = [parse_override(o) for o in overrides]
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
    inv = Inventory(path=path, name=name or path.stem, hosts=hosts, groups=groups, rank0=rank0, format=fmt)
    if check_files:
        _check_files(chk, inv, raw_hosts)
    return inv


# A host's raw layers: list of (fields, where-it-came-from line/path), lowest precedence first.
_Layers = list[tuple[dict[str, Any], int | None, str]]


def _from_own(chk: _Checker, data: _Map, path: Path):
    chk.keys(data, TOP_KEYS, "inventory")
    defaults = chk.mapping(data.get("defaults"), _line(data, "defaults"), "defaults")
    chk.keys(defaults, [f for f in HOST_FIELDS if f != "address"], "defaults")
    base = chk.host_fields(defaults, "defaults", allow_address=False)
    hosts_m = chk.mapping(data.get("hosts"), _line(data, "hosts"), "hosts")
    raw: dict[str, _Layers] = {}
    for hname, hval in hosts_m.items():
        hpath = f"hosts.{hname}"
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
    return raw, groups, rank0, None if name is None else str(name), "clusterctl"


_ANSIBLE_MAP = {
    "ansible_host": "address",
    "ansible_port": "port",
    "ansible_user": "user",
    "ansible_ssh_private_key_file": "identity_file",
    "ansible_python_interpreter": "python",
    "ansible_connection": "connection",
}


def _ansible_fields(chk: _Checker, m: _Map, path: str, allow_address: bool) -> dict[str, Any]:
    """Ansible vars -> our fields; `clusterctl_<field>` sets a field; the rest become vars."""
    fields: _Map = _Map()
    fields.line, fields.lines, fields.dups = m.line, {}, []
    free: dict[str, Any] = {}
    for key, value in m.items():
        target = _ANSIBLE_MAP.get(key)
        if target is None and str(key).startswith("clusterctl_"):
            target = str(key)[len("clusterctl_"):]
            if target not in HOST_FIELDS and target != "rank0":
                raise chk.fail(_line(m, key), f"{path}.{key}", "unknown clusterctl field",
                               f"use one of: {', '.join('clusterctl_' + f for f in HOST_FIELDS)}")
        if target == "connection" and value in ("paramiko", "smart", "ssh"):
            value = "ssh"
        if target is None:
            free[key] = value
        elif target != "rank0":
            fields[target] = value
            fields.lines[target] = _line(m, key) or m.line
    out = chk.host_fields(fields, path, allow_address=allow_address)
    if free:
        out["vars"] = {**free, **out.get("vars", {})}
    return out


def _from_ansible(chk: _Checker, data: _Map):
    raw: dict[str, _Layers] = {}
    groups: dict[str, list[str]] = {}
    rank0: tuple[str, int | None] | None = None

    def walk(gname: str, gm: _Map, path: str, inherited: _Layers) -> list[str]:
        nonlocal rank0
        chk.keys(gm, ["hosts", "vars", "children"], path)
        gvars = chk.mapping(gm.get("vars"), _line(gm, "vars"), f"{path}.vars")
        layers = inherited + [(_ansible_fields(chk, gvars, f"{path}.vars", False), _line(gm, "vars"), path)]
        members: list[str] = []
        hosts_m = chk.mapping(gm.get("hosts"), _line(gm, "hosts"), f"{path}.hosts")
        for hname, hval in hosts_m.items():
            hname, hpath = str(hname), f"{path}.hosts.{hname}"
            hm = chk.mapping(hval, _line(hosts_m, hname), hpath)
            if hm.get("clusterctl_rank0") is True and rank0 is None:
                rank0 = (hname, _line(hm, "clusterctl_rank0"))
            own = _ansible_fields(chk, hm, hpath, True)
            if hname in raw:  # the same host listed in another group: add this group's layers
                prev_own = raw[hname].pop()
                raw[hname].extend(layers[len(inherited):])
                raw[hname].append(({**prev_own[0], **own}, prev_own[1], prev_own[2]))
            else:
                own.setdefault("address", hname)  # as in Ansible: no ansible_host, the name is the address
                raw[hname] = layers + [(own, _line(hosts_m, hname), hpath)]
            members.append(hname)
        children = chk.mapping(gm.get("children"), _line(gm, "children"), f"{path}.children")
        for cname, cval in children.items():
            cpath = f"{path}.children.{cname}"
            members += walk(str(cname), chk.mapping(cval, _line(children, cname), cpath), cpath, layers)
        groups.setdefault(gname, [])
        groups[gname] += [m for m in members if m not in groups[gname]]
        return members

    top = chk.mapping(data["all"], _line(data, "all"), "all")
    walk("all", top, "all", [])
    groups.pop("all", None)
    return raw, {g: tuple(m) for g, m in groups.items()}, rank0, None, "ansible"


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
        # Remote commands start in the login directory, so `~/x` is just `x` there.
        host = replace(host, workdir=host.workdir[1:].lstrip("/") or ".")
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
