"""Slurm's power saving for a room (inventory `slurm.ROOM.suspend_after`): what slurm.conf is told, and
what the power program's log on the controller (cluster/room/slurm_power.py) says about the hours each PC
was off and the energy that saved.

Where wake times are recorded: `clusterctl wake` (and `launch --wake`) measures each PC's seconds from its
first magic packet to its SSH answer and keeps each PC's slowest beside its MAC, in the head's per-inventory
record (cluster.nodes.power.record_wakes: CLUSTERCTL_HOME/state/<inventory>.macs.json, `wake_s`). Slurm's
ResumeTimeout is 1.5x the slowest of the room's PCs (at least Slurm's own 60 s default: slurmd registers
some seconds after sshd answers), 300 s where none is recorded; the inventory's `resume_timeout` wins.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from cluster.errors import UsageError
from cluster.inventory import hostkeys
from cluster.inventory.model import Host, Inventory, RoomCluster
from cluster.nodes import power as nodepower
from cluster.room import held, slurm_power
from cluster.room.conf import POWER_NAMES, Power
from cluster.room.plan import Action, sha256, write_file
from cluster.room.state import AUTH_TAG, POWER_BIN, POWER_DIR, POWER_FILES, PcState, as_root

PROGRAM, KEY, KNOWN_HOSTS, PCS, SUDOERS = POWER_FILES
POWEROFF = "/usr/sbin/poweroff"  # Debian's (-> systemctl); the lab's power switch takes its place in each PC
DEFAULT_RESUME_S = 300
MIN_RESUME_S = 60  # Slurm's ResumeTimeout default
WAKE_MARGIN = 1.5


def settings(inv: Inventory, room: RoomCluster) -> Power | None:
    """The room's power saving for slurm.conf; None where it has no `suspend_after` (its PCs stay on)."""
    if room.suspend_after is None:
        return None
    if room.resume_timeout is not None:
        return Power(room.suspend_after, room.resume_timeout, "the inventory's resume_timeout")
    record = nodepower.recorded(inv)
    wakes = {n: float(record[n]["wake_s"]) for n in room.nodes
             if isinstance((record.get(n) or {}).get("wake_s"), (int, float))}
    if not wakes:
        return Power(room.suspend_after, DEFAULT_RESUME_S, f"{DEFAULT_RESUME_S} s: no wake of these PCs is recorded "
                     "yet (`clusterctl wake` records each one's; provision --slurm again then)")
    slowest = max(wakes, key=lambda n: (wakes[n], n))
    seconds = max(MIN_RESUME_S, math.ceil(WAKE_MARGIN * wakes[slowest]))
    return Power(room.suspend_after, seconds, f"{WAKE_MARGIN:g}x the slowest recorded wake ({slowest}: "
                 f"{wakes[slowest]:g} s, by `clusterctl wake`), at least {MIN_RESUME_S} s")


def pcs_json(inv: Inventory, room: RoomCluster) -> dict[str, object]:
    """What the power program reads on the controller (its pcs.json): each PC's address, SSH port and login
    user (whose authorized_keys entry may run only poweroff), its MAC (the inventory's, else the one facts
    recorded; None: not known yet, so it cannot be woken) and the gateway that sends its packet where the
    controller has no address on its network (its last jump host, unless that is the controller)."""
    nodes: dict[str, object] = {}
    for name in room.nodes:
        h = inv.hosts[name]
        gw = h.jumps[-1] if h.jumps and h.jumps[-1].address != room.controller.address else None
        mac = nodepower.mac_of(inv, h)
        nodes[name] = {"address": h.address, "port": h.port, "user": h.user, "mac": mac[0] if mac else None,
                       "gateway": {"address": gw.address, "port": gw.port, "user": gw.user} if gw else None}
    return {"room": room.name, "wol_port": 9, "nodes": nodes}


@dataclass(frozen=True)
class OffTime:
    """One PC's hours off in a period and the energy that saved: hours x its idle watts."""

    node: str
    hours: float
    idle_w: float
    idle_w_source: str  # "facts" or "estimate" (the report's, where no facts give the PC's idle draw)

    @property
    def kwh_saved(self) -> float:
        return self.hours * self.idle_w / 1000.0


