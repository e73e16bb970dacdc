"""Inventory: YAML (own schema or Ansible's) -> validated, layered hosts.

Layering: defaults < group (in file order) < host < command line (`--set`).
Every error names the file, the line, the dotted field and the fix (docs/inventory.md).
This module reads the file and clusterctl's own schema; the host model is in cluster.inventory.model,
value validation and layering in cluster.inventory.check, Ansible's answers in cluster.inventory.ansible.
"""
from __future__ import annotations

import dataclasses

import os
from pathlib import Path
from typing import Any, Iterable

import yaml

from cluster.bounds import FILE_MAX_BYTES, FileRefused, read_regular
from cluster.errors import InventoryError
from cluster.inventory.check import Checker, Layers, build_host, check_name, default_name
from cluster.inventory.check import check_files as _check_files
from cluster.inventory.model import HOST_FIELDS, TOP_KEYS, Inventory
from cluster.inventory.sshconfig import Resolver
from cluster.inventory.clusters import read_section as _slurm_section
from cluster.yamlfile import Loader as _Loader
from cluster.yamlfile import Map as _Map
from cluster.yamlfile import line_of as _line

__all__ = ["READERS", "load", "parse_override"]

READERS = ("auto", "ansible", "builtin")
INVENTORY_FIX = (f"give the inventory itself: its file (a regular file of at most {FILE_MAX_BYTES >> 20} MiB) "
                 "or its folder")


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
    """Read and validate an inventory (see _load), keeping the overrides it was read with."""
    given = tuple(overrides)
    inv = _load(path, given, check_files, reader)
    return dataclasses.replace(inv, overrides=given) if given else inv


def _load(path: str | Path, overrides: Iterable[str] = (), check_files: bool = True,
          reader: str | None = None) -> Inventory:
    """Read and validate an inventory. `check_files` verifies key files are readable.

    `reader` (default: $CLUSTERCTL_INVENTORY_READER, else `auto`) chooses how an Ansible inventory is
    read: `ansible` through ansible-core, `builtin` with the exact subset of cluster.inventory.ansible_yaml,
    `auto` through ansible-core where it is installed. clusterctl's own schema is always read here.
    """
    path = Path(path)
    reader = reader or os.environ.get("CLUSTERCTL_INVENTORY_READER") or "auto"
    if reader not in READERS:
        raise InventoryError("environment", None, "CLUSTERCTL_INVENTORY_READER", f"unknown reader {reader!r}",
                             f"use one of: {', '.join(READERS)}")
    cli = [parse_override(o) for o in overrides]
    chk = Checker(path)
    if path.is_dir():
        from cluster.inventory import ansible as inventory_ansible  # only Ansible's inventories: a cold command's start

        return inventory_ansible.finish(chk, path, inventory_ansible.answer(chk, path, None, reader), cli,
                                        check_files)
    text = _read_text(path)
    data, yaml_error = _parse_yaml(path, text)
    is_yaml_file = path.suffix in (".yaml", ".yml", ".json")
    if yaml_error is not None and is_yaml_file:
        raise yaml_error  # Ansible reads these extensions as YAML only: the YAML error is the answer
    if yaml_error is None and isinstance(data, dict) and data and set(data) <= set(TOP_KEYS) \
            and (is_yaml_file or path.suffix == "") and not _ansible_slurm_group(data):
        return _load_own(chk, path, data, cli, check_files)
    from cluster.inventory import ansible as inventory_ansible

    ans = inventory_ansible.answer(chk, path, data if yaml_error is None else None, reader)
    return inventory_ansible.finish(chk, path, ans, cli, check_files)


def _read_text(path: Path) -> str:
    try:
        raw = read_regular(path, INVENTORY_FIX, noun="an inventory")
    except FileRefused as e:
        raise InventoryError(str(path), None, None, f"cannot read inventory: it {e.problem}", e.fix) from None
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


# --------------------------------------------------------------------------- clusterctl's own schema


def _load_own(chk: Checker, path: Path, raw: Any, cli: list[tuple[str, Any]], check_files: bool) -> Inventory:
    data = chk.mapping(raw, 1, "inventory")
    chk.keys(data, TOP_KEYS, "inventory")
    raw_hosts = _own_hosts(chk, data)
    groups = _own_groups(chk, data, raw_hosts)
    name = data.get("name")
    if name is not None:
        check_name(chk, str(name), _line(data, "name"), "name", "write a name of letters, digits, '.', '_' or '-'")
    ssh = Resolver(str(path))
    hosts = ssh.resolve_all(lambda n: build_host(chk, n, raw_hosts[n], cli, groups, ssh), raw_hosts)
    clusters, rooms = _slurm_section(chk, data, cli, ssh, hosts, groups, check_files)  # `slurm:` (docs/slurm.md)
    if not hosts and not clusters:  # a university cluster's user may have no PCs of their own: a cluster is enough
        raise chk.fail(_line(data), "hosts", "the inventory has no hosts", "add at least one host with an address")
    rank0 = next(iter(hosts), "")
    if "rank0" in data:
        rank0 = str(data["rank0"])
        if rank0 not in hosts:
            raise chk.fail(_line(data, "rank0"), "rank0", f"'{rank0}' is not a host of this inventory",
                           f"use one of: {', '.join(hosts)}")
    inv_name = str(name) if name is not None else default_name(chk, path)
    inv = Inventory(path=path, name=inv_name, hosts=hosts, groups=groups, rank0=rank0, format="clusterctl",
                    notes=tuple(ssh.notes), clusters=clusters, rooms=rooms)
    if check_files:
        _check_files(chk, inv, raw_hosts)
    return inv


def _ansible_slurm_group(data: dict[str, Any]) -> bool:
    """An Ansible YAML inventory whose only group is called `slurm` (`slurm: {hosts: ...}`) is Ansible's, not
    clusterctl's `slurm:` section: that section maps cluster names to entries, never only hosts/children/vars."""
    value = data.get("slurm")
    return set(data) == {"slurm"} and isinstance(value, dict) and bool(value) \
        and set(value) <= {"hosts", "children", "vars"}


def _own_hosts(chk: Checker, data: _Map) -> dict[str, Layers]:
    """Each host's layers so far: the defaults, then the host's own fields (groups go in between)."""
    defaults = chk.mapping(data.get("defaults"), _line(data, "defaults"), "defaults")
    chk.keys(defaults, [f for f in HOST_FIELDS if f != "address"], "defaults")
    base = chk.host_fields(defaults, "defaults", allow_address=False)
    hosts_m = chk.mapping(data.get("hosts"), _line(data, "hosts"), "hosts")
    raw: dict[str, Layers] = {}
    for hname, hval in hosts_m.items():
        hpath = f"hosts.{hname}"
        check_name(chk, str(hname), _line(hosts_m, hname), hpath,
                   "rename the host (the name is a label: its address goes in `address:`)")
        hm = chk.mapping(hval, _line(hosts_m, hname), hpath)
        chk.keys(hm, HOST_FIELDS, hpath)
        raw[str(hname)] = [(base, _line(data, "defaults"), "defaults"),
                           (chk.host_fields(hm, hpath, allow_address=True), _line(hosts_m, hname), hpath)]
    return raw


def _own_groups(chk: Checker, data: _Map, raw: dict[str, Layers]) -> dict[str, tuple[str, ...]]:
    """The groups and their members; each group's fields go into its members' layers, in file order."""
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
    return groups
