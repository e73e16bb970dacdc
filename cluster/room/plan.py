"""What provision --slurm changes on each PC, from what the PCs have now (cluster.room.state) and what the
room should be: the actions in order, each a command (with its input: a file's text, the munge key), so
that the dry run prints exactly what a real run executes and a rerun on a set-up room plans nothing.

Phases (each across the PCs at once, the next only once every PC finished the one before):
    install    the packages a PC lacks (apt, or the head's bundle), with its daemons kept from starting
    files      slurm.conf, cgroup.conf, gres.conf (0644) and the munge key (0400, munge's), where they differ
    firewall   where a PC's nftables would stop the room's TCP: one rule accepting Slurm's ports from exactly
               the room's addresses, tagged with the room (removed by --undo)
    munge      enabled and started (restarted where its key changed)
    drain      PCs leaving the room, drained on the controller before it forgets them
    slurmctld  on the controller; slurmd on the nodes: enabled and started, or restarted where the config
    slurmd     changed (Slurm 22.05 reads a node added or removed only on a restart of every daemon)
"""
from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.inventory.model import Host
from cluster.room.debs import Install
from cluster.room.state import ETC, FW_TAG, KEY, NFT, PcState, as_root

PHASES = ("install", "files", "firewall", "munge", "drain", "slurmctld", "slurmd")
SLURM_PORTS = "{ 6817, 6818, 60001-63000 }"  # slurmctld, slurmd, srun (cluster.room.conf.PORTS)
CONTROLLER, NODE = "controller", "node"


@dataclass(frozen=True)
class Action:
    pc: str
    phase: str
    what: str
    command: str
    stdin: bytes | None = None
    shown: str | None = None  # what the dry run prints for the input (a file's text; never the key)
    copies: tuple[tuple[Path, str], ...] = ()  # head file -> PC path, sent before the command (a bundle's .debs)

    def to_dict(self) -> dict[str, Any]:
        return {"pc": self.pc, "phase": self.phase, "what": self.what, "command": self.command,
                **({"input": self.shown} if self.shown is not None else {}),
                **({"copies": [[str(a), b] for a, b in self.copies]} if self.copies else {})}


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return bool(self.actions)

    def phase(self, name: str) -> list[Action]:
        return [a for a in self.actions if a.phase == name]


def dry_run_text(room: str, actions: list[Action], undoing: bool = False) -> str:
    """What `provision --slurm --dry-run` prints: every command in the order it would run, with every file's
    text (the munge key never), and the files a bundle sends."""
    lines = [f"dry run: provision --slurm{' --undo' if undoing else ''} of room {room}; nothing was changed"]
    for a in actions:
        lines.append(f"{a.pc} {a.phase}: {a.what}")
        lines += [f"  send {local.name} -> {remote}" for local, remote in a.copies]
        lines += ["  $ " + ln for ln in a.command.splitlines()]
        if a.shown is not None:
            lines += ["  | " + ln if ln else "  |" for ln in a.shown.rstrip("\n").splitlines()]
    if not actions:
        lines.append("nothing would change: the room is as provision --slurm leaves it")
    return "\n".join(lines) + "\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_file(h: Host, path: str, owner: str, mode: str) -> str:
    """The command that puts its stdin at `path` whole (a temporary file renamed), owned and mode set first."""
    q = shlex.quote
    return as_root(h, f"f={q(path)}; t=\"$f.clusterctl-new\"; umask 077; mkdir -p \"$(dirname \"$f\")\" && "
                      f"cat > \"$t\" && chown {q(owner)} \"$t\" && chmod {q(mode)} \"$t\" && mv -f \"$t\" \"$f\"")


def units(h: Host, verb: str, names: list[str]) -> str:
    return as_root(h, f"systemctl {verb} {' '.join(names)}")


def open_ports(h: Host, room: str, chain: tuple[str, str, str], peers: list[str]) -> str:
    """One nft rule at the top of `chain`: TCP to Slurm's ports from exactly the room's addresses, tagged."""
    words = ["insert", "rule", *chain, "ip", "saddr", "{ " + ", ".join(peers) + " }", "tcp", "dport", SLURM_PORTS,
             "accept", "comment", f'"{FW_TAG} {room}"']  # nft's own quotes: its parser reads the words
    return as_root(h, f"{NFT} " + " ".join(shlex.quote(w) for w in words))


def close_ports(h: Host) -> str:
    """Every rule provision --slurm inserted on `h` (any room), deleted by its handle."""
    find = ("awk -v tag=" + shlex.quote(f'comment "{FW_TAG} ') + " '$1==\"table\"{f=$2; t=$3} $1==\"chain\"{c=$2} "
            "index($0, tag){print f, t, c, $NF}'")
    return as_root(h, f"{NFT} -a list ruleset | {find} | while read -r f t c n; do "
                      f'{NFT} delete rule "$f" "$t" "$c" handle "$n"; done')