def _events(lines: Iterable[str]) -> list[tuple[dt.datetime, str, str]]:
    """(time, node, action) for each PC the program switched off (suspend), sent a wake to (resume), or found
    not woken (resume-fail: it stayed off), in time order; a failed call and a line that is not the program's
    change nothing."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
            when = dt.datetime.fromisoformat(rec["time"])
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(rec, dict) and rec.get("ok") is True and rec.get("action") in ("suspend", "resume",
                                                                                     "resume-fail") \
                and when.tzinfo is not None:
            out.append((when, str(rec["node"]), str(rec["action"])))
    return sorted(out, key=lambda e: e[0])


def off_times(lines: Iterable[str], start: dt.datetime, end: dt.datetime, nodes: Iterable[str],
              idle_w: Mapping[str, float], estimate_w: float) -> list[OffTime]:
    """Each PC's hours off within [start, end) from the power log's JSON lines: off from a successful
    suspend to the next successful resume (one a resume-fail follows did not wake it: still off); a PC off at
    `start` counts from `start`, one still off at `end`
    counts to `end`. `idle_w`: the PCs' idle watts from their facts, where known; else `estimate_w` (the
    report's estimate, cluster.study.node_figures.IDLE_W, which this layer does not import)."""
    if end <= start:
        raise ValueError(f"the period ends ({end.isoformat()}) before it starts ({start.isoformat()})")
    off_since: dict[str, dt.datetime | None] = {n: None for n in nodes}
    seconds = dict.fromkeys(off_since, 0.0)
    woken: dict[str, tuple[dt.datetime, float]] = {}  # the last resume's off period, undone by a resume-fail
    for when, node, action in _events(lines):
        if node not in off_since or when >= end:
            continue
        since = off_since[node]
        if action == "suspend" and since is None:
            off_since[node] = max(when, start)
        elif action == "resume" and since is not None:
            added = max(0.0, (when - since).total_seconds()) if when > start else 0.0
            seconds[node] += added
            off_since[node], woken[node] = None, (since, added)
        elif action == "resume-fail" and since is None and node in woken:
            off_since[node], added = woken.pop(node)
            seconds[node] -= added
    for node, since in off_since.items():
        if since is not None:
            seconds[node] += (end - since).total_seconds()
    return [OffTime(n, seconds[n] / 3600.0, idle_w.get(n, estimate_w),
                    "facts" if n in idle_w else "estimate") for n in off_since]


def saved_over(lines: list[str], nodes: list[str], hours: float, estimate_w: float) -> dict[str, object] | None:
    """`clusterctl room`'s power saving: each PC's hours off in the last `hours` and the energy that saved at
    `estimate_w` (no fact gives a PC's idle draw); None where the room has no power program log."""
    if not lines:
        return None
    end = dt.datetime.now(dt.timezone.utc)
    start = end - dt.timedelta(hours=hours)
    rows = off_times(lines, start, end, nodes, {}, estimate_w)
    return {"start": start.isoformat(timespec="seconds"), "end": end.isoformat(timespec="seconds"),
            "pcs": [{"node": r.node, "hours": round(r.hours, 4), "kwh_saved": round(r.kwh_saved, 5),
                     "idle_w": r.idle_w, "idle_w_source": r.idle_w_source} for r in rows]}


@dataclass(frozen=True)
class Material:
    """What the controller gets: the power key pair (made on the head, kept 0400 like the munge key), the
    PCs' host keys as the controller names them, and pcs.json."""

    key: bytes
    public: str  # `ssh-ed25519 AAAA...`
    known_hosts: str
    pcs: str


def key_pair(folder: Path, room: str, dry_run: bool) -> tuple[bytes, str]:
    """The room's power key on the head (power_ed25519, 0400 in the room's 0700 folder), made once; a dry run
    makes a throwaway one and keeps nothing."""
    path = folder / "power_ed25519"
    if path.exists():
        return path.read_bytes(), path.with_suffix(".pub").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / path.name if dry_run else path
        where.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{AUTH_TAG}:{room}", "-f", str(where)],
                       check=True, capture_output=True, timeout=60)
        where.chmod(0o400)
        return where.read_bytes(), where.with_suffix(".pub").read_text()


def material(inv: Inventory, room: RoomCluster, dry_run: bool) -> Material:
    """The key pair, the PCs' host keys (from the head's known_hosts, under the name the controller's ssh
    looks up: the address, or [address]:port) and pcs.json."""
    lines = []
    for name in room.nodes:
        h = inv.hosts[name]
        found = hostkeys.known_hosts(h.known_hosts_path).lookup(h.host_key_name)
        keys = [found[t] for t in found.keys()] if found is not None else []
        if not keys:
            raise UsageError(f"{name}: no host key of it in {h.known_hosts_path}, which the controller needs to "
                             "check it before switching it off", f"`clusterctl trust {name}`, then run again")
        there = h.address if h.port == 22 else f"[{h.address}]:{h.port}"
        lines += [f"{there} {k.get_name()} {k.get_base64()}\n" for k in keys]
    key, public = key_pair(held.folder(inv, room.name), room.name, dry_run)
    return Material(key, public, "".join(lines), json.dumps(pcs_json(inv, room), indent=1, sort_keys=True) + "\n")


