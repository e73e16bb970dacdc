"""Facts about a node: each one a shell command plus a parser (tested on recorded outputs).

All commands of a node travel in one script (one round trip); the clock is probed
on its own afterwards so its round-trip time stays small and known.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.nodes import firewall
from cluster.nodes.fanout import Group, GroupResult
from cluster.nodes.gpus import compute_capability_for
from cluster.inventory.model import Host
from cluster.transport import Transport

MARK = "@@clusterctl-fact"


@dataclass(frozen=True)
class Fact:
    name: str
    command: Callable[[Host], str]
    parse: Callable[[str, int], Any]


# --------------------------------------------------------------------------- parsers


# the release and dpkg's architecture name a bundle of Debian packages (cluster.room.debs)
OS_CMD = 'cat /etc/os-release; echo "DPKG_ARCHITECTURE=$(dpkg --print-architecture 2>/dev/null)"'


def parse_os(out: str, rc: int) -> dict[str, str | None]:
    values = dict(re.findall(r'^(\w+)="?(.*?)"?$', out, re.M))
    return {"name": values.get("PRETTY_NAME") or values.get("NAME"), "id": values.get("ID"),
            "version": values.get("VERSION_ID"), "codename": values.get("VERSION_CODENAME") or None,
            "arch": values.get("DPKG_ARCHITECTURE") or None}


def parse_kernel(out: str, rc: int) -> str | None:
    return out.strip() or None


def parse_python(out: str, rc: int) -> dict[str, Any] | None:
    """`PY -c ...` prints executable then version; anything else means no usable Python."""
    lines = out.strip().splitlines()
    if rc != 0 or len(lines) < 2 or not re.match(r"^\d+\.\d+", lines[1]):
        return None
    version = lines[1].strip()
    return {"executable": lines[0].strip(), "version": version,
            "version_tuple": [int(x) for x in re.findall(r"\d+", version)[:3]]}


def parse_cpu(out: str, rc: int) -> dict[str, Any]:
    model = re.search(r"^model name\s*:\s*(.+)$", out, re.M)
    usable = re.search(r"^nproc=(\d+)$", out, re.M)
    logical = len(re.findall(r"^processor\s*:", out, re.M))
    return {"model": model.group(1).strip() if model else None,
            "logical": logical or None,
            "usable": int(usable.group(1)) if usable else None,
            **_topology(out, logical)}


def _topology(out: str, logical: int) -> dict[str, int | None]:
    """Sockets, cores per socket and threads per core (what slurm.conf's node line needs) from each processor's
    `physical id` and `core id`: distinct pairs are the cores. Without them (some VMs, ARM): one socket, each
    logical CPU a core."""
    ids: list[tuple[str, str]] = []
    for block in re.split(r"\n\s*\n", out):
        socket, core = (re.search(rf"^{k}\s*:\s*(\d+)$", block, re.M) for k in ("physical id", "core id"))
        if socket and core:
            ids.append((socket.group(1), core.group(1)))
    if not logical:
        return {"sockets": None, "cores_per_socket": None, "threads_per_core": None}
    if len(ids) != logical:
        return {"sockets": 1, "cores_per_socket": logical, "threads_per_core": 1}
    sockets, cores = len({p for p, _ in ids}), len(set(ids))
    return {"sockets": sockets, "cores_per_socket": cores // sockets, "threads_per_core": logical // cores}


def parse_memory(out: str, rc: int) -> dict[str, int | None]:
    kb = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB$", out, re.M)}

    def mib(k: str) -> int | None:
        return kb[k] // 1024 if k in kb else None

    return {"total_mib": mib("MemTotal"), "available_mib": mib("MemAvailable")}


def parse_disk(out: str, rc: int) -> dict[str, Any] | None:
    """`df -Pk` of the workdir (or its nearest existing parent)."""
    lines = [ln for ln in out.strip().splitlines() if ln and not ln.startswith("Filesystem")]
    if rc != 0 or not lines:
        return None
    parts = lines[-1].split()
    total_kb, avail_kb = int(parts[1]), int(parts[3])
    return {"path": parts[5], "total_gib": round(total_kb / 2**20, 1), "free_gib": round(avail_kb / 2**20, 1)}


def parse_gpus(out: str, rc: int) -> dict[str, Any]:
    """nvidia-smi CSV, with the fallback for drivers that reject `compute_cap` (R470 and older). The first
    column is `index` (the N of /dev/nvidiaN); outputs recorded before the query asked for it lack the column,
    and their GPUs have index None."""
    if "@@absent" in out:
        return {"source": "none", "gpus": [], "error": None}
    fallback = "@@fallback" in out
    body = out.split("@@fallback", 1)[1] if fallback else out
    gpus, errors = [], []
    for line in body.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        index = None
        if len(cells) == (4 if fallback else 5) and cells[0].isdigit():
            index, cells = int(cells[0]), cells[1:]
        if fallback and len(cells) == 3:
            name, driver, mem = cells
            cc = compute_capability_for(name)
        elif not fallback and len(cells) == 4:
            name, cc, driver, mem = cells
        else:
            errors.append(line.strip())
            continue
        gpus.append({"index": index, "name": name, "compute_capability": cc, "driver": driver,
                     "memory_mib": int(float(mem)) if re.match(r"^[\d.]+$", mem) else None})
    source = "nvidia-smi (no compute_cap: from the GPU name)" if fallback else "nvidia-smi"
    error = None
    if not gpus and errors:
        error = errors[0]
        source = "nvidia-smi failed"
    return {"source": source, "gpus": gpus, "error": error}


def parse_cgroup(out: str, rc: int) -> dict[str, Any]:
    """The file system type at /sys/fs/cgroup: `cgroup2fs` is the unified (v2) hierarchy that Slurm's
    cgroup/v2 plugin confines jobs with; `tmpfs` is v1 or hybrid; nothing: no cgroups mounted there."""
    fs = out.strip() or None
    return {"v2": fs == "cgroup2fs", "fs": fs}


def parse_nics(out: str, rc: int) -> list[dict[str, Any]]:
    """`ip -o addr show`: one line per address; interfaces in order, loopback included."""
    nics: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^\d+:\s+(\S+)\s+(inet6?)\s+(\S+)", line)
        if m:
            nics.setdefault(m.group(1).split("@")[0], []).append(m.group(3))
    # addresses alone (what the head reaches), and with their prefix (which network each is on)
    return [{"name": n, "addresses": [c.split("/")[0] for c in a], "cidrs": a} for n, a in nics.items()]


def parse_macs(out: str, rc: int) -> dict[str, str]:
    """`ip -o link show`: interface -> its Ethernet address (what Wake-on-LAN needs); loopback has none."""
    macs: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"^\d+:\s+([^:@\s]+)(?:@[^:\s]+)?:.*?\slink/ether\s+([0-9a-fA-F:]{17})\s", line)
        if m:
            macs[m.group(1)] = m.group(2).lower()
    return macs


ACCOUNTS = "id -u; id -g; id -un; getent passwd | head -n 5000"
PEOPLE = range(1000, 60000)  # Debian's uids of people (adduser.conf FIRST_UID..LAST_UID), not system accounts


def parse_account(out: str, rc: int) -> dict[str, Any] | None:
    """ACCOUNTS: the login user's numbers, and every person's account on the PC (`users`: name -> [uid, gid]):
    Slurm runs a job under its submitter's uid on every PC and munge's credentials carry numbers, not names."""
    lines = out.splitlines()
    words = " ".join(lines[:3]).split()
    if len(words) < 3 or not (words[0].isdigit() and words[1].isdigit()):
        return None
    users: dict[str, list[int]] = {}
    for line in lines[3:]:
        parts = line.split(":")
        if len(parts) >= 7 and parts[2].isdigit() and parts[3].isdigit() and int(parts[2]) in PEOPLE:
            users[parts[0]] = [int(parts[2]), int(parts[3])]
    return {"uid": int(words[0]), "gid": int(words[1]), "name": words[2], "users": users}


def parse_hostname(out: str, rc: int) -> dict[str, Any]:
    """`hostname` then `getent ahosts $(hostname)`: does the name resolve to loopback?"""
    lines = out.strip().splitlines()
    name = lines[0].strip() if lines else None
    addrs = sorted({ln.split()[0] for ln in lines[1:] if ln.split()})
    loop = [a for a in addrs if a.startswith("127.") or a == "::1"]
    return {"name": name, "resolves_to": addrs, "on_loopback": bool(loop)}


def parse_place(out: str, rc: int) -> dict[str, Any] | None:
    """Where the workdir is: the kernel's boot id (one per running machine), the device:inode of its nearest
    existing folder and the rest of its path. Two hosts with the same three share one folder (a duplicated
    address, two ports of one PC, two names for one machine); lab nodes share a kernel, not their folders."""
    lines = out.strip().splitlines()
    if rc != 0 or len(lines) < 3:
        return None
    return {"boot_id": lines[0].strip(), "anchor": lines[1].strip(), "path": lines[2].strip(),
            "rest": lines[3].strip() if len(lines) > 3 else ""}


# --------------------------------------------------------------------------- commands


def _python_cmd(h: Host) -> str:
    code = "import sys, platform; print(sys.executable); print(platform.python_version())"
    return f"{shlex.quote(h.python)} -c {shlex.quote(code)}"


def _disk_cmd(h: Host) -> str:
    return (f"d={shlex.quote(h.workdir)}; while [ ! -e \"$d\" ]; do d=$(dirname -- \"$d\"); done; "
            'df -Pk -- "$d"')


_NVSMI = "nvidia-smi --format=csv,noheader,nounits --query-gpu="
GPU_CMD = (
    "if command -v nvidia-smi >/dev/null 2>&1; then "
    f"{_NVSMI}index,name,compute_cap,driver_version,memory.total 2>&1 || "
    f"{{ echo @@fallback; {_NVSMI}index,name,driver_version,memory.total 2>&1; }}; "
    "else echo @@absent; fi"
)

def _ran(rc: int) -> bool | None:
    """A yes/no fact: its command's success; None when it was not run (127: an output recorded before it)."""
    return None if rc == 127 else rc == 0


def _place_cmd(h: Host) -> str:
    return (f"w={shlex.quote(h.workdir)}; d=$w; while [ ! -e \"$d\" ]; do d=$(dirname -- \"$d\"); done; "
            "cat /proc/sys/kernel/random/boot_id && stat -L -c %d:%i -- \"$d\" && (cd -- \"$d\" && pwd -P) && "
            'echo "${w#"$d"}"')


FACTS: tuple[Fact, ...] = (
    Fact("os", lambda h: OS_CMD, parse_os),
    Fact("kernel", lambda h: "uname -srm", parse_kernel),
    Fact("python", _python_cmd, parse_python),
    Fact("cpu", lambda h: "echo nproc=$(nproc); cat /proc/cpuinfo", parse_cpu),
    Fact("memory", lambda h: "cat /proc/meminfo", parse_memory),
    Fact("disk", _disk_cmd, parse_disk),
    Fact("gpus", lambda h: GPU_CMD, parse_gpus),
    Fact("nics", lambda h: "ip -o addr show", parse_nics),
    Fact("macs", lambda h: "ip -o link show", parse_macs),
    Fact("cgroup", lambda h: "stat -fc %T /sys/fs/cgroup 2>/dev/null", parse_cgroup),
    Fact("hostname", lambda h: 'hostname; getent ahosts "$(hostname)"', parse_hostname),
    Fact("account", lambda h: ACCOUNTS, parse_account),
    Fact("place", _place_cmd, parse_place),
    Fact("firewall", lambda h: firewall.COMMAND, firewall.parse),
    Fact("sudo", lambda h: "sudo -n true" if h.become else "exit 127", lambda out, rc: _ran(rc)),
    Fact("venv", lambda h: f"{shlex.quote(h.python)} -c 'import venv, ensurepip'", lambda out, rc: _ran(rc)),
    Fact("workdir_writable", lambda h: (f"d={shlex.quote(h.workdir)}; while [ ! -e \"$d\" ]; do "
                                        'd=$(dirname -- "$d"); done; test -w "$d" && test -x "$d"'),
         lambda out, rc: _ran(rc)),
)


def script(host: Host, facts: tuple[Fact, ...] = FACTS) -> str:
    """One shell script printing every fact's output between markers, with its exit code."""
    parts = [f"echo {MARK}:{f.name}; ( {f.command(host)} ) 2>&1; echo {MARK}-rc:$?" for f in facts]
    return "\n".join(parts)


def split_output(text: str) -> dict[str, tuple[str, int]]:
    """Marker-delimited script output -> {fact: (output, exit code)}."""
    sections: dict[str, tuple[str, int]] = {}
    pattern = re.compile(rf"^{MARK}:(\w+)\n(.*?)^{MARK}-rc:(\d+)$", re.M | re.S)
    for m in pattern.finditer(text):
        sections[m.group(1)] = (m.group(2), int(m.group(3)))
    return sections


def parse_all(text: str, facts: tuple[Fact, ...] = FACTS) -> dict[str, Any]:
    sections = split_output(text)
    out: dict[str, Any] = {}
    for f in facts:
        raw, rc = sections.get(f.name, ("", 127))
        out[f.name] = f.parse(raw, rc)
    return out


@dataclass
class NodeFacts:
    """Everything `check` and later `provision` need to know about a node, as plain data."""

    host: str
    values: dict[str, Any] = field(default_factory=dict)
    address_nic: str | None = None
    clock_offset_s: float | None = None
    clock_uncertainty_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, **self.values, "address_nic": self.address_nic,
                "clock_offset_s": self.clock_offset_s, "clock_uncertainty_s": self.clock_uncertainty_s}


