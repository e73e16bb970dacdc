"""provision --slurm: the room's facts, its refusals, its files, the plan, its execution phase by phase,
and the verification a user would do by hand (sinfo on the controller, srun on every node)."""
from __future__ import annotations

import ipaddress
import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster import paths
from cluster.errors import EXIT_UNREACHABLE, ClusterError, UsageError
from cluster.inventory.model import Host, Inventory, RoomCluster
from cluster.nodes import firewall
from cluster.nodes.facts import NodeFacts, gather
from cluster.nodes.fanout import Group, GroupResult
from cluster.room import asleep, checks, conf, debs, held
from cluster.room import plan as planning
from cluster.room import power as roompower
from cluster.room import state as pcstate
from cluster.transport import Transport

VERIFY_TIMEOUT_S = 60.0  # every node idle in sinfo, then srun's answer: seconds on a room, well under this
UNDO_ORDER = ("slurmd", "slurmctld", "drain", "munge", "firewall", "files", "install")


class RoomError(ClusterError):
    """The room cannot be set up as asked (refused before any change, or a phase failed): names the PCs."""


@dataclass
class Outcome:
    room: str
    dry_run: bool
    undo: bool = False
    actions: list[planning.Action] = field(default_factory=list)
    done: dict[str, list[str]] = field(default_factory=dict)  # pc -> what changed
    failed: dict[str, str] = field(default_factory=dict)  # pc -> why
    unreachable: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    sinfo: list[dict[str, Any]] = field(default_factory=list)
    srun: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.unreachable

    def to_dict(self) -> dict[str, Any]:
        return {"room": self.room, "dry_run": self.dry_run, "undo": self.undo, "ok": self.ok,
                "changed": bool(self.actions), "actions": [a.to_dict() for a in self.actions], "done": self.done,
                "failed": self.failed, "unreachable": self.unreachable, "notes": self.notes,
                "files": sorted(self.files), "sinfo": self.sinfo, "srun": self.srun}


def room_of(inv: Inventory, name: str | None) -> RoomCluster:
    """The inventory's room `name` (or its only one); UsageError naming the rooms it declares."""
    if name is None and len(inv.rooms) == 1:
        return next(iter(inv.rooms.values()))
    if name in inv.rooms:
        return inv.rooms[name]
    declared = ", ".join(sorted(inv.rooms))
    what = f"no room {name!r}" if name else ("rooms " + declared if declared else "no room")
    raise UsageError(f"{inv.path} declares {what} (`slurm: {{NAME: {{controller: ..., nodes: ...}}}}`)",
                     f"--room {sorted(inv.rooms)[0]}" if declared else
                     "declare it: slurm: {room: {controller: PC, nodes: GROUP}} (docs/slurm.md, the room)")


def key_path(inv: Inventory, room: RoomCluster) -> Path:
    """The room's munge key on the head (0400 in a 0700 folder of clusterctl's home; never in a run folder
    or an export): every PC added later gets the same one."""
    return held.folder(inv, room.name) / "munge.key"


def _record(inv: Inventory, room: RoomCluster) -> None:
    """The head's note that this room is set up (cluster.room.held reads it): its PCs are Slurm's now."""
    paths.write_atomic(key_path(inv, room).parent / held.SET_UP, json.dumps(
        {"room": room.name, "inventory": str(inv.path), "controller": room.controller.address,
         "nodes": list(room.nodes), "partition": room.partition}, indent=1) + "\n")


def _key(path: Path, dry_run: bool) -> bytes:
    if path.exists():
        return path.read_bytes()
    key = os.urandom(1024)
    if not dry_run:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
    return key


def _pcs(inv: Inventory, room: RoomCluster) -> tuple[Host, list[Host]]:
    return room.controller, [inv.hosts[n] for n in room.nodes]


