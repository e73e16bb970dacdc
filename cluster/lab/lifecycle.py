"""The simulated lab: one network namespace per node, each with its own sshd, hostname and /srv/cluster.

    bridge <name>-br (first address of the subnet, the head's side)
      └─ veth <name>-vN ── eth0 in netns <name>-nN (subnet .10+N), sshd on :22,
         hostname nodeN (on 127.0.1.1 in its /etc/hosts, as Debian does), <dir>/nodeN/srv on /srv/cluster,
         its own home (<dir>/nodeN/home on /srv/clusterctl-home, root's home in its copy of /etc/passwd)
    --gateway: no head address on the bridge; a gateway PC (netns <name>-gw, its own sshd) on the bridge
    and on the subnet's last /30 with the head: the only way to the nodes

Nodes have no default route: like a lab network without internet. Everything a
lab owns carries its name, so `up` can reclaim what a crashed run left behind and
`down` leaves no namespace, link, process or mount.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import yaml

from cluster.errors import LabError, UsageError
from cluster.lab import slurm as lab_slurm
from cluster.lab.net import kill_netns as _kill_netns
from cluster.lab.net import answers, links, netns_list, sh, start_gateway_links, start_links, subnet_in_use
from cluster.lab.shaping import RATE_RE, limit_cpu, remove_cgroups, shape_link, shape_uplink
from cluster.lab.state import LabState, NodeState, NodeStatus, default_dir, load_state, save_state, state_path

__all__ = ["MOUNT_POINT", "NAME_RE", "RATE_RE", "LabState", "NodeState", "NodeStatus", "default_dir", "down",
           "load_state", "preflight", "restart_sshd", "state_path", "status", "stop_sshd", "up"]

NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}\Z")
USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\Z")
SSHD = "/usr/sbin/sshd"
MOUNT_POINT = Path("/srv/cluster")
HOME_POINT = Path("/srv/clusterctl-home")  # each node's own home directory is mounted here, in its namespace
SSHD_CONFIG = """\
# sshd for one node of a clusterctl simulated lab (written by `clusterctl lab up`)
Port 22
AuthorizedKeysFile {authorized_keys} .ssh/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The lab directory may sit under a group-writable tree; keys are ours, made 0600.
StrictModes no
UseDNS no
PrintMotd no
MaxStartups 200:30:400
MaxSessions 64
Subsystem sftp internal-sftp
"""


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


def _keygen(path: Path, comment: str) -> None:
    if not path.exists():
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))


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
    _keygen(d / "id_ed25519", f"clusterctl-lab-{name}")
    shutil.copyfile(d / "id_ed25519.pub", d / "authorized_keys")
    (d / "sshd_config").write_text(SSHD_CONFIG.format(authorized_keys=d / "authorized_keys"))
    MOUNT_POINT.mkdir(parents=True, exist_ok=True)
    HOME_POINT.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory


def up(nodes: int, name: str = "lab", subnet: str = "10.77.0.0/24", bandwidth: str | None = None,
       directory: Path | None = None, cpu_quotas: list[float] | None = None, uplink: str | None = None,
       gateway: bool = False, user: str = "root", slurm: bool = False) -> LabState:
    """Start (or re-start) a lab of `nodes` nodes. Stale pieces of the same name are reclaimed first.

    `cpu_quotas` makes the lab heterogeneous for real: node i is pinned to one core (round robin) and
    may use cpu_quotas[i] of it (cgroup CPU bandwidth), like PCs of different speeds.
    `uplink` models the head's one NIC: every byte between the head and any node shares that rate.
    `gateway`: the head has no route to the nodes' bridge; it reaches one gateway PC (its own namespace
    and sshd, on the subnet's last /30) and the nodes only through it (the inventory's proxy_jump).
    `user`: the nodes' login user; another than root gets NOPASSWD sudo and the inventory says `become`.
    `slurm`: a real Slurm too (cluster.lab.slurm): slurmctld on the head, a slurmd in each node, a login node
    of its own and a shared folder; the inventory declares it as the cluster `slurm`."""
    net = _check_up(nodes, name, subnet, bandwidth, cpu_quotas, uplink, gateway)
    if not USER_RE.match(user):
        raise UsageError(f"--user {user!r} is not a user name", "lowercase letters, digits, '_' or '-', e.g. student")
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
    hosts = list(net.hosts())
    sh("ip", "link", "add", bridge, "type", "bridge")
    if not gateway:  # the head's side of the bridge; with --gateway, the gateway PC has this address
        sh("ip", "addr", "add", f"{hosts[0]}/{net.prefixlen}", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    state = LabState(name=name, subnet=str(net), bridge=bridge, gateway=str(hosts[0]), bandwidth=bandwidth,
                     dir=str(d), inventory=str(d / "inventory.yaml"), nodes=[], uplink=uplink, user=user)
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
            _wait_listening(node, state.jump.netns if state.jump else None)
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
    _start_sshd(jump, Path(state.dir))
    _wait_listening(jump)


def _start_slurm(state: LabState, net: ipaddress.IPv4Network) -> None:
    """--slurm: the login node (netns <name>-sl at the subnet's .10, its own sshd and host key, the nodes'
    login user; not a compute node), then the lab's Slurm (cluster.lab.slurm) with it."""
    login = NodeState(name="login", netns=f"{state.name}-sl", veth=f"{state.name}-vs",
                      address=lab_slurm.login_address(net), hostname="login", dir=str(Path(state.dir) / "login"))
    start_links(login, state.bridge, net.prefixlen)
    if state.bandwidth:
        shape_link(login.netns, login.veth, state.bandwidth)
    _start_sshd(login, Path(state.dir), state.user)
    _wait_listening(login, state.jump.netns if state.jump else None)
    lab_slurm.start(state, login, sys.executable)


