"""Problems `check` reports from reachability and facts, each with its fix and whether it blocks."""
from __future__ import annotations

import pwd
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable

from cluster.nodes import firewall
from cluster.nodes.facts import NodeFacts
from cluster.nodes.fanout import HostResult
from cluster.inventory.model import Host

MIN_PYTHON = (3, 10)  # torch 2.14 and TF 2.21 wheels need 3.10+
# Free space at the workdir. Below DISK_BLOCK_GIB a run cannot keep its dataset, checkpoints (ResNet50 with
# SGD's momentum: ~0.2 GB each) and logs. A first provision writes ~10 GiB (wheels, then the venv with
# torch + TF), but provision measures exactly what each node still needs and refuses, before sending a byte,
# what does not fit (provision/diskspace.py): so under DISK_VENV_GIB check warns, and a provisioned node with
# 9 GiB free (seen in a real run's facts) is not called unhealthy.
DISK_BLOCK_GIB = 2.0
DISK_VENV_GIB = 10.0
DISK_WARN_GIB = 25.0
MAX_CLOCK_SKEW_S = 1.0


@dataclass(frozen=True)
class Problem:
    host: str
    code: str
    blocking: bool
    message: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def from_result(r: HostResult) -> list[Problem]:
    """A node that could not be reached or did not answer: one blocking problem."""
    if r.ok:
        return []
    return [Problem(r.host, r.problem or r.status, True, r.error or r.status, r.fix or "see the error")]


def shared_workdirs(hosts: list[Host], nf: dict[str, NodeFacts]) -> list[Problem]:
    """Hosts of the inventory whose work directories are one folder (one machine, by its boot id, and one
    device:inode and path there): each would overwrite the other's cluster.env, venv and runs. One blocking
    problem per host of such a group, naming the others."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for h in hosts:
        place = nf[h.name].values.get("place") if h.name in nf else None
        if place:
            groups.setdefault((place["boot_id"], place["anchor"], place["rest"].strip("/")), []).append(h.name)
    out = []
    for names in groups.values():
        for n in names if len(names) > 1 else []:
            others = ", ".join(x for x in names if x != n)
            out.append(Problem(n, "shared-workdir", True, f"its work directory is the one of {others} (the same "
                               "folder on the same machine: a duplicated address, two ports of one PC?)",
                               "give each host its own `workdir`, or remove the duplicate host from the inventory"))
    return out


def head_account(name: str) -> tuple[int, int] | None:
    """The head's uid and gid of user `name` (None: the head has no such user)."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


def accounts(hosts: list[Host], nf: dict[str, NodeFacts],
             head: Callable[[str], tuple[int, int] | None] = head_account) -> list[Problem]:
    """Each person's uid and gid on each PC (the login user's, and every account of a person there: a student's
    too), against the head's account of that name, else against most PCs: a Slurm job runs under the
    submitter's number on every PC, and munge's credentials carry numbers. One problem per PC and user that
    differs, naming the user, both numbers and the fix; accounts are never changed."""
    seen: dict[str, list[tuple[str, int, int]]] = {}
    for h in hosts:
        acct = nf[h.name].values.get("account") if h.name in nf and h.connection == "ssh" else None
        if acct:
            numbers = {**(acct.get("users") or {}), acct["name"]: [acct["uid"], acct["gid"]]}
            for name, (uid, gid) in sorted(numbers.items()):
                seen.setdefault(name, []).append((h.name, uid, gid))
    out = []
    for name, rows in seen.items():
        ref, where = head(name), "the head"
        if ref is None:
            ref, where = Counter((u, g) for _, u, g in rows).most_common(1)[0][0], "most PCs"
        for host, uid, gid in rows:
            if (uid, gid) != ref:
                out.append(Problem(host, "account-ids", False, f"user {name} is uid {uid}, gid {gid} here but "
                                   f"{ref[0]}, {ref[1]} on {where}: Slurm and munge would take it for another user",
                                   f"give {name} the same uid and gid everywhere (on {host}: `usermod -u {ref[0]} "
                                   f"{name}` and `groupmod -g {ref[1]} GROUP`, then chown its files), or one "
                                   "directory service (LDAP, sssd) for the room; clusterctl never changes accounts"))
    return out


def firewalls(hosts: list[Host], nf: dict[str, NodeFacts]) -> list[Problem]:
    """A host firewall (nftables) that would stop the run's TCP from the other nodes: blocking when it
    drops them for sure, a warning when it drops some ports or cannot be read."""
    out = []
    addresses = [h.address for h in hosts]
    for h in hosts:
        fw = nf[h.name].values.get("firewall") if h.name in nf else None
        if not fw or fw.get("state") == "absent":
            continue
        if fw.get("state") != "ok":
            out.append(Problem(h.name, "firewall-unreadable", False, f"cannot read the host firewall (`nft -j list "
                               f"ruleset`: {fw.get('error') or 'failed'})", "run check as a user that may list the "
                               "rules (root), or check by hand that the lab network is accepted"))
            continue
        peers = [a for a in addresses if firewall.is_ip(a)]  # the run's nodes, this one too (its own rendezvous)
        v = firewall.judge(fw["ruleset"], peers, nf[h.name].address_nic)
        if v.state == "blocked":
            out.append(Problem(h.name, "firewall", True, f"the host firewall blocks the run's traffic: {v.why}",
                               firewall.FIX))
        elif v.state in ("partly", "unknown"):
            out.append(Problem(h.name, "firewall", False, f"the host firewall may block the run's traffic: {v.why}",
                               firewall.FIX))
    return out


