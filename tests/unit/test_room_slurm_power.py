"""The room's Slurm power program (cluster/room/slurm_power.py), run for real as slurmctld runs it: a subprocess
under its slurm.conf names, with the hostlist as its only argument, expanded by the real `scontrol show
hostnames` (with the room's rendered slurm.conf); its PCs on loopback: a closed port (a PC that is off), a real
sshd whose key runs a forced command (a harmless stand-in for the PC's `sudo -n /usr/sbin/poweroff`), and a UDP
socket the test opens, which receives the real magic packet."""
from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from cluster.nodes import wolsend
from cluster.room import slurm_power

PROGRAM = Path(slurm_power.__file__)
SLURM_CONF = Path(__file__).parents[1] / "golden" / "room" / "power-saving" / "slurm.conf"  # pc1, pc2, pc3
MAC = "02:00:00:00:00:0b"
needs_scontrol = pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol is not installed")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket is closed


@pytest.fixture()
def room(tmp_path: Path) -> dict[str, Any]:
    """The program under its three names (links, as provision installs them), its folder and log."""
    bin_dir, conf = tmp_path / "bin", tmp_path / "clusterctl-power"
    bin_dir.mkdir()
    conf.mkdir()
    shutil.copy(PROGRAM, bin_dir / "slurm-power")
    for name in ("slurm-suspend", "slurm-resume", "slurm-resume-fail"):
        (bin_dir / name).symlink_to("slurm-power")
    return {"bin": bin_dir, "dir": conf, "log": tmp_path / "power.log"}


def write_pcs(room: dict[str, Any], nodes: dict[str, Any], wol_port: int = 9) -> None:
    (room["dir"] / "pcs.json").write_text(json.dumps({"wol_port": wol_port, "nodes": nodes}))