def _start_node(state: LabState, node: NodeState, prefix: int, quota: float | None, index: int) -> None:
    """One node: its links (shaped if the lab has a bandwidth), its sshd, and its CPU limit if it has one."""
    start_links(node, state.bridge, prefix)
    if state.bandwidth:
        shape_link(node.netns, node.veth, state.bandwidth)
    pid = _start_sshd(node, Path(state.dir), state.user, lab=state.name)
    if quota is not None:
        cores = sorted(os.sched_getaffinity(0))
        core = cores[index % len(cores)]
        limit_cpu(state.name, node.name, pid, core, quota)
        node.cpu, node.cpu_quota = str(core), quota


def _accounts(nd: Path, user: str, home: Path, again: bool = False) -> list[tuple[Path, Path]]:
    """The node's own /etc/passwd (the login user's home: `home`), and for a user other than root its own
    /etc/group, /etc/shadow (no password: keys only) and /etc/sudoers.d (NOPASSWD for that user), written
    beside the node and mounted over the host's in the node's namespace only: (file, mount point) pairs.
    The head's Python may live under /root (pyenv), which is 0700: its folder is shown in a /root of the
    node's own, so that a python_env: existing run as that user finds it.
    `again`: the node powering on from its own namespace (a magic packet), where /etc is already the node's:
    the files written at `lab up` are mounted as they are."""
    again = again and (nd / "passwd").exists()
    if user == "root":
        if not again:
            (nd / "passwd").write_text(_passwd_with_home(Path("/etc/passwd").read_text(), "root", str(HOME_POINT)))
        return [(nd / "passwd", Path("/etc/passwd"))]
    if not again:
        _write_accounts(nd, user, home)
    mounts = [(nd / "passwd", Path("/etc/passwd")), (nd / "group", Path("/etc/group")),
              (nd / "shadow", Path("/etc/shadow")), (nd / "sudoers.d", Path("/etc/sudoers.d"))]
    pyenv = Path("/root/.pyenv")
    if pyenv.is_dir():
        view = nd / "rootview"
        (view / ".pyenv").mkdir(parents=True, exist_ok=True)
        view.chmod(0o755)
        mounts += [(pyenv, view / ".pyenv"), (view, Path("/root"))]
    return mounts


