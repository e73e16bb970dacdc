"""Inventory validation: each raw YAML value checked and normalised, layers merged into a Host.

Every failure raises InventoryError naming file, line, dotted field and the fix (docs/inventory.md).
Both inventory formats (clusterctl's own schema and Ansible's) end here, so they cannot drift apart.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from cluster.bounds import file_problem
from cluster.errors import InventoryError
from cluster.inventory.model import (CONNECTIONS, GPU_KEYS, HOST_FIELDS, HOST_ONLY, KNOWN_HOSTS_MAX_BYTES, NUMBERS,
                                     GpuSpec, Host, Inventory, normalize_mac)
from cluster.inventory.sshconfig import Resolver
from cluster.yamlfile import NUL_MESSAGE, Map, nul_in
from cluster.yamlfile import line_of as _line

# A host's raw layers: list of (fields, where-it-came-from line/path), lowest precedence first.
Layers = list[tuple[dict[str, Any], int | None, str]]

# A name clusterctl uses as a file name on the head and as a word in files that shells source.
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")

_EXAMPLES = {
    "address": "192.168.1.11",
    "user": "student",
    "identity_file": "~/.ssh/id_ed25519",
    "known_hosts": "~/.ssh/known_hosts",
    "python": "python3",
    "workdir": "/srv/cluster",
}


def kind(value: Any) -> str:
    """What a YAML value is, in the words an error message uses."""
    if value is None:
        return "nothing (empty value)"
    return {dict: "a mapping", Map: "a mapping", list: "a list", bool: "true/false", str: "a string",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


class Checker:
    """Validates raw YAML values; every failure raises InventoryError naming file/line/field."""

    def __init__(self, file: Path) -> None:
        self.file = str(file)

    def fail(self, line: int | None, path: str | None, msg: str, fix: str | None = None) -> InventoryError:
        return InventoryError(self.file, line, path, msg, fix)

    def mapping(self, value: Any, line: int | None, path: str) -> Map:
        if value is None:
            value = Map.new(line=line or 0)
        if not isinstance(value, dict):
            raise self.fail(line, path, f"expected a mapping, got {kind(value)}",
                            f"write `{path.rsplit('.', 1)[-1]}:` followed by indented `key: value` lines")
        # a plain dict (Ansible's answer): no lines to keep
        m = value if isinstance(value, Map) else Map.new(value, line=line or 0)
        if m.dups:
            key, first, again = m.dups[0]
            what = "host" if path.endswith("hosts") else "key"
            raise self.fail(again, f"{path}.{key}", f"duplicate {what} '{key}' (first defined on line {first})",
                            f"keep one '{key}' entry under {path}")
        return m

    def keys(self, m: Map, allowed: Iterable[str], path: str) -> None:
        allowed = list(allowed)
        for key in m:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(allowed)}"
                raise self.fail(_line(m, key), f"{path}.{key}", "unknown key", hint)

    def host_fields(self, m: Map, path: str, allow_address: bool) -> Map:
        """Type-check the host fields present in `m` and return them normalised (lines kept)."""
        out = Map.new(line=m.line)
        for key, value in m.items():
            if key not in HOST_FIELDS:
                continue
            line, fpath = _line(m, key), f"{path}.{key}"
            if key in HOST_ONLY and not allow_address:
                raise self.fail(line, fpath, f"only a host can have {'an address' if key == 'address' else 'a MAC'}",
                                "move it under hosts.<name>")
            out[key] = self.value(key, value, line, fpath)
            out.lines[key] = line
        return out

    def value(self, key: str, value: Any, line: int | None, path: str) -> Any:
        if key == "port":
            if not NUMBERS["port"].accepts(value):
                raise self.fail(line, path, f"expected a port number 1-65535, got {value!r}", "e.g. port: 22")
            return value
        if key in ("connect_timeout", "command_timeout"):
            self.number(value, key, line, path, 5 if key == "connect_timeout" else 600)
            return float(value)
        if key == "connection":
            if value not in CONNECTIONS:
                raise self.fail(line, path, f"expected one of {', '.join(CONNECTIONS)}, got {value!r}",
                                "use `ssh` for real PCs, `local` for nodes on this machine")
            return value
        if key == "vars":
            found = nul_in(value)
            if found is not None:
                raise self.fail(line, f"{path}.{found}" if found else path, NUL_MESSAGE, "remove it")
            return dict(self.mapping(value, line, path))
        if key == "gpu":
            return self.gpu(value, line, path)
        if key == "become":
            if not isinstance(value, bool):
                raise self.fail(line, path, f"expected true or false, got {kind(value)}",
                                "become: true (steps that need root run through `sudo -n`)")
            return value
        if key == "mac":
            return self.mac(value, line, path)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool) or value == "":
            raise self.fail(line, path, f"expected a non-empty string, got {kind(value)}",
                            f"e.g. {key}: {_EXAMPLES.get(key, 'value')}")
        if nul_in(value) is not None:  # no path, user name or argv can hold it (ValueError)
            raise self.fail(line, path, NUL_MESSAGE, f"e.g. {key}: {_EXAMPLES.get(key, 'value')}")
        return str(value)

    def mac(self, value: Any, line: int | None, path: str) -> str:
        if isinstance(value, int) and not isinstance(value, bool):  # YAML 1.1 reads 10:20:30:40:50:59 as base 60
            raise self.fail(line, path, "this MAC was read as a number (YAML's base-60 integers)",
                            'quote it: mac: "10:20:30:40:50:59"')
        mac = normalize_mac(value) if isinstance(value, str) else None
        if mac is None:
            raise self.fail(line, path, f"expected an Ethernet address, got {value!r}",
                            'e.g. mac: "1c:6f:65:a0:12:34" (`ip link` on the PC shows it after link/ether)')
        return mac

    def number(self, value: Any, field: str, line: int | None, path: str, example: float) -> None:
        """The inventory's one check of a number (cluster.bounds): its kind, finite, the field's bounds."""
        rng = NUMBERS[field]
        problem = rng.problem(value)
        if problem is not None:
            given = f"{path}={example}" if path.startswith("--set ") else f"{path.rsplit('.', 1)[-1]}: {example}"
            raise self.fail(line, path, f"expected {problem}, got {value!r}",
                            f"e.g. {given} ({field} is {rng}, docs/inventory.md)")

    def gpu(self, value: Any, line: int | None, path: str) -> GpuSpec:
        if value in (None, "none", 0, False):
            return GpuSpec(count=0)
        m = self.mapping(value, line, path)
        self.keys(m, GPU_KEYS, path)
        count = m.get("count", 1)
        self.number(count, "gpu.count", _line(m, "count"), f"{path}.count", 1)
        cc = m.get("compute_capability")
        if cc is not None:
            cc = str(cc)
            try:
                number = float(cc)
            except ValueError:
                number = math.nan  # refused below, as "nan" or "inf" written out are
            if not NUMBERS["gpu.compute_capability"].accepts(number):
                raise self.fail(_line(m, "compute_capability"), f"{path}.compute_capability",
                                f"expected a number like \"6.1\" (CUDA's major.minor, "
                                f"{NUMBERS['gpu.compute_capability']}), got {cc!r}",
                                "e.g. compute_capability: \"6.1\" (quoted, so that 6.10 stays 6.10)")
        model = m.get("model")
        return GpuSpec(count=count, model=None if model is None else str(model), compute_capability=cc)


def check_name(chk: Checker, name: str, line: int | None, where: str, fix: str) -> None:
    if not SAFE_NAME.match(name):
        raise chk.fail(line, where, f"{name!r} cannot be used as a name (it becomes a file name on the head and "
                       "a word in the nodes' shell files): letters, digits, '.', '_' and '-' only, "
                       "not starting with '.' or '-'", fix)


def default_name(chk: Checker, path: Path) -> str:
    name = path.name if path.is_dir() else path.stem
    check_name(chk, name, None, "name", "rename the inventory file (letters, digits, '.', '_', '-'), "
               "or set `name:` in clusterctl's own schema")
    return name


_CLI_CHECKER = Checker(Path("command line"))


def build_host(chk: Checker, name: str, layers: Layers, cli: list[tuple[str, Any]],
               groups: Mapping[str, tuple[str, ...]], ssh: Resolver | None = None) -> Host:
    """The host its layers make (defaults < groups < host < command line), its address the name when none
    is given (as in Ansible), then OpenSSH's client config where the layers are silent (`ssh`, a Resolver
    shared by the inventory's hosts; sshconfig.py), its workdir resolved."""
    merged: dict[str, Any] = {}
    merged_vars: dict[str, Any] = {}
    for fields, _, _ in layers:
        merged_vars.update(fields.get("vars", {}))
        merged.update({k: v for k, v in fields.items() if k != "vars"})
    for key, value in cli:
        path = f"--set {key}"
        if key.startswith("vars."):
            if nul_in(value) is not None or "\0" in key:
                raise InventoryError("command line", None, path, NUL_MESSAGE, "remove it")
            merged_vars[key[5:]] = value
            continue
        if key not in HOST_FIELDS or key == "vars":
            close = difflib.get_close_matches(key, HOST_FIELDS, n=1)
            raise InventoryError("command line", None, path, "unknown field",
                                 f"did you mean '{close[0]}'?" if close else f"use one of: {', '.join(HOST_FIELDS)}")
        merged[key] = _CLI_CHECKER.value(key, value, None, path)
    given = set(merged)
    merged.setdefault("address", name)
    merged["vars"] = merged_vars
    merged["groups"] = tuple(g for g, members in groups.items() if name in members)
    host = (ssh or Resolver(chk.file)).resolve(Host(name=name, **merged), given)
    return _resolve_workdir(chk, host, layers)