def call(room: dict[str, Any], name: str, hostlist: str, path: str | None = None,
         extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """As slurmctld runs it: by path, one argument, an environment of SLURM_CONF alone (no PATH) besides the
    test's folders (and `path` where the test gives one)."""
    env = {"SLURM_CONF": str(SLURM_CONF), "CLUSTERCTL_POWER_DIR": str(room["dir"]),
           "CLUSTERCTL_POWER_LOG": str(room["log"]), **({"PATH": path} if path else {}), **(extra or {})}
    r = subprocess.run([str(room["bin"] / name), hostlist], env=env, capture_output=True, text=True, timeout=120)
    lines = [json.loads(x) for x in room["log"].read_text().splitlines()] if room["log"].exists() else []
    return r, lines


def test_standalone_stdlib_python38() -> None:
    """Installed on the controller as it is: nothing of clusterctl, only the standard library, Python 3.8's syntax."""
    tree = ast.parse(PROGRAM.read_text(), feature_version=(3, 8))
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= set(sys.stdlib_module_names), mods - set(sys.stdlib_module_names)
    assert PROGRAM.read_text().startswith("#!/usr/bin/python3\n")
    assert slurm_power.magic_packet(MAC) == wolsend.magic_packet(MAC)  # the same packet as `clusterctl wake`


@needs_scontrol
def test_suspend_of_a_pc_that_does_not_answer_is_logged_as_failed_within_its_bound(room: dict[str, Any]) -> None:
    write_pcs(room, {"pc1": {"address": "127.0.0.1", "port": closed_port(), "user": "student", "mac": MAC}})
    t0 = time.monotonic()
    r, lines = call(room, "slurm-suspend", "pc[1-2]")
    assert r.returncode == 1 and time.monotonic() - t0 < 30
    assert [(x["action"], x["node"], x["ok"]) for x in lines] == [("suspend", "pc1", False), ("suspend", "pc2", False)]
    assert "Connection refused" in lines[0]["detail"] and "exit 255" in lines[0]["detail"]
    assert "pc2 is not in" in lines[1]["detail"] and "pcs.json" in lines[1]["detail"]
    assert lines[0]["time"].endswith("+00:00")


@pytest.fixture()
def sshd(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A real sshd on loopback: the key's authorized_keys entry is `restrict,command="..."` as on a PC, its
    command a harmless marker (the PC's is `sudo -n /usr/sbin/poweroff`); known_hosts holds its host key."""
    if os.geteuid() != 0 or not Path("/usr/sbin/sshd").exists():
        pytest.skip("needs root and OpenSSH's sshd")
    d = tmp_path / "sshd"
    d.mkdir()
    for key in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    marker = d / "powered-off"
    (d / "authorized_keys").write_text(f'restrict,command="echo $SSH_ORIGINAL_COMMAND >> {marker}" '
                                       + (d / "client.pub").read_text())
    port = closed_port()
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", "/dev/null", "-h", str(d / "host"),
                             "-o", f"ListenAddress=127.0.0.1:{port}", "-o", f"AuthorizedKeysFile={d / 'authorized_keys'}",
                             "-o", "StrictModes=no", "-o", "PermitRootLogin=prohibit-password", "-o", "UsePAM=no",
                             "-o", "PidFile=none"], stderr=subprocess.PIPE)
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    host_pub = (d / "host.pub").read_text().split()
    try:
        yield {"port": port, "dir": d, "marker": marker, "known_hosts": f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@needs_scontrol
def test_suspend_logs_in_with_its_own_key_and_known_hosts_and_runs_only_the_forced_command(
        room: dict[str, Any], sshd: dict[str, Any]) -> None:
    shutil.copy(sshd["dir"] / "client", room["dir"] / "id_ed25519")
    (room["dir"] / "id_ed25519").chmod(0o600)
    (room["dir"] / "known_hosts").write_text(sshd["known_hosts"])
    pc = {"address": "127.0.0.1", "port": sshd["port"], "user": "root", "mac": MAC}
    write_pcs(room, {"pc1": pc, "pc3": pc})
    r, lines = call(room, "slurm-suspend", "pc[1,3]")
    assert r.returncode == 0, lines
    assert [(x["node"], x["ok"]) for x in lines] == [("pc1", True), ("pc3", True)]
    assert sshd["marker"].read_text() == "poweroff\npoweroff\n"  # the forced command ran, once per PC
    # a host key that is not the known one: refused (StrictHostKeyChecking=yes), logged, nothing ran
    (room["dir"] / "known_hosts").write_text(sshd["known_hosts"].replace("[127.0.0.1]", "[127.0.0.2]"))
    r, lines = call(room, "slurm-suspend", "pc1")
    assert r.returncode == 1 and not lines[-1]["ok"] and "Host key verification failed" in lines[-1]["detail"]
    assert sshd["marker"].read_text() == "poweroff\npoweroff\n"


@needs_scontrol
def test_resume_sends_the_magic_packet_onto_the_pcs_network(room: dict[str, Any]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        rx.bind(("0.0.0.0", 0))
        rx.settimeout(10)
        port = rx.getsockname()[1]
        write_pcs(room, {"pc2": {"address": "127.0.0.1", "port": 22, "user": "student", "mac": MAC},
                         "pc3": {"address": "127.0.0.1", "port": 22, "user": "student"}}, wol_port=port)
        r, lines = call(room, "slurm-resume", "pc[2-3]")
        try:
            packet, _ = rx.recvfrom(1024)
        except TimeoutError:
            raise AssertionError(f"no packet; the program said: {lines} {r.stdout} {r.stderr}") from None
    assert packet == wolsend.magic_packet(MAC)
    assert [(x["action"], x["node"], x["ok"]) for x in lines] == [("resume", "pc2", True), ("resume", "pc3", False)]
    assert f"to 127.255.255.255:{port}" in lines[0]["detail"]
    assert "no MAC" in lines[1]["detail"] and r.returncode == 1


def test_a_gateway_sends_the_packet_from_its_forced_command(room: dict[str, Any]) -> None:
    """On a gateway the key's forced command is `slurm-power wol`; its words come in SSH_ORIGINAL_COMMAND."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        rx.bind(("0.0.0.0", 0))
        rx.settimeout(10)
        port = rx.getsockname()[1]
        r = subprocess.run([str(room["bin"] / "slurm-power"), "wol"], capture_output=True, text=True, timeout=60,
                           env={"SSH_ORIGINAL_COMMAND": f"wol {port} 127.0.0.1={MAC}"})
        try:
            assert rx.recvfrom(1024)[0] == wolsend.magic_packet(MAC)
        except TimeoutError:
            raise AssertionError(f"no packet; the program said: {r.stdout} {r.stderr}") from None
    assert r.returncode == 0 and f"127.255.255.255:{port}" in r.stdout


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare")
def test_a_controller_with_many_networks_still_finds_loopback(room: dict[str, Any]) -> None:
    """A controller beside a lab has many bridges: `ip addr`'s whole answer is read, loopback (its first line)
    too. Run in a network namespace of its own with forty veth pairs (a lab's bridges); this machine's stay."""
    receive = ("import socket; r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); r.bind(('0.0.0.0', 40009)); "
               "r.settimeout(10); print(r.recv(200).hex())")
    script = "\n".join(["set -e", "ip link set lo up"]
                       + [f"ip link add a{i} type veth peer name b{i}; ip addr add 10.77.{i}.1/24 dev a{i}"
                          for i in range(40)]
                       + [f'python3 -c "{receive}" > "$1" &', "sleep 1",
                          f'SSH_ORIGINAL_COMMAND="wol 40009 127.0.0.1={MAC}" "$2" wol', "wait"])
    got = room["dir"] / "received"
    r = subprocess.run(["unshare", "--net", "bash", "-c", script, "netns", str(got), str(room["bin"] / "slurm-power")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert bytes.fromhex(got.read_text().strip()) == wolsend.magic_packet(MAC), r.stdout + r.stderr
    assert "127.255.255.255:40009" in r.stdout


@needs_scontrol
def test_resume_fail_marks_the_pcs_down_with_the_reason(room: dict[str, Any], tmp_path: Path) -> None:
    """No slurmctld runs in unit tests, so `scontrol update` would fail to reach one: a PATH shim records that
    call ONLY; `scontrol show hostnames` goes on to the real scontrol."""
    shim, calls = tmp_path / "shim", tmp_path / "calls"
    shim.mkdir()
    real = shutil.which("scontrol")
    (shim / "scontrol").write_text(f'#!/bin/sh\nif [ "$1" = update ]; then printf "%s|" "$@" >> {calls}; exit 0; fi\n'
                                   f'exec {real} "$@"\n')
    (shim / "scontrol").chmod(0o755)
    write_pcs(room, {"pc1": {"address": "127.0.0.1", "user": "student", "mac": MAC}})
    r, lines = call(room, "slurm-resume-fail", "pc[1-2]", path=f"{shim}:/usr/bin:/bin")
    assert r.returncode == 0, r.stderr
    args = calls.read_text().split("|")
    assert args[:3] == ["update", "nodename=pc1,pc2", "state=down"]
    assert args[3].startswith("reason=clusterctl-power: no answer within ResumeTimeout after Wake-on-LAN")
    assert [(x["action"], x["node"], x["ok"]) for x in lines] == [("resume-fail", "pc1", True),
                                                                  ("resume-fail", "pc2", True)]
    assert lines[0]["detail"].startswith("marked down: clusterctl-power: no answer")


@needs_scontrol
def test_a_hostlist_slurm_cannot_read_or_a_missing_pcs_json_is_logged(room: dict[str, Any]) -> None:
    # (Slurm 22.05's scontrol exits 0 here, printing "Invalid hostlist")
    r, lines = call(room, "slurm-resume", "pc[2-1]")
    assert r.returncode == 1 and lines[-1]["node"] == "pc[2-1]" and "Invalid hostlist" in lines[-1]["detail"]
    r, lines = call(room, "slurm-suspend", "pc1")
    assert r.returncode == 1 and lines[-1]["node"] == "pc1" and "cannot read" in lines[-1]["detail"]
