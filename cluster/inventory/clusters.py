"""The inventory's `slurm:` section (clusterctl's own schema): the Slurm clusters `launch JOB --on NAME` uses.

    slurm:
      slurm:                                  # the cluster's name: `launch JOB --on slurm`
        login: {address: 10.77.0.200}         # a host entry: reached like any host (defaults, jump hosts,
                                              #   the OpenSSH config), never a compute node
        partition: debug                      # default partition (else Slurm's); account, qos optional
        account: null
        qos: null
        workdir: /srv/slurm-shared/clusterctl # on the shared filesystem every node mounts (absolute)
        python: /opt/venv/bin/python          # an environment that exists on the cluster ...
        env_setup: "module load pytorch/2.3"  # ... and/or shell lines run before it

The room itself as a Slurm cluster (`clusterctl provision --slurm` sets it up; no login node, no shared
folder) is an entry with a controller instead of a login node:

    slurm:
      room:
        controller: gw                        # an inventory host, or a host entry ({address: ..., ...});
                                              #   it runs slurmctld only, never a job
        nodes: lab                            # the compute PCs: a group or host pattern of the inventory
        partition: room                       # the partition they form (default: room)
        suspend_after: 30m                    # Slurm switches a PC idle this long off, and wakes it for a job
                                              #   (90s, 30m, 1h or seconds); resume_timeout: how long a woken
                                              #   PC may take (default: 1.5x its slowest recorded wake)

Read here with the inventory's Checker, so every error names the file, the line, the dotted field
(`slurm.NAME.workdir`) and the fix, as the hosts' errors do. The login entry goes through the same layering
(defaults < login < `--host-set`) and OpenSSH-config resolution (cluster.inventory.sshconfig) as a host.
Values that reach `#SBATCH` lines (workdir, partition, account, qos) are refused unless they are plain
words: sbatch reads those lines itself, no shell quoting applies there.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster.inventory.check import Checker, Layers, build_host, check_files, check_name, kind
from cluster.errors import InventoryError
from cluster.inventory import patterns
from cluster.inventory.model import HOST_FIELDS, Host, Inventory, RoomCluster, SlurmCluster
from cluster.inventory.sshconfig import Resolver
from cluster.yamlfile import Map
from cluster.yamlfile import line_of as _line

SECTION = "slurm"
CLUSTER_KEYS = ("login", "partition", "account", "qos", "workdir", "python", "env_setup")
ROOM_KEYS = ("controller", "nodes", "partition", "default_time", "max_time", "max_pcs_per_job", "suspend_after",
             "resume_timeout")
LOGIN_FIELDS = tuple(f for f in HOST_FIELDS if f != "workdir")  # the cluster's workdir is the one that counts
# A partition, account or QoS name as it goes on an #SBATCH line (Slurm's names are words like these).
SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,63}\Z")
# Slurm's --time forms (sbatch(1)): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
SLURM_TIME = re.compile(r"(?:(?P<d>\d{1,4})-(?P<dh>\d{1,2})(?::(?P<dm>\d{1,2})(?::(?P<ds>\d{1,2}))?)?"
                        r"|(?P<a>\d{1,7})(?::(?P<b>\d{1,2})(?::(?P<c>\d{1,2}))?)?)\Z")
# The workdir goes into #SBATCH --chdir/--output: no blanks (sbatch splits there), no % (sbatch's file-name
# patterns, %j %t ...), no quotes; an absolute path of plain path characters.
WORKDIR_RE = re.compile(r"/[A-Za-z0-9_.+@/-]*\Z")
# Slurm's power-saving times (SuspendTime, ResumeTimeout) are seconds: `90s`, `30m`, `1h` or a number of seconds.
SECONDS_RE = re.compile(r"(?P<n>\d{1,7})\s*(?P<unit>[smh]?)\Z")
SECONDS_MAX = 7 * 86400  # a week: longer is not power saving


def read_section(chk: Checker, data: Map, cli: list[tuple[str, Any]], ssh: Resolver, hosts: dict[str, Host],
                 groups: dict[str, tuple[str, ...]], files: bool = True
                 ) -> tuple[dict[str, SlurmCluster], dict[str, RoomCluster]]:
    """The inventory's `slurm:` section (absent: none), every entry checked: the clusters (a login node) and
    the rooms (a controller); `cli`: --host-set, applied to each login node and controller as to every host;
    `files`: check their key files as a host's."""
    if data.get(SECTION) is None:
        return {}, {}
    section = chk.mapping(data.get(SECTION), _line(data, SECTION), SECTION)
    defaults = chk.mapping(data.get("defaults"), _line(data, "defaults"), "defaults")
    base = chk.host_fields(defaults, "defaults", allow_address=False)  # checked as the hosts' loader does
    clusters, rooms = {}, {}
    for name, value in section.items():
        layer = (base, _line(data, "defaults"), "defaults")
        if isinstance(value, dict) and "controller" in value:
            rooms[str(name)] = _room(chk, section, str(name), value, layer, cli, ssh, hosts, groups, files)
        else:
            clusters[str(name)] = _cluster(chk, section, str(name), value, layer, cli, ssh, files)
    return clusters, rooms