def _resolve_workdir(chk: Checker, host: Host, layers: Layers) -> Host:
    if host.connection == "ssh" and host.workdir.startswith("~"):
        # Remote commands start in the login directory, so `~/x` (or `~user/x` for the login user
        # itself) is just `x` there. Another user's home is unknown on the head: refused, not guessed.
        owner, _, rest = host.workdir[1:].partition("/")
        if owner not in ("", host.user):
            line, where = origin(layers, "workdir")
            raise chk.fail(line, f"{where}.workdir", f"{host.workdir!r} is in the home of '{owner}', "
                           f"but clusterctl logs in as '{host.user}' and cannot know where that home is",
                           f"write the absolute path (e.g. /home/{owner}/{rest or ''}), or log in as "
                           f"'{owner}'")
        host = replace(host, workdir=rest.lstrip("/") or ".")
    if host.connection == "local":
        host = replace(host, workdir=os.path.expanduser(host.workdir))
    return host


KNOWN_HOSTS_NOUN = "a known_hosts file"  # in "more than a known_hosts file holds"


def known_hosts_problem(st: os.stat_result) -> str | None:
    """Why a known_hosts file cannot be read whole on every command (a device or a FIFO never ends or
    blocks the reader: every command hung), or None."""
    return file_problem(st, KNOWN_HOSTS_MAX_BYTES, KNOWN_HOSTS_NOUN)