def from_facts(host: Host, f: NodeFacts) -> list[Problem]:
    v, out = f.values, []

    def add(code: str, blocking: bool, message: str, fix: str) -> None:
        out.append(Problem(host.name, code, blocking, message, fix))

    py = v.get("python")
    if py is None:
        add("python-missing", True, f"`{host.python}` does not run on the node",
            "install Python 3 (`apt-get install python3 python3-venv`) or set `python:` in the inventory")
    elif tuple(py["version_tuple"][:2]) < MIN_PYTHON:
        add("python-old", True, f"Python {py['version']} is older than {'.'.join(map(str, MIN_PYTHON))}",
            "install a newer Python and point `python:` at it")
    if py is not None and v.get("venv") is False and host.vars.get("python_env", "venv") == "venv" \
            and not (host.become and v.get("sudo")):  # with become, provision installs python3-venv
        add("python-venv", True, f"`{host.python} -m venv` cannot make an environment (no venv/ensurepip module)",
            "install it on the node: `apt-get install python3-venv` (as root, or with `become`)")
    if host.become and v.get("sudo") is False:
        add("sudo-password", True, f"become is set, but `sudo -n` on the node wants a password (or {host.user} may "
            "not use sudo): clusterctl never asks for one",
            f"give {host.user} passwordless sudo for what provision runs as root (docs/inventory.md `become`), "
            "or set become: false")
    if v.get("workdir_writable") is False and not (host.become and v.get("sudo")):
        add("workdir-unwritable", True, f"{host.user} cannot create or write the work directory {host.workdir}",
            f"create it for that user (`sudo install -d -o {host.user} {host.workdir}`), set `become: true` "
            "(provision makes it through sudo), or choose a `workdir:` in its home")
    disk = v.get("disk")
    if disk is None:
        add("disk-unknown", False, "could not measure free disk at the workdir", "check that `df` works there")
    elif disk["free_gib"] < DISK_BLOCK_GIB:
        add("disk-low", True, f"only {disk['free_gib']} GiB free at {disk['path']}: a run's data, checkpoints "
            "and logs will not fit", f"free space or move `workdir:`; a run needs at least {DISK_BLOCK_GIB:g} GiB")
    elif disk["free_gib"] < DISK_VENV_GIB:
        add("disk-low", False, f"{disk['free_gib']} GiB free at {disk['path']}: a first provision writes about "
            f"{DISK_VENV_GIB:g} GiB (wheels and the venv); provision measures what the node still needs and "
            "refuses what does not fit before it sends anything",
            "free space or move `workdir:` before a first provision; a provisioned node needs only room for runs")
    elif disk["free_gib"] < DISK_WARN_GIB:
        add("disk-low", False, f"{disk['free_gib']} GiB free at {disk['path']}",
            "datasets and checkpoints will need more; free space or move `workdir:`")
    if f.clock_offset_s is not None and abs(f.clock_offset_s) > MAX_CLOCK_SKEW_S:
        add("clock-skew", False, f"clock is {f.clock_offset_s:+.2f} s off the head's",
            "enable time sync on the node (`timedatectl set-ntp true`, or chrony pointed at the head)")
    hn = v.get("hostname") or {}
    if hn.get("on_loopback"):
        add("hostname-loopback", False,
            f"hostname {hn.get('name')} resolves to {', '.join(hn['resolves_to'])} (loopback)",
            "gloo/NCCL would bind loopback: provision pins the interface; or map the name to the lab "
            "address in /etc/hosts")
    if f.address_nic is None and host.connection == "ssh":
        add("address-nic", False, f"no interface on the node carries {host.address}",
            "the node is reached through NAT or a DNS alias: put its real lab address in the inventory")
    gpus = (v.get("gpus") or {}).get("gpus", [])
    gpu_error = (v.get("gpus") or {}).get("error")
    if gpu_error:
        add("gpu-driver", bool(host.gpu and host.gpu.count), f"nvidia-smi failed: {gpu_error}",
            "install or reload the NVIDIA driver (R580 is the last branch for GTX 9xx/10xx)")
    if host.gpu is not None and host.gpu.count > len(gpus):
        add("gpu-missing", True, f"the inventory expects {host.gpu.count} GPU(s), the node shows {len(gpus)}",
            "install the NVIDIA driver, check the card is seated, or set `gpu: {count: 0}` for a CPU-only node")
    if host.gpu is not None and host.gpu.model and gpus and not any(
            host.gpu.model.lower() in g["name"].lower() for g in gpus):
        add("gpu-model", False, f"the inventory expects a {host.gpu.model}, the node has "
            f"{', '.join(g['name'] for g in gpus)}", "fix `gpu.model` in the inventory")
    return out