def _write_accounts(nd: Path, user: str, home: Path) -> None:
    """A non-root login user's files for the node (see _accounts), from this machine's own."""
    passwd = Path("/etc/passwd").read_text()
    if not Path("/etc/sudoers.d").is_dir() or not shutil.which("sudo"):
        raise LabError("--user needs sudo on this machine (the nodes share its /usr)", "apt-get install sudo")
    taken = {int(line.split(":")[2]) for line in passwd.splitlines() if line.count(":") >= 6}
    uid = next(u for u in range(20000, 60000) if u not in taken)
    if any(line.split(":")[0] == user for line in passwd.splitlines()):
        raise UsageError(f"--user {user}: this machine has a user {user!r} already (the nodes share its accounts)",
                         "pick a name this machine does not have, e.g. --user student")
    (nd / "passwd").write_text(passwd + f"{user}:x:{uid}:{uid}::{HOME_POINT}:/bin/bash\n")
    (nd / "group").write_text(Path("/etc/group").read_text() + f"{user}:x:{uid}:\n")
    (nd / "shadow").write_text(Path("/etc/shadow").read_text() + f"{user}:*:19700:0:99999:7:::\n")
    (nd / "shadow").chmod(0o640)
    sudoers = nd / "sudoers.d"
    if sudoers.exists():
        shutil.rmtree(sudoers)
    shutil.copytree("/etc/sudoers.d", sudoers)
    (sudoers / "clusterctl-lab").write_text(f"{user} ALL=(ALL) NOPASSWD: ALL\n")
    (sudoers / "clusterctl-lab").chmod(0o440)
    sudoers.chmod(0o755)
    # sshd reads a user's keys as that user: the lab's key, in the home it can read (the lab folder is 0700)
    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(nd.parent / "authorized_keys", home / ".ssh" / "authorized_keys")
    for p in (home, *home.rglob("*")):
        os.chown(p, uid, uid)


def _start_sshd(node: NodeState, d: Path, user: str = "root", lab: str | None = None, again: bool = False) -> int:
    """Start the node's sshd in its namespace (own hostname, /srv/cluster, /etc/hosts, home and accounts);
    returns its pid. `again`: its accounts as `lab up` wrote them (see _accounts)."""
    nd = Path(node.dir)
    (nd / "srv").mkdir(parents=True, exist_ok=True)
    _keygen(nd / "hostkey", f"clusterctl-lab-{node.hostname}")
    pidfile = nd / "sshd.pid"
    pidfile.unlink(missing_ok=True)
    # A PC of its own: its home directory (root's, in this node's copy of /etc/passwd), with a fresh shell's
    # ~/.bashrc (the head's, with pyenv or conda, would run before every command), so that a workdir in
    # the login directory is the node's own, not one folder shared by every node.
    home = nd / "home"
    home.mkdir(exist_ok=True)
    (home / ".bashrc").write_text("# clusterctl lab node: its own home, not the head's\n")
    mounts = _accounts(nd, user, home, again)
    if lab is not None:  # a node (not the gateway nor a login node): its power switch is the lab's
        from cluster.lab.switch import power_bin

        mounts += power_bin(node, lab, d)
    # Debian's installer writes the hostname on 127.0.1.1, and nothing resolves the other PCs' names.
    (nd / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{node.hostname}\n"
                              "::1\tlocalhost ip6-localhost ip6-loopback\n")
    q = shlex.quote
    script = (
        f"hostname {q(node.hostname)} && mount --bind {q(str(nd / 'srv'))} {q(str(MOUNT_POINT))} && "
        f"mount --bind {q(str(home))} {q(str(HOME_POINT))} && "
        + "".join(f"mount --rbind {q(str(src))} {q(str(dst))} && " for src, dst in mounts) +  # rbind: the view's .pyenv
        f"mount --bind {q(str(nd / 'hosts'))} /etc/hosts && "
        f"exec {SSHD} -f {q(str(d / 'sshd_config'))} -h {q(str(nd / 'hostkey'))} "
        f"-o PidFile={q(str(pidfile))} -o ListenAddress={q(node.address)} -E {q(str(nd / 'sshd.log'))}"
    )
    sh("ip", "netns", "exec", node.netns, "unshare", "--uts", "--mount", "--propagation", "private",
        "sh", "-c", script)
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            node.pid = int(pidfile.read_text())
            return node.pid
        time.sleep(0.05)
    raise LabError(f"sshd of {node.name} did not start; see {nd / 'sshd.log'}")


def _answers(address: str, via: str | None, timeout: float) -> bool:
    """Port 22 of `address` open, from the head or (a gateway lab's nodes) from the gateway's namespace."""
    if via:
        return answers(via, address, 22, timeout)
    try:
        with socket.create_connection((address, 22), timeout=timeout):
            return True
    except OSError:
        return False


def _passwd_with_home(passwd: str, user: str, home: str) -> str:
    """/etc/passwd with `user`'s home directory (the sixth field) replaced."""
    lines = []
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) == 7 and parts[0] == user:
            parts[5] = home
        lines.append(":".join(parts))
    return "\n".join(lines) + "\n"