def _facts(group: Group, out: Outcome) -> dict[str, NodeFacts]:
    res = gather(group)
    _note_failures(res, out)
    if not out.ok:
        raise _failed("cannot read the facts of", out, "bring the PCs up (`clusterctl wake`), then run again")
    facts: dict[str, NodeFacts] = {n: r.value for n, r in res.items()}
    # the firewall as root where the login user may not list it (nft needs CAP_NET_ADMIN): Slurm's ports matter
    unread = [h for h in group.hosts if h.become and (facts[h.name].values.get("firewall") or {}).get("state") == "unreadable"]
    if unread:
        again = group.run(lambda h: pcstate.as_root(h, firewall.COMMAND), timeout=60, hosts=unread)
        for n, r in again.items():
            facts[n].values["firewall"] = firewall.parse(r.stdout, r.exit_code or 0)
    return facts


def _failed(what: str, out: Outcome, fix: str) -> RoomError:
    """The error of a step that failed on some PCs: each PC with its own error; exit 3 where one was unreachable."""
    why = "; ".join(f"{n}: {e}" for n, e in sorted({**out.failed, **out.unreachable}.items()))
    return RoomError(f"{what} {why}", fix, exit_code=EXIT_UNREACHABLE if out.unreachable else None)


def _note_failures(res: GroupResult, out: Outcome) -> None:
    for n, r in res.items():
        if r.status == "unreachable":
            out.unreachable[n] = r.error or "unreachable"
        elif not r.ok:
            out.failed[n] = (r.error or r.stderr.strip() or f"exit {r.exit_code}")[-400:]


def _states(group: Group, out: Outcome) -> dict[str, pcstate.PcState]:
    res = group.run(pcstate.probe_command, timeout=60)
    _note_failures(res, out)
    if not out.ok:
        raise _failed("cannot read the Slurm state of", out, "`sudo -n true` must work there with become")
    return {n: pcstate.parse(r.stdout) for n, r in res.items()}


def reached_at(controller: Host, nodes: list[Host], f: NodeFacts) -> str:
    """The controller's address as the nodes reach it: the one of its NICs on the nodes' network (the head
    may reach it at another, e.g. through a second NIC); its inventory address where none is."""
    try:
        wanted = [ipaddress.ip_address(h.address) for h in nodes]
    except ValueError:
        return controller.address  # nodes named, not numbered: the name resolves the same for everyone
    for nic in f.values.get("nics") or []:
        for cidr in nic.get("cidrs") or []:
            iface = ipaddress.ip_interface(cidr)
            if not iface.ip.is_loopback and all(a in iface.network for a in wanted):
                return str(iface.ip)
    return controller.address


def render(room: RoomCluster, controller: Host, nodes: list[Host], facts: dict[str, NodeFacts],
           power: conf.Power | None = None) -> dict[str, str]:
    """The room's files from its facts: slurm.conf, cgroup.conf, gres.conf (GPUs); `power`: Slurm's power
    saving (cluster.room.power.settings)."""
    ctl_name = (facts[controller.name].values.get("hostname") or {}).get("name") or controller.name
    members = [conf.node_from_facts(h.name, h.address, facts[h.name].values) for h in nodes]
    v2 = not checks.unconfined(nodes, facts)
    return conf.render(cluster=room.name, partition=room.partition, controller_hostname=ctl_name,
                       controller_address=reached_at(controller, nodes, facts[controller.name]), nodes=members,
                       cgroup_v2=v2, queue=conf.Queue(room.default_time, room.max_time, room.max_pcs_per_job),
                       power=power)


def _walls(peers: list[str], pcs: list[Host], facts: dict[str, NodeFacts]) -> dict[str, list[tuple[str, str, str]]]:
    """Each PC's input chains that would stop TCP from the room's PCs (its firewall read as root)."""
    peers = [a for a in peers if firewall.is_ip(a)]
    out = {}
    for h in pcs:
        fw = facts[h.name].values.get("firewall") or {}
        if fw.get("state") == "ok" and peers:
            out[h.name] = firewall.chains_to_open(fw["ruleset"], peers, facts[h.name].address_nic)
    return out