def entry(public: str, room: str) -> str:
    """The login user's authorized_keys line: this key may run the poweroff only (no shell, no forwarding)."""
    return f'restrict,command="sudo -n {POWEROFF}" {" ".join(public.split()[:2])} {AUTH_TAG}:{room}\n'


def sudoers(h: Host) -> str:
    return f"# clusterctl provision --slurm: the power key's login may switch this PC off, nothing else\n" \
           f"{h.user} ALL=(root) NOPASSWD: {POWEROFF}\n"


def actions(controller: Host, nodes: list[Host], states: dict[str, PcState], m: Material, room: str) -> list[Action]:
    """The files phase's power actions, where a PC's differ: the program (under its three names), key,
    known_hosts and pcs.json on the controller (SlurmUser's only); each PC's sudoers line and authorized_keys
    entry. A rerun on a room set up so plans none."""
    out: list[Action] = []
    ctl = states[controller.name].digests
    program = Path(slurm_power.__file__).read_bytes()
    if ctl.get(PROGRAM) != sha256(program):
        # the folder 0755 (write_file makes it under umask 077): slurmctld runs the program as slurm
        links = " && ".join(f"ln -sfn slurm-power {shlex.quote(n)}" for n in POWER_NAMES.values())
        out += [Action(controller.name, "files", PROGRAM, write_file(controller, PROGRAM, "root:root", "0755"), program,
                       "(cluster/room/slurm_power.py, as it is)"),
                Action(controller.name, "files", f"{', '.join(POWER_NAMES.values())} -> slurm-power",
                       as_root(controller, f"install -d -m 0755 {POWER_BIN} && cd {POWER_BIN} && {links}"))]
    mine = [(KEY, m.key, "(the room's power key, not shown)"), (KNOWN_HOSTS, m.known_hosts.encode(), None),
            (PCS, m.pcs.encode(), None)]
    todo = [(p, data, shown) for p, data, shown in mine if ctl.get(p) != sha256(data)]
    if todo:  # slurm's folder first (write_file's mkdir would leave it root's)
        out.append(Action(controller.name, "files", POWER_DIR, as_root(controller, f"install -d -o slurm -g slurm -m 0700 {POWER_DIR}")))
    out += [Action(controller.name, "files", p, write_file(controller, p, "slurm:slurm", "0400"), data,
                   shown if shown is not None else data.decode()) for p, data, shown in todo]
    line = entry(m.public, room)
    q = shlex.quote
    for h in nodes:
        st = states[h.name]
        text = sudoers(h)
        if h.user != "root" and st.digests.get(SUDOERS) != sha256(text.encode()):  # root's sudo needs no line
            t = "/etc/sudoers.d/.clusterctl-power.new"  # a name with a dot: sudo's includedir skips it
            out.append(Action(h.name, "files", SUDOERS, as_root(h, f"umask 0337 && cat > {t} && visudo -cqf {t} && "
                                                             f"mv -f {t} {SUDOERS}"), text.encode(), text))
        if st.authorized != sha256(line.encode()):
            out.append(Action(h.name, "files", f"~{h.user}/.ssh/authorized_keys: the power key (poweroff only)",
                              f"umask 077 && mkdir -p ~/.ssh && f=~/.ssh/authorized_keys && touch \"$f\" && "
                              f"{{ grep -vF {q(AUTH_TAG)} \"$f\"; cat; }} > \"$f.clusterctl-new\" && "
                              f"mv -f \"$f.clusterctl-new\" \"$f\"", line.encode(), line))
    return out


def undo_actions(controller: Host, nodes: list[Host], states: dict[str, PcState]) -> list[Action]:
    """What --undo removes besides the files the probe found (plan.undo removes those): the program's three
    names and SlurmUser's folder on the controller, the power key's authorized_keys lines on each PC."""
    out = []
    if any(states[controller.name].digests.get(p) for p in POWER_FILES):
        names = " ".join(f"{POWER_BIN}/{n}" for n in POWER_NAMES.values())
        out.append(Action(controller.name, "files", "remove the power program's names and folder",
                          as_root(controller, f"rm -f {names} && rm -rf {POWER_DIR}")))
    for h in nodes:
        if states[h.name].authorized:
            out.append(Action(h.name, "files", f"~{h.user}/.ssh/authorized_keys: remove the power key",
                              f"f=~/.ssh/authorized_keys && {{ grep -vF {shlex.quote(AUTH_TAG)} \"$f\"; true; }} > "
                              f"\"$f.clusterctl-new\" && mv -f \"$f.clusterctl-new\" \"$f\""))
    return out
