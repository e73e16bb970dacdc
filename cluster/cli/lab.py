"""`clusterctl lab up|down|status`: the simulated lab (cluster.lab.lifecycle)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape

from cluster import errors
from cluster.lab import lifecycle
from cluster.lab import slurm as lab_slurm
from cluster.lab.accounts import USERS_POINT
from cluster.inventory import context
from cluster.cli.args import POSITIVE_INT, add_json
from cluster.cli.context import switch
from cluster.cli.output import emit_json, err, out, table

ACTIONS = (("up", "start a lab and make it the current context"),
           ("down", "remove the lab's namespaces, links and processes"),
           ("status", "show the lab's nodes and whether sshd answers"),
           ("power", "switch nodes off (everything in them stops; a magic packet or `power on` starts them) or on"))


def configure(name: str, p: argparse.ArgumentParser) -> None:
    """`lab` takes an action; each declares its own arguments."""
    sub = p.add_subparsers(dest="lab_cmd", required=True, metavar="ACTION")
    handlers = {"up": cmd_lab_up, "down": cmd_lab_down, "status": cmd_lab_status, "power": cmd_lab_power}
    for action, help in ACTIONS:
        sp = sub.add_parser(action, help=help, description=help)
        sp.set_defaults(fn=handlers[action])
        if action == "down":
            sp.add_argument("--purge", action="store_true",
                            help="also delete the lab directory: keys and every node's /srv/cluster (venvs, runs)")
        if action == "up":
            _declare_up(sp)
        if action == "status":
            sp.add_argument("--all", action="store_true",
                            help="every lab on this machine, found by its namespaces and links, with its state "
                                 "file where that is in the default place (exit 0: a listing)")
        if action == "power":
            sp.add_argument("switch", choices=("off", "on"), help="off: a power cut; on: the power button")
            sp.add_argument("nodes", nargs="+", metavar="NODE", help="node numbers or names, e.g. 2 or node2")
        sp.add_argument("--name", default="lab", help="lab name, 1-8 lowercase letters/digits (default: lab)")
        sp.add_argument("--dir", help="lab directory (default $CLUSTERCTL_HOME/labs/NAME)")
        add_json(sp)


def _declare_up(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("nodes", type=POSITIVE_INT, metavar="N", help="number of nodes")
    sp.add_argument("--subnet", default="10.77.0.0/24", help="IPv4 subnet of the lab (default 10.77.0.0/24)")
    sp.add_argument("--bandwidth", metavar="RATE", help="shape each node's link, e.g. 1gbit (tc tbf)")
    sp.add_argument("--uplink", metavar="RATE",
                    help="the head's NIC: one limit shared by all head<->node traffic, e.g. 1gbit")
    sp.add_argument("--user", default="root", metavar="NAME",
                    help="the nodes' login user (default root); another gets NOPASSWD sudo and the inventory `become`")
    sp.add_argument("--users", metavar="A,B,...", type=lambda v: [u for u in v.split(",") if u],
                    help="a class: these accounts of this machine get the same uid and gid on every PC, a home "
                         "there, and their own key and inventory in ~/.clusterctl/labs/NAME (no sudo)")
    sp.add_argument("--gateway", action="store_true",
                    help="the nodes behind a gateway PC: the head reaches them only through its sshd (ProxyJump)")
    sp.add_argument("--slurm", action="store_true",
                    help="a real Slurm too: slurmctld on the head, slurmd on each node, a login node and a shared "
                         "folder; the inventory declares it as the cluster `slurm`")
    sp.add_argument("--cpu-quota", metavar="Q1,Q2,...",
                    help="heterogeneous nodes: pin node i to one core and let it use Qi of it "
                         "(cgroup CPU bandwidth), e.g. 1,0.35")


def _directory(args: argparse.Namespace) -> Path | None:
    return Path(args.dir) if args.dir else None


def _quotas(text: str | None) -> list[float] | None:
    try:
        return [float(x) for x in text.split(",")] if text else None
    except ValueError:
        raise errors.UsageError(f"--cpu-quota {text!r}: expected numbers", "e.g. --cpu-quota 1,0.35") from None


def cmd_lab_up(args: argparse.Namespace) -> int:
    with err.status(f"starting a {args.nodes}-node lab '{args.name}' on {args.subnet}"):
        state = lifecycle.up(args.nodes, name=args.name, subnet=args.subnet, bandwidth=args.bandwidth,
                       cpu_quotas=_quotas(args.cpu_quota), directory=_directory(args), uplink=args.uplink,
                       gateway=args.gateway, user=args.user, slurm=args.slurm, users=args.users)
    switch(Path(state.inventory))  # says so on stderr when the current context changes
    if args.json:
        emit_json({"name": state.name, "inventory": state.inventory, "subnet": state.subnet,
                   "nodes": [{"name": n.name, "address": n.address, "netns": n.netns} for n in state.nodes],
                   **_slurm_up_json(state),
                   **({"users": {u: f"{f}/inventory.yaml" for u, f in state.users.items()}} if state.users else {})})
        return errors.EXIT_OK
    t = table(f"lab {state.name} ({state.subnet})", ("node", "address", "netns", "sshd pid", "cpu"))
    for n in state.nodes:
        t.add_row(n.name, n.address, n.netns, str(n.pid),
                  f"core {n.cpu}, {n.cpu_quota:g} of it" if n.cpu_quota is not None else "shared")
    out.print(t)
    if state.bandwidth:
        out.print(f"links shaped to {state.bandwidth} in both directions")
    if state.uplink:
        out.print(f"the head's uplink: {state.uplink} in each direction, shared by all nodes")
    if state.jump:
        out.print(f"behind a gateway PC at {state.jump.address}: the head reaches the nodes only through it")
    if state.slurm:
        out.print(f"Slurm cluster `{lab_slurm.CLUSTER}`: login node {state.slurm.login.address}, partition "
                  f"{state.slurm.partition}, shared folder {state.slurm.shared_mount} (on the head: "
                  f"{escape(state.slurm.shared)})")
    out.print(f"inventory: {escape(state.inventory)} (now the current context)")
    for u, folder in state.users.items():
        out.print(f"{u}: the same uid on every PC, home {USERS_POINT}/{u} there; their inventory: "
                  f"{escape(folder)}/inventory.yaml")
    return errors.EXIT_OK


def _slurm_up_json(state: lifecycle.LabState) -> dict[str, object]:
    """`lab up --slurm --json`: the cluster's login node, conf and shared folder (nothing without --slurm)."""
    if state.slurm is None:
        return {}
    ctl = state.slurm
    return {"slurm": {"cluster": lab_slurm.CLUSTER, "login": ctl.login.address, "partition": ctl.partition,
                      "conf": ctl.conf, "shared": ctl.shared, "shared_mount": ctl.shared_mount}}


