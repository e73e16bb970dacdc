"""The simulated lab: one network namespace per node, each with its own sshd, hostname and /srv/cluster.

    bridge <name>-br (first address of the subnet, the head's side)
      └─ veth <name>-vN ── eth0 in netns <name>-nN (subnet .10+N), sshd on :22,
         hostname nodeN (on 127.0.1.1 in its /etc/hosts, as Debian does), <dir>/nodeN/srv on /srv/cluster,
         its own home (<dir>/nodeN/home on /srv/clusterctl-home, root's home in its copy of /etc/passwd)
    --gateway: no head address on the bridge; a gateway PC (netns <name>-gw, its own sshd) on the bridge
    and on the subnet's last /30 with the head: the only way to the nodes; hostname `gateway`
    each node and the gateway: its own /etc/munge, /etc/slurm, /run, Slurm folders and systemctl, and a
    read-only dpkg database (cluster.lab.pc, cluster.lab.units): Debian's munge and Slurm run in it as in a PC

Nodes have no default route: like a lab network without internet. Everything a
lab owns carries its name, so `up` can reclaim what a crashed run left behind and
`down` leaves no namespace, link, process or mount.
"""
from __future__ import annotations

import ipaddress
import os
import pwd
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from cluster.errors import LabError, UsageError
from cluster.lab import slurm as lab_slurm
from cluster.lab.net import (ANY_LAB, answers, kill_netns, links, netns_list, sh, start_gateway_links, start_links,
                             subnet_in_use)
from cluster.lab.processes import alive
from cluster.lab.shaping import RATE_RE, limit_cpu, remove_cgroups, shape_link, shape_uplink
from cluster.lab.slurm_conf import login_address
from cluster.lab.accounts import HOME_POINT, USER_RE, USERS_POINT, class_users, keygen, prepare_user
from cluster.lab.sshd import MOUNT_POINT, SSHD, SSHD_CONFIG, start_sshd, wait_listening
from cluster.lab.state import (LabState, NodeState, NodeStatus, default_dir, load_state, probe_ns, save_state,
                               state_path)

__all__ = ["NAME_RE", "LabState", "NodeState", "NodeStatus", "default_dir", "down", "labs_here", "leftovers",
           "load_state", "preflight", "state_path", "status", "up"]

NAME_RE = re.compile(rf"^{ANY_LAB}\Z")


def preflight() -> None:
    """Refuse early, with the reason, where the lab cannot run."""
    if os.geteuid() != 0:
        raise LabError("the simulated lab needs root (network namespaces, bridges, bind mounts)",
                       "run as root (sudo), or use the embedded local inventory: inventory/local.yaml")
    for tool in ("ip", "unshare", "ssh-keygen", SSHD):
        if not shutil.which(tool):
            pkg = {"ip": "iproute2", "unshare": "util-linux", "ssh-keygen": "openssh-client"}.get(tool, "openssh-server")
            raise LabError(f"`{tool}` is not installed", f"apt-get install {pkg}")
    probe = f"clusterctl-probe-{os.getpid()}"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        raise LabError("cannot create network namespaces here (no CAP_SYS_ADMIN or no netns support)",
                       "run on a Linux machine as root, or use inventory/local.yaml")
    sh("ip", "netns", "del", probe, check=False)


def _validate(name: str, nodes: int, subnet: str, gateway: bool = False) -> ipaddress.IPv4Network:
    if not NAME_RE.match(name):
        raise UsageError(f"lab name {name!r} is not valid",
                         "use 1-8 lowercase letters or digits, starting with a letter (it prefixes link names)")
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as e:
        raise UsageError(f"--subnet {subnet!r}: {e}", "e.g. --subnet 10.77.0.0/24") from None
    if not 1 <= nodes <= net.num_addresses - (16 if gateway else 12):  # a gateway's /30 is the subnet's last
        raise UsageError(f"cannot fit {nodes} nodes in {net}", "use a larger --subnet or fewer nodes")
    return net


def _check_up(nodes: int, name: str, subnet: str, bandwidth: str | None, cpu_quotas: list[float] | None,
              uplink: str | None, gateway: bool = False) -> ipaddress.IPv4Network:
    """Refuse bad arguments before anything is created."""
    net = _validate(name, nodes, subnet, gateway)
    if gateway and uplink:
        raise UsageError("--uplink shapes the head's link to the lab's bridge, which a --gateway lab does not have",
                         "use --bandwidth (each node's link) with --gateway")
    for flag, rate in (("--bandwidth", bandwidth), ("--uplink", uplink)):
        if rate is not None and not RATE_RE.match(rate):
            raise UsageError(f"{flag} {rate!r} is not a rate tc understands",
                             f"a number and a unit, e.g. {flag} 1gbit, 100mbit or 12.5mbps")
    if cpu_quotas is not None and (len(cpu_quotas) != nodes or not all(0.05 <= q <= 1.0 for q in cpu_quotas)):
        raise UsageError(f"--cpu-quota: expected {nodes} fractions of a core between 0.05 and 1, got {cpu_quotas}",
                         "e.g. --cpu-quota 1,0.35 for two nodes")
    return net