def _install(group: Group, h: Host, role: str, st: pcstate.PcState, f: NodeFacts) -> debs.Install:
    """What installs the role's packages on `h`: apt where its index knows Slurm, else the head's bundle of
    the PC's release (every package the PC lacks, by its full dpkg list)."""
    if all(p in st.installed for p in debs.ROLES[role]):
        return debs.Install(role, (), "")
    if st.candidate:
        return debs.install(role, st.installed, has_index=True)
    osf = f.values.get("os") or {}
    codename, arch = osf.get("codename"), osf.get("arch")
    bundle = debs.load(codename, arch) if codename and arch else None
    if bundle is None:
        raise RoomError(f"{h.name} lacks {' '.join(p for p in debs.ROLES[role] if p not in st.installed)}, its apt "
                        f"index does not know Slurm and the head has no bundle of Debian packages for "
                        f"{codename or '?'}-{arch or '?'}",
                        "on a connected machine of that release: `clusterctl debs build`, `clusterctl debs export "
                        "FILE`; here: `clusterctl debs import FILE` (docs/playbooks.md)")
    r = group.run(debs.DPKG_QUERY, timeout=60, hosts=[h])[h.name]
    if not r.ok:
        raise RoomError(f"{h.name}: `{debs.DPKG_QUERY}` failed: {(r.error or r.stderr).strip()[-300:]}")
    folder = f"{h.workdir.rstrip('/') or '.'}/debs-incoming"  # the login user's own folder, never a shared /tmp
    return debs.install(role, debs.parse_installed(r.stdout), has_index=False, bundle=bundle, folder=folder)


def _execute(group: Group, actions: list[planning.Action], order: tuple[str, ...], out: Outcome,
             on_action: Callable[[planning.Action], None]) -> None:
    """Phase by phase, every PC at once within a phase; a phase that fails on a PC stops the ones after it."""
    for phase in order:
        todo = [a for a in actions if a.phase == phase]
        if not todo:
            continue
        by_pc: dict[str, list[planning.Action]] = {}
        for a in todo:
            by_pc.setdefault(a.pc, []).append(a)

        def run(t: Transport, mine: dict[str, list[planning.Action]] = by_pc) -> Any:
            for a in mine[t.host.name]:
                on_action(a)
                if a.copies:
                    t.run(f"mkdir -p {shlex.quote(a.copies[0][1].rsplit('/', 1)[0])}", timeout=30)
                    for local, remote in a.copies:
                        t.put_file(local, remote)
                r = t.run(a.command, timeout=600 if a.phase == "install" else 120, stdin=a.stdin)
                if not r.ok:
                    return r
                out.done.setdefault(t.host.name, []).append(a.what)
            return r

        hosts = [h for h in group.hosts if h.name in by_pc]
        res = group.call(run, hosts)
        _note_failures(res, out)
        if not out.ok:
            raise _failed(f"{phase} failed on", out, "fix it there and run again (what was done stays done)")


def verify(group: Group, controller: Host, nodes: list[Host], out: Outcome, timeout: float = VERIFY_TIMEOUT_S) -> None:
    """sinfo on the controller until every node is idle (bounded), then `srun -N<all> hostname` answers from
    each: what a user would check by hand, and the proof that munge, the ports and the config agree."""
    names = [h.name for h in nodes]
    deadline, seen = time.monotonic() + timeout, ""
    sinfo = pcstate.as_root(controller, "sinfo -h -N -o '%N %T %c %m'")
    while True:
        r = group.run(sinfo, timeout=30, hosts=[controller])[controller.name]
        seen = r.stdout.strip()
        rows = [ln.split() for ln in seen.splitlines() if len(ln.split()) == 4]
        states = {row[0]: row[1] for row in rows}
        if r.ok and all(states.get(n) == "idle" for n in names):
            out.sinfo = [{"node": a, "state": b, "cpus": int(c), "memory_mb": int(m)} for a, b, c, m in rows
                         if c.isdigit() and m.isdigit()]
            break
        if time.monotonic() > deadline:
            raise RoomError(f"the room's nodes are not all idle within {timeout:g} s (sinfo on {controller.name}: "
                            f"{seen or r.stderr.strip() or 'no answer'})",
                            "see /var/log/slurm/slurmctld.log on the controller and slurmd.log on the nodes")
        time.sleep(1.0)
    srun = pcstate.as_root(controller, f"timeout {int(timeout)} srun -N{len(names)} -w {shlex.quote(','.join(names))} "
                                       "hostname")
    r = group.run(srun, timeout=timeout + 10, hosts=[controller])[controller.name]
    out.srun = sorted(r.stdout.split())
    if not r.ok or sorted(out.srun) != sorted(names):
        raise RoomError(f"`srun -N{len(names)} hostname` on {controller.name} answered {out.srun or 'nothing'} "
                        f"(exit {r.exit_code}): {r.stderr.strip()[-300:]}",
                        "see /var/log/slurm/slurmd.log on the nodes that did not answer")