SUMMARY_COLUMNS = ("os", "python", "cpus", "ram", "disk", "gpus", "nic", "clock s")


def summary(f: dict[str, Any]) -> list[str | None]:
    """A node's facts (NodeFacts.to_dict()) as the short cells of `check`'s table, in SUMMARY_COLUMNS order.
    None is a fact the node must have and lacks (no usable Python): the reader says how to show it."""
    os_ = f.get("os") or {}
    py = f.get("python")
    mem = f.get("memory") or {}
    disk = f.get("disk")
    gpus = (f.get("gpus") or {}).get("gpus") or []
    gpu_txt = ", ".join(f"{g['name'].replace('NVIDIA ', '').replace('GeForce ', '')} "
                        f"(cc {g['compute_capability']}, {g['driver']})" for g in gpus) or "none"
    return [
        f"{os_.get('id') or '?'} {os_.get('version') or ''}".strip(),
        py["version"] if py else None,
        str((f.get("cpu") or {}).get("usable") or "?"),
        f"{(mem.get('total_mib') or 0) / 1024:.0f}G",
        f"{disk['free_gib']:.0f}G" if disk else "?",
        gpu_txt,
        f.get("address_nic") or "-",
        f"{f['clock_offset_s']:+.3f}" if f.get("clock_offset_s") is not None else "?",
    ]