def check_files(chk: Checker, inv: Inventory, raw: dict[str, Layers]) -> None:
    """Each SSH host's key file readable, and its known_hosts file, if it exists, a readable regular file of
    sane size."""
    for host in inv.hosts.values():
        if host.connection != "ssh":
            continue
        key = host.key_path
        if key is not None and not os.access(key, os.R_OK):
            line, where = origin(raw[host.name], "identity_file")
            why = "does not exist" if not key.exists() else "is not readable by this user"
            raise chk.fail(line, f"{where}.identity_file", f"key file {key} {why}",
                           "create one with `ssh-keygen -t ed25519` or fix the path")
        kh = host.known_hosts_path
        try:
            problem = known_hosts_problem(kh.stat())
        except OSError:  # absent (trust creates it), or unreachable: the access check below says which
            problem = None
        if problem is not None:
            line, where = origin(raw[host.name], "known_hosts")
            raise chk.fail(line, f"{where}.known_hosts", f"{kh} {problem}",
                           "point known_hosts at a regular file (default ~/.ssh/known_hosts; "
                           "`clusterctl trust` creates it)")
        if kh.exists() and not os.access(kh, os.R_OK):
            line, where = origin(raw[host.name], "known_hosts")
            raise chk.fail(line, f"{where}.known_hosts", f"{kh} is not readable by this user",
                           "fix its permissions or point known_hosts elsewhere")


def origin(layers: Layers, key: str) -> tuple[int | None, str]:
    """The line and path of the layer that set `key` last (the one that won)."""
    for fields, line, where in reversed(layers):
        if key in fields:
            lines: dict[Any, int | None] = getattr(fields, "lines", {})
            return lines.get(key, line), where
    return None, "defaults"