def _room(chk: Checker, section: Map, name: str, value: Any, defaults: tuple[Any, int | None, str],
          cli: list[tuple[str, Any]], ssh: Resolver, hosts: dict[str, Host], groups: dict[str, tuple[str, ...]],
          files: bool) -> RoomCluster:
    where, line = f"{SECTION}.{name}", _line(section, name)
    check_name(chk, name, line, where, "rename the room (letters, digits, '.', '_', '-')")
    m = chk.mapping(value, line, where)
    chk.keys(m, ROOM_KEYS, where)
    given = m.get("nodes")
    if not isinstance(given, str) or not given.strip():
        raise chk.fail(_line(m, "nodes") or line, f"{where}.nodes", "a room needs its compute PCs",
                       "nodes: lab (a group of the inventory, or a host pattern such as node[1:8])")
    try:
        nodes = tuple(patterns.match(given, list(hosts), groups, chk.file, f"{where}.nodes"))
    except InventoryError as e:
        raise chk.fail(_line(m, "nodes"), f"{where}.nodes", e.detail, e.fix) from None
    controller = _controller(chk, m, where, defaults, cli, ssh, hosts, files)
    if controller.name in nodes:
        raise chk.fail(_line(m, "controller"), f"{where}.controller", f"{controller.name} is also one of "
                       f"{where}.nodes: the controller runs slurmctld, never a job",
                       "pick a PC outside the group (an old one is enough), or leave it out of `nodes`")
    partition = _slurm_name(chk, m, "partition", where) or "room"
    times = {k: _time(chk, m, k, where) for k in ("default_time", "max_time")}
    cap = m.get("max_pcs_per_job")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= len(nodes)):
        raise chk.fail(_line(m, "max_pcs_per_job"), f"{where}.max_pcs_per_job", f"expected a number of PCs from 1 "
                       f"to {len(nodes)} (the room's), got {cap!r}", "e.g. max_pcs_per_job: 2, or leave it out")
    return RoomCluster(name=name, controller=controller, nodes=nodes, partition=partition, max_pcs_per_job=cap,
                       **times, suspend_after=_seconds(chk, m, "suspend_after", where),
                       resume_timeout=_seconds(chk, m, "resume_timeout", where))


def _seconds(chk: Checker, m: Map, key: str, where: str) -> int | None:
    """`suspend_after` / `resume_timeout` in seconds (Slurm's SuspendTime and ResumeTimeout are seconds)."""
    value = m.get(key)
    if value is None:
        return None
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    got = SECONDS_RE.match(text)
    seconds = int(got["n"]) * {"": 1, "s": 1, "m": 60, "h": 3600}[got["unit"]] if got else 0
    if not 0 < seconds <= SECONDS_MAX:
        raise chk.fail(_line(m, key), f"{where}.{key}", f"expected a time in seconds from 1 s to 7 days (Slurm's "
                       f"{'SuspendTime' if key == 'suspend_after' else 'ResumeTimeout'} is seconds), got {value!r}",
                       f"e.g. {key}: 30m, 90s, 1h, or a number of seconds such as {key}: 1800")
    return seconds


def _time(chk: Checker, m: Map, key: str, where: str) -> str | None:
    value = m.get(key)
    if value is None:
        return None
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if not SLURM_TIME.match(text) or text.strip("0:-") == "":
        raise chk.fail(_line(m, key), f"{where}.{key}", f"expected a Slurm time limit, got {value!r}",
                       f"e.g. {key}: 2:00:00 (hours:minutes:seconds), 90 (minutes) or 1-12:00:00 (days-hours...)")
    return text


def _controller(chk: Checker, m: Map, where: str, defaults: tuple[Any, int | None, str],
                cli: list[tuple[str, Any]], ssh: Resolver, hosts: dict[str, Host], files: bool) -> Host:
    """The controller: an inventory host by name, or a host entry of its own (the head reaches it as a host)."""
    value, line, field = m.get("controller"), _line(m, "controller"), f"{where}.controller"
    if isinstance(value, str):
        if value not in hosts:
            raise chk.fail(line, field, f"'{value}' is not a host of this inventory",
                           f"use one of: {', '.join(hosts)}, or a host entry: controller: {{address: ...}}")
        return hosts[value]
    cm = chk.mapping(value, line, field)
    chk.keys(cm, LOGIN_FIELDS, field)
    if "address" not in cm:
        raise chk.fail(line, f"{field}.address", "the controller needs its address", "controller: {address: 10.0.0.2}")
    layers: Layers = [defaults, (chk.host_fields(cm, field, allow_address=True), line, field)]
    host = build_host(chk, "controller", layers, cli, {}, ssh)
    if files:
        inv = Inventory(path=Path(chk.file), name=where, hosts={host.name: host}, groups={}, rank0=host.name)
        check_files(chk, inv, {host.name: layers})
    return host