def _prepare_dir(d: Path, name: str) -> None:
    """The lab's directory: its login key (authorized on every node) and the nodes' sshd_config."""
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    keygen(d / "id_ed25519", f"clusterctl-lab-{name}")
    shutil.copyfile(d / "id_ed25519.pub", d / "authorized_keys")
    (d / "sshd_config").write_text(SSHD_CONFIG.format(authorized_keys=d / "authorized_keys"))
    MOUNT_POINT.mkdir(parents=True, exist_ok=True)
    HOME_POINT.mkdir(parents=True, exist_ok=True)
    USERS_POINT.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory


def up(nodes: int, name: str = "lab", subnet: str = "10.77.0.0/24", bandwidth: str | None = None,
       directory: Path | None = None, cpu_quotas: list[float] | None = None, uplink: str | None = None,
       gateway: bool = False, user: str = "root", slurm: bool = False, users: list[str] | None = None) -> LabState:
    """Start (or re-start) a lab of `nodes` nodes. Stale pieces of the same name are reclaimed first.

    `cpu_quotas` makes the lab heterogeneous for real: node i is pinned to one core (round robin) and
    may use cpu_quotas[i] of it (cgroup CPU bandwidth), like PCs of different speeds.
    `uplink` models the head's one NIC: every byte between the head and any node shares that rate.
    `gateway`: the head has no route to the nodes' bridge; it reaches one gateway PC (its own namespace
    and sshd, on the subnet's last /30) and the nodes only through it (the inventory's proxy_jump).
    `user`: the nodes' login user; another than root gets NOPASSWD sudo and the inventory says `become`.
    `users`: a class, this machine's accounts: the same uid and gid on every PC, their own home there, and their
    own key, known_hosts and inventory in their home here (cluster.lab.accounts).
    `slurm`: a real Slurm too (cluster.lab.slurm): slurmctld on the head, a slurmd in each node, a login node
    of its own and a shared folder; the inventory declares it as the cluster `slurm`."""
    net = _check_up(nodes, name, subnet, bandwidth, cpu_quotas, uplink, gateway)
    if not USER_RE.match(user):
        raise UsageError(f"--user {user!r} is not a user name", "lowercase letters, digits, '_' or '-', e.g. student")
    folders = class_users(users or [], user, name)
    preflight()
    if slurm:
        lab_slurm.preflight()
    d = (directory or default_dir(name)).resolve()
    down(name, d)
    bridge = f"{name}-br"
    used_by = subnet_in_use(net, bridge)
    if used_by:
        raise LabError(f"subnet {net} is already used by interface {used_by}",
                       f"pick another with --subnet, or `clusterctl lab down` the lab that owns {used_by}")
    _prepare_dir(d, name)
    for u, folder in folders.items():
        prepare_user(u, folder, name)
    hosts = list(net.hosts())
    sh("ip", "link", "add", bridge, "type", "bridge")
    if not gateway:  # the head's side of the bridge; with --gateway, the gateway PC has this address
        sh("ip", "addr", "add", f"{hosts[0]}/{net.prefixlen}", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    state = LabState(name=name, subnet=str(net), bridge=bridge, gateway=str(hosts[0]), bandwidth=bandwidth,
                     dir=str(d), inventory=str(d / "inventory.yaml"), nodes=[], uplink=uplink, user=user,
                     users=folders)
    try:
        if uplink:
            state.ifb = shape_uplink(name, bridge, uplink)
        if gateway:
            _start_gateway(state, net)
        for i in range(1, nodes + 1):
            node = NodeState(name=f"node{i}", netns=f"{name}-n{i}", veth=f"{name}-v{i}",
                             address=str(hosts[9 + i]), hostname=f"node{i}", dir=str(d / f"node{i}"))
            state.nodes.append(node)
            _start_node(state, node, net.prefixlen, None if cpu_quotas is None else cpu_quotas[i - 1], i - 1)
        for node in state.nodes:
            wait_listening(node, probe_ns(state))
        if slurm:
            _start_slurm(state, net)
    except BaseException:
        down(name, d)
        raise
    _write_known_hosts(state)
    _write_inventory(state)
    save_state(state)
    return state


def _start_gateway(state: LabState, net: ipaddress.IPv4Network) -> None:
    """The gateway PC: on the bridge at the subnet's first address, and the only PC the head reaches, on
    the subnet's last /30 (head .253, gateway .254 of a /24), with its own sshd and host key."""
    last = ipaddress.IPv4Network(f"{net.broadcast_address - 3}/30")
    head_end, outer = list(last.hosts())
    jump = NodeState(name="gateway", netns=f"{state.name}-gw", veth=f"{state.name}-vg", address=str(outer),
                     hostname="gateway", dir=str(Path(state.dir) / "gateway"))
    state.jump = jump
    start_gateway_links(jump, state.bridge, state.gateway, net.prefixlen, str(head_end))
    start_sshd(jump, Path(state.dir), pc=True, users=state.users)
    wait_listening(jump)


def _start_slurm(state: LabState, net: ipaddress.IPv4Network) -> None:
    """--slurm: the login node (netns <name>-sl at the subnet's .10, its own sshd and host key, the nodes'
    login user; not a compute node), then the lab's Slurm (cluster.lab.slurm) with it."""
    login = NodeState(name="login", netns=f"{state.name}-sl", veth=f"{state.name}-vs",
                      address=login_address(net), hostname="login", dir=str(Path(state.dir) / "login"))
    start_links(login, state.bridge, net.prefixlen)
    if state.bandwidth:
        shape_link(login.netns, login.veth, state.bandwidth)
    start_sshd(login, Path(state.dir), state.user, users=state.users)
    wait_listening(login, probe_ns(state))
    lab_slurm.start(state, login, sys.executable)


def _start_node(state: LabState, node: NodeState, prefix: int, quota: float | None, index: int) -> None:
    """One node: its links (shaped if the lab has a bandwidth), its sshd, and its CPU limit if it has one."""
    start_links(node, state.bridge, prefix)
    if state.bandwidth:
        shape_link(node.netns, node.veth, state.bandwidth)
    pid = start_sshd(node, Path(state.dir), state.user, lab=state.name, users=state.users)
    if quota is not None:
        cores = sorted(os.sched_getaffinity(0))
        core = cores[index % len(cores)]
        limit_cpu(state.name, node.name, pid, core, quota)
        node.cpu, node.cpu_quota = str(core), quota


def _write_known_hosts(state: LabState) -> None:
    # We generated these host keys ourselves, so recording them is verification, not blind trust.
    lines = []
    for node in [*state.nodes, *([state.jump] if state.jump else []), *([state.slurm.login] if state.slurm else [])]:
        kind, b64 = (Path(node.dir) / "hostkey.pub").read_text().split()[:2]
        lines.append(f"{node.address} {kind} {b64}\n")
    (Path(state.dir) / "known_hosts").write_text("".join(lines))


def _write_inventory(state: LabState) -> None:
    d = Path(state.dir)
    doc = {
        "name": state.name,
        "rank0": state.nodes[0].name,
        "defaults": {
            "user": state.user,
            # another user than root: what provision does as root (the work directory) goes through sudo -n
            **({"become": True} if state.user != "root" else {}),
            "identity_file": str(d / "id_ed25519"),
            "known_hosts": str(d / "known_hosts"),
            "python": "python3",
            "workdir": str(MOUNT_POINT),
            "connect_timeout": 3,
            # The simulated nodes are CPU-only and offline: the head's wheelhouse takes torch from the
            # default index (PyPI's build runs on the CPU too) instead of download.pytorch.org/whl/cpu.
            "vars": {"torch_index": "pypi"},
            # --gateway: the nodes are reached through the gateway PC (OpenSSH's ProxyJump)
            **({"proxy_jump": f"root@{state.jump.address}"} if state.jump else {}),
        },
        "groups": {"lab": {"hosts": [n.name for n in state.nodes]}},
        "hosts": {n.name: {"address": n.address} for n in state.nodes},
        # --slurm or --gateway only: the inventory loader refuses top-level keys it does not know
        **({"slurm": clusters} if (clusters := {**_room_inventory(state), **_slurm_inventory(state)}) else {}),
    }
    header = f"# Simulated lab '{state.name}' ({len(state.nodes)} nodes on {state.subnet}), written by clusterctl lab up.\n"
    Path(state.inventory).write_text(header + yaml.safe_dump(doc, sort_keys=False))
    for user, folder in state.users.items():
        _write_user_files(state, doc, user, Path(folder))


def _write_user_files(state: LabState, lab_doc: dict[str, Any], user: str, folder: Path) -> None:
    """--users: a student's known_hosts and inventory, in their own folder (theirs, 0600): their key, their
    workdir in their home on each PC (runs, datasets, requirement layers: theirs alone), the environment the
    admin provisioned (read-only for them), and the room's controller as themselves (Slurm queues their jobs
    under their name)."""
    doc = {**lab_doc, "defaults": {
        **lab_doc["defaults"], "user": user, "identity_file": str(folder / "id_ed25519"),
        "known_hosts": str(folder / "known_hosts"), "workdir": "clusterctl",
        "python": f"{MOUNT_POINT}/venv/bin/python", "vars": {**lab_doc["defaults"]["vars"], "python_env": "existing"},
        **({"proxy_jump": f"{user}@{state.jump.address}"} if state.jump else {})}}
    doc["defaults"].pop("become", None)
    doc.pop("slurm", None)
    if (room := _room_inventory(state)):  # the room only: --slurm's cluster has one shared workdir, the admin's
        doc["slurm"] = {"room": {**room["room"], "controller": {**room["room"]["controller"], "user": user}}}
    pw = pwd.getpwnam(user)
    for name, text in (("known_hosts", (Path(state.dir) / "known_hosts").read_text()),
                       ("inventory.yaml", f"# Simulated lab '{state.name}' as {user} sees it, written by clusterctl "
                                          f"lab up --users.\n" + yaml.safe_dump(doc, sort_keys=False))):
        (folder / name).write_text(text)
        (folder / name).chmod(0o600)
        os.chown(folder / name, pw.pw_uid, pw.pw_gid)


def _room_inventory(state: LabState) -> dict[str, dict[str, Any]]:
    """--gateway: the room as a Slurm cluster to make (`provision --slurm`): the gateway PC its controller
    (reached directly, as root like the proxy_jump entry: `none` overrides the defaults' jump), the nodes its
    compute nodes (cluster.lab.pc gives each PC its own munge and Slurm folders and systemctl)."""
    if state.jump is None:
        return {}
    return {"room": {"controller": {"address": state.jump.address, "user": "root", "proxy_jump": "none"},
                     "nodes": "lab", "partition": "room"}}


def _slurm_inventory(state: LabState) -> dict[str, object]:
    """--slurm: the lab's cluster by name, its login node a host entry (user, key, known_hosts and proxy_jump
    from `defaults`)."""
    if state.slurm is None:
        return {}
    ctl = state.slurm
    return {lab_slurm.CLUSTER: {"login": {"address": ctl.login.address}, "partition": ctl.partition,
                                "workdir": f"{ctl.shared_mount}/clusterctl", "python": ctl.python}}


def down(name: str = "lab", directory: Path | None = None, purge: bool = False) -> list[str]:
    """Remove every namespace, link and process of lab `name`. Idempotent.

    The directory (keys, and the nodes' /srv/cluster: venvs, data, runs) and the --users' folders stay unless
    `purge`.
    """
    if not NAME_RE.match(name):
        raise UsageError(f"lab name {name!r} is not valid", "use the name given to `lab up`")
    removed: list[str] = lab_slurm.stop(name)  # slurmctld and munged live on the head, not in a namespace
    for ns in netns_list(name):
        kill_netns(ns)
        sh("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    for link in links(name):
        sh("ip", "link", "del", link, check=False)
        removed.append(f"link {link}")
    removed += remove_cgroups(name)
    state = state_path(name, directory)
    if purge and (st := load_state(name, directory)):
        for folder in st.users.values():  # --users: the folder lab up made in each one's home
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(f"directory {folder}")
    if state.exists():
        state.unlink()
    if purge and state.parent.exists():
        shutil.rmtree(state.parent)
        removed.append(f"directory {state.parent}")
    return removed


def leftovers(name: str) -> list[str]:
    """The namespaces and links of lab `name` that exist on this machine, as `down` names what it removes:
    where its state is gone (a killed `lab up` or test), what `down --name` would still remove."""
    return [f"netns {ns}" for ns in netns_list(name)] + [f"link {link}" for link in links(name)]


def labs_here() -> dict[str, list[str]]:
    """Every lab on this machine by its pieces (a lab up, or what a killed `lab up` or test left), found by the
    names `up` gives them, whatever their state directory: name -> the pieces `down --name` would remove."""
    found: dict[str, list[str]] = {}
    for kind, names in (("netns", netns_list(None)), ("link", links(None))):
        for n in names:  # <lab>-<suffix>: a lab's name has no "-"
            found.setdefault(n.rsplit("-", 1)[0], []).append(f"{kind} {n}")
    return dict(sorted(found.items()))


def status(name: str = "lab", directory: Path | None = None) -> tuple[LabState | None, list[NodeStatus]]:
    """Each node's namespace, sshd and port 22, and a --slurm lab's login node's (its Slurm: lab_slurm.status)."""
    state = load_state(name, directory)
    if state is None:
        return None, []
    present = set(netns_list(name))
    rows = []
    for n in [*state.nodes, *([state.slurm.login] if state.slurm else [])]:
        rows.append(NodeStatus(n.name, n.address, n.netns in present, n.pid is not None and alive(n.pid),
                               answers(probe_ns(state), n.address, 22, 0.5), n.power))
    return state, rows