def provision(inv: Inventory, room_name: str | None, *, dry_run: bool = False, forks: int = 32,
              on_action: Callable[[planning.Action], None] = lambda a: None) -> Outcome:
    """Set the room up as a Slurm cluster (idempotent: a rerun on a set-up room changes nothing)."""
    room = room_of(inv, room_name)
    controller, nodes = _pcs(inv, room)
    out = Outcome(room=room.name, dry_run=dry_run)
    if not dry_run:  # PCs its Slurm switched off are woken through it: their facts and files are read now
        asleep.wake(controller, room.partition, list(room.nodes), out.notes.append)
    with Group([controller, *nodes], forks=forks) as group:
        facts = _facts(group, out)
        refused = checks.refusals(controller, nodes, facts)
        if refused:
            raise RoomError("; ".join(f"{', '.join(r.pcs)}: {r.message}" for r in refused),
                            " / ".join(r.fix for r in refused))
        out.notes += checks.warnings(controller, nodes, facts)
        bare = checks.unconfined(nodes, facts)
        if bare:
            out.notes.append(f"no cgroup v2 on {', '.join(bare)}: jobs are not confined to their cores, memory and "
                             "GPUs on any PC of the room (a whole PC per job still keeps students apart)")
        power = roompower.settings(inv, room)
        out.files = render(room, controller, nodes, facts, power)
        states = _states(group, out)
        key = _key(key_path(inv, room), dry_run)
        # where the PCs' packets come from: the controller at its address on the nodes' network
        peers = [reached_at(controller, nodes, facts[controller.name]), *(h.address for h in nodes)]
        plan = planning.make(controller, nodes, states, out.files, key,
                             lambda h, role, st: _install(group, h, role, st, facts[h.name]),
                             walls=_walls(peers, [controller, *nodes], facts), room=room.name, peers=peers)
        if power is not None:  # the program, its key and files on the controller; each PC's poweroff login
            at = 1 + max((i for i, a in enumerate(plan.actions) if a.phase in ("install", "files")), default=-1)
            plan.actions[at:at] = roompower.actions(controller, nodes, states, roompower.material(inv, room, dry_run),
                                                    room.name)
        out.actions, out.notes = plan.actions, out.notes + plan.notes
        if dry_run:
            return out
        _execute(group, plan.actions, planning.PHASES, out, on_action)
        verify(group, controller, nodes, out)
    _record(inv, room)
    return out


def undo(inv: Inventory, room_name: str | None, *, dry_run: bool = False, purge: bool = False, forks: int = 32,
         on_action: Callable[[planning.Action], None] = lambda a: None) -> Outcome:
    """Stop and disable munge and Slurm where provision --slurm started them, remove the files it wrote and
    the head's copy of the key; the packages stay unless `purge`."""
    room = room_of(inv, room_name)
    controller, nodes = _pcs(inv, room)
    out = Outcome(room=room.name, dry_run=dry_run, undo=True)
    if not dry_run:
        asleep.wake(controller, room.partition, list(room.nodes), out.notes.append)
    with Group([controller, *nodes], forks=forks) as group:
        states = _states(group, out)
        plan = planning.undo(controller, nodes, states, list(pcstate.PACKAGES) if purge else None)
        out.actions = plan.actions + roompower.undo_actions(controller, nodes, states)
        if dry_run:
            return out
        _execute(group, out.actions, UNDO_ORDER, out, on_action)
    power_key = key_path(inv, room).parent / "power_ed25519"
    for p in (key_path(inv, room), power_key, power_key.with_suffix(".pub"), key_path(inv, room).parent / held.SET_UP):
        p.unlink(missing_ok=True)
    return out