def cmd_lab_down(args: argparse.Namespace) -> int:
    state = lifecycle.load_state(args.name, _directory(args))
    removed = lifecycle.down(args.name, _directory(args), purge=args.purge)
    if state is not None and context.current() == Path(state.inventory):
        context.clear()  # don't leave the current context pointing at nodes that are gone
    if args.json:
        emit_json({"name": args.name, "removed": removed})
    else:
        out.print(f"lab {args.name}: removed {len(removed)} pieces" + (f" ({', '.join(removed)})" if removed else
                                                                       " (nothing was running)"))
    return errors.EXIT_OK


def cmd_lab_status(args: argparse.Namespace) -> int:
    if args.all:
        return _all_labs(args)
    state, rows = lifecycle.status(args.name, _directory(args))
    sl = lab_slurm.status(state) if state is not None else None
    left = lifecycle.leftovers(args.name) if state is None else []
    if args.json:
        emit_json({"name": args.name, "up": state is not None, **({"leftovers": left} if state is None else {}),
                   "inventory": state.inventory if state else None, "nodes": [vars(r) for r in rows],
                   **({"slurm": {"munged": sl.munged, "slurmctld": sl.slurmctld, "nodes": [vars(n) for n in sl.nodes]}}
                      if sl else {})})
    elif state is None and left:
        out.print(f"lab {args.name} is not up, but {len(left)} pieces of it are left on this machine "
                  f"({', '.join(left)}): remove them with `clusterctl lab down --name {args.name}`")
    elif state is None:
        out.print(f"lab {args.name} is not up (start it with `clusterctl lab up 3 --name {args.name}`)")
    else:
        t = table(f"lab {state.name} ({state.subnet})", ("node", "address", "power", "netns", "sshd", "port 22"))
        for r in rows:
            t.add_row(r.name, r.address, "[green]on[/]" if r.power == "on" else "[yellow]off[/]",
                      *(("[green]yes[/]" if x else "[red]no[/]") for x in (r.netns, r.sshd, r.port_open)))
        out.print(t)
        if sl:
            _print_slurm_status(sl)
        out.print(f"inventory: {escape(state.inventory)}")
    healthy = state is not None and all(r.netns and r.sshd and r.port_open for r in rows)
    if sl:
        healthy = healthy and sl.healthy
    return errors.EXIT_OK if healthy else errors.EXIT_FAILED


