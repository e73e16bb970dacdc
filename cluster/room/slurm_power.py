#!/usr/bin/python3
"""The room's Slurm power programs: switch idle PCs off, wake the ones a job was given, mark down those that
do not wake. Installed by `clusterctl provision --slurm` on the controller as /usr/local/lib/clusterctl/
slurm-power (this file as it is: standard library only, Python 3.8+, nothing of clusterctl), and named in
slurm.conf under three names (links to it), since slurmctld runs each with the hostlist as its only argument:

    slurm-suspend HOSTLIST       SuspendProgram: an SSH login to each PC whose key may run only poweroff
                                 (authorized_keys: restrict,command="sudo -n /usr/sbin/poweroff")
    slurm-resume HOSTLIST        ResumeProgram: a Wake-on-LAN magic packet to each PC, from the controller
                                 onto the PC's network, or from the PC's gateway (over SSH) where the
                                 controller has no address on that network
    slurm-resume-fail HOSTLIST   ResumeFailProgram: the PCs that did not register within ResumeTimeout are
                                 marked down with the reason (`scontrol update ... state=down reason=...`)
    slurm-power wol PORT ADDRESS=MAC ...   (a gateway's forced command: send the packets from there; the
                                 arguments come in SSH_ORIGINAL_COMMAND)

slurmctld runs it as SlurmUser (Debian: slurm, no home) with no PATH, so every path is explicit: the key,
known_hosts and pcs.json (NodeName -> address, port, user, MAC, gateway) in /etc/slurm/clusterctl-power/,
readable by slurm only, and the log /var/log/slurm/clusterctl-power.log: one JSON line per PC and call,
{time, action, node, ok, detail}, which clusterctl reads for the hours each PC was off (cluster.room.power).
The hostlist is expanded by `scontrol show hostnames`, Slurm's own reading. Every wait is bounded.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

DIR = os.environ.get("CLUSTERCTL_POWER_DIR") or "/etc/slurm/clusterctl-power"
LOG = os.environ.get("CLUSTERCTL_POWER_LOG") or "/var/log/slurm/clusterctl-power.log"
KEY, KNOWN_HOSTS, PCS = (os.path.join(DIR, n) for n in ("id_ed25519", "known_hosts", "pcs.json"))
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # slurmctld gives its programs none
NAMES = {"slurm-suspend": "suspend", "slurm-resume": "resume", "slurm-resume-fail": "resume-fail"}
CONNECT_S = 10  # ssh's ConnectTimeout
SSH_S = 45  # the whole SSH login, poweroff included
SCONTROL_S = 30
WOL_PORT = 9
FORKS = 32
Result = Tuple[bool, str]


def log(action: str, node: str, ok: bool, detail: str) -> None:
    """One short JSON line per PC (a single append: lines from programs running at once do not interleave)."""
    line = json.dumps({"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "action": action, "node": node, "ok": ok, "detail": detail[-400:]}) + "\n"
    try:
        with open(LOG, "a") as f:
            f.write(line)
    except OSError as e:
        sys.stderr.write(f"slurm-power: cannot write {LOG} ({e}): {line}")


def run(argv: List[str], timeout: float, stdin: Optional[bytes] = None) -> Result:
    """(exit 0, its whole output) or (False, the tail of what it said), never waiting longer than `timeout`.
    A success is never cut: `ip addr`'s first line is loopback, and a controller with many bridges says a lot."""
    try:
        r = subprocess.run(argv, input=stdin or b"", capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"{argv[0]} gave no answer within {timeout:g} s"
    except OSError as e:
        return False, f"{argv[0]}: {e}"
    out = (r.stderr + r.stdout).decode(errors="replace").strip()
    return (True, out) if r.returncode == 0 else (False, f"exit {r.returncode}: {out[-400:]}")


def hostnames(hostlist: str) -> List[str]:
    """Slurm's hostlist (`pc[1-3,5]`) as names, by Slurm's own `scontrol show hostnames`."""
    r = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True,
                       timeout=SCONTROL_S)
    # Slurm 22.05's scontrol exits 0 on a hostlist it cannot read, saying so on stdout and stderr
    if r.returncode != 0 or r.stdout.startswith("Invalid hostlist") or not r.stdout.split():
        raise RuntimeError(f"scontrol show hostnames {hostlist}: {(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout.split()


def ssh(pc: Dict[str, Any], command: str) -> List[str]:
    """ssh as slurm, who has no home: this key and known_hosts only, the host key checked, no prompt."""
    return ["ssh", "-F", "/dev/null", "-i", KEY, "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={KNOWN_HOSTS}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={CONNECT_S}", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR", "-T", "-p", str(pc.get("port") or 22), f"{pc['user']}@{pc['address']}", command]


def suspend(name: str, pc: Dict[str, Any]) -> Result:
    """The PC's forced command powers it off (the command sent is only a label in SSH_ORIGINAL_COMMAND)."""
    return run(ssh(pc, "poweroff"), SSH_S)


def magic_packet(mac: str) -> bytes:
    """Six 0xff bytes, then the MAC sixteen times (AMD's Magic Packet; cluster/nodes/wolsend.py's layout)."""
    raw = bytes.fromhex(mac.replace(":", "").replace("-", ""))
    if len(raw) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return b"\xff" * 6 + raw * 16


def networks() -> List[ipaddress.IPv4Interface]:
    ok, out = run(["ip", "-o", "-4", "addr", "show"], 30)  # bounded; a loaded controller may be slow to answer
    parts = [line.split() for line in out.splitlines()] if ok else []
    return [ipaddress.IPv4Interface(p[3]) for p in parts if len(p) >= 4 and p[2] == "inet"]


def broadcast_for(address: str, nets: List[ipaddress.IPv4Interface]) -> Optional[Tuple[str, str]]:
    """(source, directed broadcast) of this PC's narrowest network holding `address` (wolsend's rule: never
    255.255.255.255, never through a default route); loopback counts, so that a test can receive it."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:  # a PC named, not numbered: the controller's resolver (/etc/hosts, DNS) says where
        try:
            ip = ipaddress.IPv4Address(socket.gethostbyname(address))
        except (OSError, ValueError):
            return None
    for iface in sorted(nets, key=lambda n: -n.network.prefixlen):
        if ip in iface.network and iface.network.prefixlen <= 30:
            return str(iface.ip), str(iface.network.broadcast_address)
    return None


def send(address: str, mac: str, port: int, nets: List[ipaddress.IPv4Interface]) -> Result:
    """Three copies of the packet (UDP may drop one) to the directed broadcast of the PC's network."""
    where = broadcast_for(address, nets)
    if where is None:
        return False, f"{address} is on no network of this PC ({', '.join(str(n.network) for n in nets) or 'none'})"
    source, broadcast = where
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            s.bind((source, 0))
            for _ in range(3):
                s.sendto(magic_packet(mac), (broadcast, port))
    except (OSError, ValueError) as e:
        return False, f"sending to {broadcast}:{port} failed: {e}"
    return True, f"magic packet for {mac} sent from {source} to {broadcast}:{port}"


def resume(name: str, pc: Dict[str, Any], port: int, nets: List[ipaddress.IPv4Interface]) -> Result:
    """From the controller where it has an address on the PC's network, else from the PC's gateway."""
    if not pc.get("mac"):
        return False, "pcs.json has no MAC for it (provision --slurm records what `clusterctl check` found)"
    if broadcast_for(pc["address"], nets) is not None or not pc.get("gateway"):
        return send(pc["address"], pc["mac"], port, nets)
    gw = pc["gateway"]
    ok, out = run(ssh(gw, f"wol {port} {pc['address']}={pc['mac']}"), SSH_S)
    return ok, f"from the gateway {gw['address']}: {out}"


def wol_here(words: List[str]) -> int:
    """The gateway's side: `wol PORT ADDRESS=MAC ...` (from SSH_ORIGINAL_COMMAND under a forced command)."""
    if len(words) < 2 or not words[0].isdigit():
        sys.stderr.write("usage: slurm-power wol PORT ADDRESS=MAC ...\n")
        return 2
    nets, failed = networks(), 0
    for pair in words[1:]:
        address, _, mac = pair.partition("=")
        ok, detail = send(address, mac, int(words[0]), nets)
        print(detail)
        failed += not ok
    return 1 if failed else 0


def main(argv: List[str]) -> int:
    os.environ["PATH"] = os.environ.get("PATH") or PATH
    prog = os.path.basename(argv[0])
    action, args = (NAMES[prog], argv[1:]) if prog in NAMES else (argv[1] if len(argv) > 1 else "", argv[2:])
    if action == "wol":
        return wol_here(os.environ.get("SSH_ORIGINAL_COMMAND", "").split()[1:] or args)
    if action not in NAMES.values() or len(args) != 1:
        sys.stderr.write(f"usage: {prog} {{suspend|resume|resume-fail|wol}} HOSTLIST (or as slurm-suspend ...)\n")
        return 2
    try:
        names = hostnames(args[0])
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        log(action, args[0], False, f"cannot expand the hostlist: {e}")
        return 1
    try:
        with open(PCS) as f:
            doc = json.load(f)
        pcs, port = doc["nodes"], int(doc.get("wol_port") or WOL_PORT)
    except (OSError, ValueError, KeyError, TypeError) as e:
        for n in names:
            log(action, n, False, f"cannot read {PCS}: {e}")
        return 1
    results: Dict[str, Result] = {n: (False, f"{n} is not in {PCS}: provision --slurm again") for n in names
                                  if n not in pcs}
    known = [n for n in names if n in pcs]
    if action == "resume-fail":
        reason = "clusterctl-power: no answer within ResumeTimeout after Wake-on-LAN (see " + LOG + ")"
        ok, out = run(["scontrol", "update", f"nodename={','.join(names)}", "state=down", f"reason={reason}"],
                      SCONTROL_S)
        results = {n: (ok, f"marked down: {reason}" if ok else f"scontrol update failed: {out}") for n in names}
    elif action == "resume":
        nets = networks()
        results.update({n: resume(n, pcs[n], port, nets) for n in known})
    elif known:
        with ThreadPoolExecutor(max_workers=min(FORKS, len(known))) as pool:
            results.update(zip(known, pool.map(lambda n: suspend(n, pcs[n]), known)))
    for n in names:
        log(action, n, *results[n])
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