def _cluster(chk: Checker, section: Map, name: str, value: Any, defaults: tuple[Any, int | None, str],
             cli: list[tuple[str, Any]], ssh: Resolver, files: bool) -> SlurmCluster:
    where = f"{SECTION}.{name}"
    line = _line(section, name)
    check_name(chk, name, line, where, "rename the cluster (letters, digits, '.', '_', '-': `launch --on NAME`)")
    m = chk.mapping(value, line, where)
    chk.keys(m, CLUSTER_KEYS, where)
    if m.get("login") is None:
        raise chk.fail(line, f"{where}.login", "a Slurm cluster needs its login node",
                       "login: {address: login.cluster.example.edu} (the host you `ssh` to and run sbatch on)")
    login_m = chk.mapping(m["login"], _line(m, "login"), f"{where}.login")
    if "workdir" in login_m:
        raise chk.fail(_line(login_m, "workdir"), f"{where}.login.workdir", "the login node has no workdir of "
                       "its own here", f"set {where}.workdir (the folder on the cluster's shared filesystem)")
    chk.keys(login_m, LOGIN_FIELDS, f"{where}.login")
    layers: Layers = [defaults, (chk.host_fields(login_m, f"{where}.login", allow_address=True),
                                 _line(m, "login"), f"{where}.login")]
    if "address" not in login_m:
        raise chk.fail(_line(m, "login"), f"{where}.login.address", "the login node needs its address",
                       "login: {address: login.cluster.example.edu}")
    workdir = _workdir(chk, m, where)
    login = build_host(chk, f"{name}-login", layers, cli, {}, ssh)
    login = replace(login, workdir=workdir)
    if files:  # its key file and known_hosts checked exactly as a host's
        inv = Inventory(path=Path(chk.file), name=name, hosts={login.name: login}, groups={}, rank0=login.name)
        check_files(chk, inv, {login.name: layers})
    names = {k: _slurm_name(chk, m, k, where) for k in ("partition", "account", "qos")}
    return SlurmCluster(name=name, login=login, workdir=workdir, python=_text(chk, m, "python", where) or "python3",
                        env_setup=_text(chk, m, "env_setup", where), **names)


def _workdir(chk: Checker, m: Map, where: str) -> str:
    value = m.get("workdir")
    line, field = _line(m, "workdir"), f"{where}.workdir"
    if value is None:
        raise chk.fail(_line(m), field, "a Slurm cluster needs the folder its jobs use on the shared filesystem",
                       "workdir: /scratch/<you>/clusterctl (a folder every compute node and the login node see)")
    if not isinstance(value, str) or not value.startswith("/"):
        raise chk.fail(line, field, f"expected an absolute path, got {kind(value) if not isinstance(value, str) else repr(value)}",
                       "workdir: /scratch/<you>/clusterctl (the same path on the login node and every compute node)")
    norm = posixpath.normpath(value)
    if not WORKDIR_RE.match(value) or ".." in value.split("/") or norm == "/":
        raise chk.fail(line, field, f"{value!r} cannot go on an #SBATCH line (sbatch splits it at blanks and "
                       "reads % as a file-name pattern): letters, digits and . _ + @ - / only, below /",
                       "choose a folder of plain characters, e.g. /scratch/<you>/clusterctl")
    return norm


def _slurm_name(chk: Checker, m: Map, key: str, where: str) -> str | None:
    value = m.get(key)
    if value is None:
        return None
    if not isinstance(value, (str, int)) or isinstance(value, bool) or not SLURM_NAME.match(str(value)):
        raise chk.fail(_line(m, key), f"{where}.{key}", f"expected a Slurm {key} name (letters, digits, _ . + -), "
                       f"got {value!r}", f"`sinfo -s` lists the partitions; `sacctmgr show assoc user=$USER` the "
                       f"accounts and QoS (or leave {key} out: Slurm's default)")
    return str(value)


def _text(chk: Checker, m: Map, key: str, where: str) -> str | None:
    value = m.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\0" in value or (key == "python" and "\n" in value):
        example = {"python": "python: /opt/venv/bin/python", "env_setup": 'env_setup: "module load pytorch/2.3"'}
        what = "a non-empty string" + (" of one line" if key == "python" else "")
        raise chk.fail(_line(m, key), f"{where}.{key}", f"expected {what}, got {kind(value)}", example[key])
    return value.strip("\n") if key == "env_setup" else value