def _all_labs(args: argparse.Namespace) -> int:
    """A listing (exit 0): a lab without its state in the default place was started with --dir, or is what a
    killed `lab up` or test left; this cannot tell which, so it says both and how to remove it."""
    labs: list[dict[str, Any]] = []
    for name, pieces in lifecycle.labs_here().items():
        state = lifecycle.state_path(name, None)
        labs.append({"name": name, "state": str(state) if state.exists() else None, "pieces": pieces})
    if args.json:
        emit_json({"labs": labs})
    elif not labs:
        out.print("no lab on this machine")
    else:
        t = table("labs on this machine", ("lab", "namespaces and links", "state"))
        for lab in labs:
            t.add_row(lab["name"], str(len(lab["pieces"])), escape(lab["state"]) if lab["state"] else
                      "[yellow]none in the default place[/]: started with --dir, or left by a killed `lab up` "
                      f"or test (`clusterctl lab down --name {lab['name']}` removes it)")
        out.print(t)
    return errors.EXIT_OK


def cmd_lab_power(args: argparse.Namespace) -> int:
    from cluster.lab import power

    state = lifecycle.load_state(args.name, _directory(args))
    if state is None:
        raise errors.UsageError(f"lab {args.name} is not up", f"start it: clusterctl lab up 3 --name {args.name}")
    switch = power.power_off if args.switch == "off" else power.power_on
    done = [switch(state, n) for n in args.nodes]
    if args.json:
        emit_json({"name": state.name, "nodes": [{"name": n.name, "power": n.power, "sshd_pid": n.pid,
                                                  "listener_pid": n.listener} for n in done]})
    else:
        for n in done:
            out.print(f"{n.name}: {n.power}" + (" (a magic packet for its MAC, or `lab power on`, starts it)"
                                                if n.power == "off" else f" (sshd pid {n.pid})"))
    return errors.EXIT_OK


def _print_slurm_status(sl: lab_slurm.SlurmStatus) -> None:
    """`lab status` of a --slurm lab: the daemons, and each compute node as sinfo sees it."""
    yes = {True: "[green]yes[/]", False: "[red]no[/]"}
    out.print(f"Slurm: munged {yes[sl.munged]}, slurmctld {yes[sl.slurmctld]}")
    t = table("Slurm nodes", ("node", "slurmd", "sinfo state"))
    for n in sl.nodes:
        t.add_row(n.name, yes[n.slurmd], escape(n.state) if n.state else "[red]no answer[/]")
    out.print(t)