def _wait_listening(node: NodeState, via: str | None = None, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not _answers(node.address, via, 1.0):
        if time.monotonic() > deadline:
            raise LabError(f"{node.name} ({node.address}) does not answer on port 22")
        time.sleep(0.05)


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
        # --slurm only: the inventory loader refuses top-level keys it does not know
        **({"slurm": _slurm_inventory(state)} if state.slurm else {}),
    }
    header = f"# Simulated lab '{state.name}' ({len(state.nodes)} nodes on {state.subnet}), written by clusterctl lab up.\n"
    Path(state.inventory).write_text(header + yaml.safe_dump(doc, sort_keys=False))


def _slurm_inventory(state: LabState) -> dict[str, object]:
    """The inventory's `slurm:` section: the lab's cluster by name, its login node a host entry (user, key,
    known_hosts and proxy_jump from `defaults`)."""
    assert state.slurm is not None
    ctl = state.slurm
    return {lab_slurm.CLUSTER: {"login": {"address": ctl.login.address}, "partition": ctl.partition,
                                "workdir": f"{ctl.shared_mount}/clusterctl", "python": ctl.python}}


def down(name: str = "lab", directory: Path | None = None, purge: bool = False) -> list[str]:
    """Remove every namespace, link and process of lab `name`. Idempotent.

    The directory (keys, and the nodes' /srv/cluster: venvs, data, runs) stays unless `purge`.
    """
    if not NAME_RE.match(name):
        raise UsageError(f"lab name {name!r} is not valid", "use the name given to `lab up`")
    removed: list[str] = lab_slurm.stop(name)  # slurmctld and munged live on the head, not in a namespace
    for ns in netns_list(name):
        _kill_netns(ns)
        sh("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    for link in links(name):
        sh("ip", "link", "del", link, check=False)
        removed.append(f"link {link}")
    removed += remove_cgroups(name)
    state = state_path(name, directory)
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
    state = load_state(name, directory)
    if state is None:
        return None, []
    present = set(netns_list(name))
    rows = []
    for n in state.nodes:
        alive = n.pid is not None and _pid_alive(n.pid)
        port = _answers(n.address, state.jump.netns if state.jump else None, 0.5)
        rows.append(NodeStatus(n.name, n.address, n.netns in present, alive, port, n.power))
    if state.slurm:  # the login node's sshd; its Slurm part: lab_slurm.status
        lg = state.slurm.login
        rows.append(NodeStatus(lg.name, lg.address, lg.netns in present, lg.pid is not None and _pid_alive(lg.pid),
                               _answers(lg.address, state.jump.netns if state.jump else None, 0.5)))
    return state, rows


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------- failure injection (tests, teaching)


def stop_sshd(state: LabState, node: str) -> None:
    """Stop one node's sshd (the PC is 'off' for SSH; its namespace stays)."""
    n = _node(state, node)
    if n.pid and _pid_alive(n.pid):
        os.kill(n.pid, signal.SIGTERM)
        for _ in range(100):
            if not _pid_alive(n.pid):
                break
            time.sleep(0.02)


def restart_sshd(state: LabState, node: str, new_host_key: bool = False) -> None:
    """Start a node's sshd again; with `new_host_key`, as if the PC had been reinstalled."""
    n = _node(state, node)
    stop_sshd(state, node)
    if new_host_key:
        for suffix in ("", ".pub"):
            (Path(n.dir) / f"hostkey{suffix}").unlink(missing_ok=True)
    _start_sshd(n, Path(state.dir), state.user, lab=state.name)
    if state.slurm:  # a new sshd, a new mount namespace: the lab's /etc/slurm and shared folder again
        lab_slurm.mount_into(state, n)
    _wait_listening(n, state.jump.netns if state.jump else None)
    save_state(state)


def start_node_sshd(state: LabState, node: NodeState) -> None:
    """A node's sshd as at boot (`lab power on`, a magic packet), and wait until it answers; on a --slurm lab
    its slurmd too. Also run from the node's own namespaces (its Wake-on-LAN listener)."""
    _start_sshd(node, Path(state.dir), state.user, lab=state.name, again=True)
    _wait_listening(node, state.jump.netns if state.jump else None)
    if state.slurm:
        lab_slurm.mount_into(state, node)
        lab_slurm.restart_slurmd(state, node.name)


def _node(state: LabState, node: str) -> NodeState:
    for n in state.nodes:
        if n.name == node:
            return n
    raise UsageError(f"lab {state.name} has no node {node!r}", f"use one of {[n.name for n in state.nodes]}")
