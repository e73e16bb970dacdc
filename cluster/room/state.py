"""What a PC of the room has now, read in one command (pyinfra's fact: a command and its parser): the files
provision --slurm manages (by sha256; the munge key's content is never read back), the units, the packages,
whether its apt index knows Slurm, and the nodes its slurm.conf names (a PC removed from the room)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from cluster.inventory.model import Host

ETC = "/etc/slurm"
CONF_FILES = ("slurm.conf", "cgroup.conf", "gres.conf")
KEY = "/etc/munge/munge.key"
UNITS = ("munge", "slurmd", "slurmctld")
PACKAGES = ("munge", "slurmd", "slurmctld", "slurm-client")
MARK = "@@room"
NFT = 'env PATH="$PATH:/usr/sbin:/sbin" nft'  # /usr/sbin is on no ordinary user's PATH
FW_TAG = "clusterctl room"  # the comment of the rules provision --slurm inserts (then the room's name)
# Power saving (cluster.room.power): the program on the controller, its key, known_hosts and pcs.json (SlurmUser's
# only), each PC's sudoers line for poweroff alone and its login user's authorized_keys entry (tagged).
POWER_BIN = "/usr/local/lib/clusterctl"
POWER_DIR = "/etc/slurm/clusterctl-power"
POWER_FILES = (f"{POWER_BIN}/slurm-power", *(f"{POWER_DIR}/{n}" for n in ("id_ed25519", "known_hosts", "pcs.json")),
               "/etc/sudoers.d/clusterctl-power")
AUTH_TAG = "clusterctl-power"


def root(h: Host) -> str:
    """The prefix that makes a command root's on `h` (sudo -n with become; never a password)."""
    return "sudo -n " if h.become and h.user != "root" else ""


def as_root(h: Host, script: str) -> str:
    """`script` run by a root shell on `h`, whatever its login shell."""
    return f"{root(h)}sh -c {shlex.quote(script)}"


PROBE_SCRIPT = (
    f'for f in {" ".join(f"{ETC}/{n}" for n in CONF_FILES)} {KEY} {" ".join(POWER_FILES)}; do '
    f'if [ -f "$f" ]; then echo "{MARK} file $f $(sha256sum < "$f" | cut -d" " -f1)"; '
    f'else echo "{MARK} file $f -"; fi; done; '
    f'for u in {" ".join(UNITS)}; do a=$(systemctl is-active "$u" 2>/dev/null); '
    f'e=$(systemctl is-enabled "$u" 2>/dev/null); echo "{MARK} unit $u ${{a:-unknown}} ${{e:-unknown}}"; done; '
    f"dpkg-query -W -f '{MARK} pkg ${{Package}} ${{db:Status-Abbrev}}\\n' {' '.join(PACKAGES)} 2>/dev/null; "
    f'echo "{MARK} candidate $(apt-cache policy slurmd 2>/dev/null | sed -n "s/ *Candidate: *//p")"; '
    f'[ -f {ETC}/slurm.conf ] && sed -n "s/^NodeName=\\([^ ]*\\).*/{MARK} node \\1/p" {ETC}/slurm.conf; '
    f'echo "{MARK} fw $({NFT} -a list ruleset 2>/dev/null | grep -c \'comment "{FW_TAG}\')"; true'
)


@dataclass
class PcState:
    digests: dict[str, str | None] = field(default_factory=dict)  # path -> sha256, None: absent
    active: dict[str, bool] = field(default_factory=dict)
    enabled: dict[str, bool] = field(default_factory=dict)
    installed: set[str] = field(default_factory=set)
    candidate: str | None = None  # slurmd's version in the PC's apt index (None: no index knows it)
    conf_nodes: list[str] = field(default_factory=list)
    fw_rules: int = 0  # firewall rules provision --slurm inserted (tagged FW_TAG)
    authorized: str | None = None  # sha256 of the login user's authorized_keys lines tagged AUTH_TAG (None: none)

    def to_dict(self) -> dict[str, Any]:
        return {"digests": self.digests, "active": self.active, "enabled": self.enabled,
                "installed": sorted(self.installed), "candidate": self.candidate, "conf_nodes": self.conf_nodes, "fw_rules": self.fw_rules,
                "authorized": self.authorized}


# the login user's authorized_keys lines of the power key, read as that user (the file is theirs, ~ their home)
AUTHORIZED_PROBE = (f"f=~/.ssh/authorized_keys; if grep -sqF {shlex.quote(AUTH_TAG)} \"$f\"; then echo \"{MARK} "
                    f"authorized $(grep -F {shlex.quote(AUTH_TAG)} \"$f\" | sha256sum | cut -d' ' -f1)\"; fi; true")


def probe_command(h: Host) -> str:
    return f"{as_root(h, PROBE_SCRIPT)} && {{ {AUTHORIZED_PROBE}; }}"  # a refused sudo still fails the probe


def parse(out: str) -> PcState:
    s = PcState()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0] != MARK:
            continue
        kind, rest = parts[1], parts[2:]
        if kind == "file" and len(rest) == 2:
            s.digests[rest[0]] = None if rest[1] == "-" else rest[1]
        elif kind == "unit" and rest:
            s.active[rest[0]] = len(rest) > 1 and rest[1] == "active"
            s.enabled[rest[0]] = len(rest) > 2 and rest[2] == "enabled"
        elif kind == "pkg" and len(rest) == 2 and rest[1] == "ii":
            s.installed.add(rest[0])
        elif kind == "candidate":
            s.candidate = rest[0] if rest and re.match(r"\d", rest[0]) else None
        elif kind == "fw" and rest and rest[0].isdigit():
            s.fw_rules = int(rest[0])
        elif kind == "authorized" and rest:
            s.authorized = rest[0]
        elif kind == "node" and rest:
            s.conf_nodes.extend(n for n in rest[0].split(",") if n)
    return s