def make(controller: Host, nodes: list[Host], states: dict[str, PcState], files: dict[str, str], key: bytes,
         install: Callable[[Host, str, PcState], Install], walls: dict[str, list[tuple[str, str, str]]] | None = None,
         room: str = "room", peers: list[str] | None = None) -> Plan:
    """The plan for the room: `files` (name -> text, as cluster.room.conf renders them), the munge key,
    `install(host, role, state)` what installs the packages a PC lacks (cluster.room.debs), `walls` the
    input chains of each PC whose firewall would stop the room's TCP (cluster.nodes.firewall), from `peers`
    (the PCs' addresses on the room's network)."""
    plan = Plan()
    peers = peers or [h.address for h in (controller, *nodes)]
    for h in (controller, *nodes):
        if states[h.name].fw_rules:
            continue  # opened by an earlier run (a rerun changes nothing)
        for chain in (walls or {}).get(h.name, []):
            plan.actions.append(Action(h.name, "firewall", f"accept Slurm's ports from the room in {' '.join(chain)}",
                                       open_ports(h, room, chain, peers)))
    roles = {controller.name: CONTROLLER, **{h.name: NODE for h in nodes}}
    pcs = [controller, *nodes]
    for h in pcs:
        inst = install(h, roles[h.name], states[h.name])
        if inst.script:
            how = "from the head's bundle" if inst.copies else "with apt"
            plan.actions.append(Action(h.name, "install", f"install {' '.join(inst.missing)} {how}",
                                       as_root(h, inst.script), copies=inst.copies))
    conf_changed: set[str] = set()
    key_changed: set[str] = set()
    stale = [f"{ETC}/{n}" for n in ("gres.conf",) if n not in files]
    for h in pcs:
        st = states[h.name]
        for name, text in sorted(files.items()):
            path = f"{ETC}/{name}"
            if st.digests.get(path) != sha256(text.encode()):
                plan.actions.append(Action(h.name, "files", path, write_file(h, path, "root:root", "0644"),
                                           text.encode(), text))
                conf_changed.add(h.name)
        for path in stale:
            if st.digests.get(path):
                plan.actions.append(Action(h.name, "files", f"{path} (no GPU left)", as_root(h, f"rm -f {path}")))
                conf_changed.add(h.name)
        if st.digests.get(KEY) != sha256(key):
            plan.actions.append(Action(h.name, "files", KEY, write_file(h, KEY, "munge:munge", "0400"), key,
                                       f"(the room's munge key, {len(key)} bytes, not shown)"))
            key_changed.add(h.name)
    for h in pcs:
        st = states[h.name]
        if h.name in key_changed and st.active.get("munge"):
            plan.actions.append(Action(h.name, "munge", "restart munge (new key)", units(h, "restart", ["munge"])))
        elif not (st.active.get("munge") and st.enabled.get("munge")):
            plan.actions.append(Action(h.name, "munge", "enable and start munge", units(h, "enable --now", ["munge"])))
    ctl_state = states[controller.name]
    leaving = [n for n in ctl_state.conf_nodes if n not in {h.name for h in nodes}]
    if leaving and ctl_state.active.get("slurmctld"):
        plan.actions.append(Action(controller.name, "drain", f"drain {','.join(leaving)}", as_root(
            controller, f"scontrol update NodeName={shlex.quote(','.join(leaving))} State=DRAIN "
                        "Reason=removed_from_the_inventory")))
        plan.notes.append(f"{', '.join(leaving)} left the room: drained, then forgotten when every Slurm daemon "
                          "restarts (Slurm 22.05 reads added and removed nodes only on a restart)")
    restart = bool(conf_changed or key_changed)
    for h, unit, phase in [(controller, "slurmctld", "slurmctld"), *((n, "slurmd", "slurmd") for n in nodes)]:
        st = states[h.name]
        if restart and st.active.get(unit):
            plan.actions.append(Action(h.name, phase, f"restart {unit} (its config changed)", units(h, "restart", [unit])))
        if not (st.active.get(unit) and st.enabled.get(unit)):
            plan.actions.append(Action(h.name, phase, f"enable and start {unit}", units(h, "enable --now", [unit])))
    if restart and any(states[h.name].active.get(u) for h, u in [(controller, "slurmctld"), *((n, "slurmd") for n in nodes)]):
        plan.notes.append("the configuration changed: slurmctld and every slurmd restart (running jobs keep running)")
    return plan


def undo(controller: Host, nodes: list[Host], states: dict[str, PcState], purge: list[str] | None) -> Plan:
    """Stop and disable what provision --slurm started, remove the files it wrote; `purge`: the packages too."""
    plan = Plan()
    for h, unit in [(controller, "slurmctld"), *((n, "slurmd") for n in nodes)]:
        st = states[h.name]
        running = [u for u in (unit, "munge") if st.active.get(u) or st.enabled.get(u)]
        if running:
            plan.actions.append(Action(h.name, "slurmd" if unit == "slurmd" else "slurmctld",
                                       f"stop and disable {' '.join(running)}", units(h, "disable --now", running)))
        present = [p for p, d in st.digests.items() if d]
        if present:
            plan.actions.append(Action(h.name, "files", f"remove {' '.join(present)}",
                                       as_root(h, f"rm -f {' '.join(shlex.quote(p) for p in present)}")))
        if st.fw_rules:
            plan.actions.append(Action(h.name, "firewall", "remove the firewall rules it inserted", close_ports(h)))
        if purge:
            have = sorted(p for p in purge if p in st.installed)
            if have:
                plan.actions.append(Action(h.name, "install", f"purge {' '.join(have)}", as_root(
                    h, f"DEBIAN_FRONTEND=noninteractive apt-get purge -y {' '.join(have)}")))
    return plan