def clock_offset(t: Transport) -> tuple[float, float]:
    """Node clock minus head clock (NTP-style midpoint), and half the round trip as uncertainty."""
    best: tuple[float, float] | None = None
    for _ in range(3):
        t0, remote, t1 = t.clock_sample()
        cand = (remote - (t0 + t1) / 2, (t1 - t0) / 2)
        if best is None or cand[1] < best[1]:
            best = cand
    assert best is not None
    return round(best[0], 4), round(best[1], 4)


def nic_for(nics: list[dict[str, Any]], address: str | None) -> str | None:
    for nic in nics:
        if address and address in nic["addresses"]:
            return str(nic["name"])
    return None


def gather_one(t: Transport) -> NodeFacts:
    r = t.run(script(t.host), timeout=60)
    values = parse_all(r.stdout)
    nf = NodeFacts(host=t.host.name, values=values)
    peer = t.peer_address or (t.host.address if t.host.connection == "local" else None)
    nf.address_nic = nic_for(values["nics"], peer)
    nf.clock_offset_s, nf.clock_uncertainty_s = clock_offset(t)
    return nf


def gather(group: Group, hosts: list[Host] | None = None,
           on_done: Callable[[Any], None] | None = None) -> GroupResult:
    """Facts from every node at once; `.value` of each ok result is a NodeFacts."""
    return group.call(gather_one, hosts, on_done)
