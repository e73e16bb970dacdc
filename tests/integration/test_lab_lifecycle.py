"""`clusterctl lab up/down/status` as a user runs them: idempotent, reclaims leftovers, leaves nothing."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.integration.conftest import clusterctl, clusterctl_json, lab_name, lab_subnet, pytestmark  # noqa: F401


def _leftovers(name: str, d: Path) -> dict[str, list[str]]:
    netns = [ln.split()[0] for ln in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
             .stdout.splitlines() if ln.startswith(f"{name}-")]
    links = [ln.split(":")[1].strip().split("@")[0] for ln in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
        if ln.split(":")[1].strip().startswith(f"{name}-")]
    mounts = [ln for ln in Path("/proc/mounts").read_text().splitlines() if f"/run/netns/{name}-" in ln]
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "sshd" in cmd and str(d) in cmd:
            procs.append(cmd)
    return {k: v for k, v in {"netns": netns, "links": links, "mounts": mounts, "procs": procs}.items() if v}


def _up(tmp_path: Path, tag: str, offset: int, *flags: str) -> tuple[str, Path, dict[str, str], int, Any]:
    """`lab up 2` of a lab of this test's own (name, subnet, directory, CLUSTERCTL_HOME): its exit code and JSON."""
    name, d = lab_name(tag), tmp_path / "lab"
    env = {"CLUSTERCTL_HOME": str(tmp_path / "home")}
    rc, up = clusterctl_json("lab", "up", "2", "--name", name, "--subnet", lab_subnet(offset), "--dir", str(d),
                             *flags, env=env)
    return name, d, env, rc, up


def test_up_status_down_leaves_nothing(tmp_path: Path) -> None:
    name, d, env, rc, up = _up(tmp_path, "b", 1, "--bandwidth", "1gbit")
    try:
        assert rc == 0 and [n["name"] for n in up["nodes"]] == ["node1", "node2"]
        # the lab became the current context: exec needs no inventory
        rc, ex = clusterctl_json("exec", "--", "hostname", env=env)
        assert rc == 0 and [n["stdout"].strip() for n in ex["nodes"]] == ["node1", "node2"]
        # links are shaped like 1 GbE on both sides
        tc = subprocess.run(["tc", "qdisc", "show", "dev", f"{name}-v1"], capture_output=True, text=True).stdout
        assert "tbf" in tc and "rate 1Gbit" in tc
        rc, st = clusterctl_json("lab", "status", "--name", name, "--dir", str(d), env=env)
        assert rc == 0 and all(n["sshd"] and n["port_open"] and n["netns"] for n in st["nodes"])
        (tmp_path / "home" / "labs").mkdir(parents=True, exist_ok=True)  # its directory as the default place
        (tmp_path / "home" / "labs" / name).symlink_to(d)
        rc, every = clusterctl_json("lab", "status", "--all", env=env)
        mine = [lab for lab in every["labs"] if lab["name"] == name]
        assert rc == 0 and [lab["state"] for lab in mine] == [str(tmp_path / "home" / "labs" / name / "lab.json")]
        assert {f"netns {name}-n1", f"netns {name}-n2", f"link {name}-br"} <= set(mine[0]["pieces"])
        # up again on a running lab: reclaims its own pieces, ends with the same healthy lab
        rc, _ = clusterctl_json("lab", "up", "2", "--name", name, "--subnet", lab_subnet(1), "--dir", str(d), env=env)
        assert rc == 0
        assert len(_leftovers(name, d)["netns"]) == 2 and len(_leftovers(name, d)["procs"]) == 2
    finally:
        rc, down = clusterctl_json("lab", "down", "--name", name, "--dir", str(d), env=env)
    assert rc == 0 and any(r.startswith("netns") for r in down["removed"])
    assert _leftovers(name, d) == {}
    # down again: nothing to do, still fine; the context no longer points at the gone lab
    assert clusterctl("lab", "down", "--name", name, "--dir", str(d), env=env).returncode == 0
    rc, ctx = clusterctl_json("context", env=env)
    assert ctx["inventory"] is None
    rc, st = clusterctl_json("lab", "status", "--name", name, "--dir", str(d), env=env)
    assert rc == 1 and st["up"] is False and st["leftovers"] == []
    assert (d / "node1" / "srv").is_dir()  # the nodes' files stay for the next `up` ...
    assert clusterctl("lab", "down", "--name", name, "--dir", str(d), "--purge", env=env).returncode == 0
    assert not d.exists()  # ... unless purged


def test_up_reclaims_what_a_crashed_run_left_behind(tmp_path: Path) -> None:
    name, d = lab_name("c"), tmp_path / "lab"
    env = {"CLUSTERCTL_HOME": str(tmp_path / "home")}
    assert clusterctl("lab", "up", "2", "--name", name, "--subnet", lab_subnet(2), "--dir", str(d), env=env).returncode == 0
    # a crash: the state file is lost and one sshd is killed hard; namespaces and links stay
    (d / "lab.json").unlink()
    os.kill(int((d / "node1" / "sshd.pid").read_text()), signal.SIGKILL)
    try:
        # status finds no state but says what is left, and what removes it
        rc, st = clusterctl_json("lab", "status", "--name", name, "--dir", str(d), env=env)
        assert rc == 1 and st["up"] is False
        assert {f"netns {name}-n1", f"netns {name}-n2", f"link {name}-br"} <= set(st["leftovers"])
        r = clusterctl("lab", "status", "--name", name, "--dir", str(d), env=env)
        assert r.returncode == 1 and f"clusterctl lab down --name {name}" in r.stdout
        # a listing of every lab on the machine finds it by its pieces, with no state in the default place
        rc, every = clusterctl_json("lab", "status", "--all", env=env)
        mine = [lab for lab in every["labs"] if lab["name"] == name]
        assert rc == 0 and len(mine) == 1 and mine[0]["state"] is None
        assert set(mine[0]["pieces"]) == set(st["leftovers"])
        r = clusterctl("lab", "status", "--all", env=env)
        assert r.returncode == 0 and name in r.stdout and "none in the default place" in r.stdout
        r = clusterctl("lab", "up", "2", "--name", name, "--subnet", lab_subnet(2), "--dir", str(d), env=env)
        assert r.returncode == 0, r.stderr
        rc, ex = clusterctl_json("exec", "--", "hostname", env=env)
        assert rc == 0 and len(ex["nodes"]) == 2
    finally:
        clusterctl("lab", "down", "--name", name, "--dir", str(d), env=env)
    assert _leftovers(name, d) == {}
    assert name not in [lab["name"] for lab in clusterctl_json("lab", "status", "--all", env=env)[1]["labs"]]


def test_bad_arguments_are_refused_clearly(tmp_path: Path) -> None:
    r = clusterctl("lab", "up", "2", "--name", "Bad_Name")
    assert r.returncode == 2 and "lowercase" in r.stderr
    r = clusterctl("lab", "up", "300", "--name", "x", "--subnet", "10.9.9.0/24")
    assert r.returncode == 2 and "cannot fit 300 nodes" in r.stderr


def test_cpu_quota_makes_nodes_slower_for_real_and_goes_with_the_lab(tmp_path: Path) -> None:
    """--cpu-quota: each node pinned to one core with a share of it (a cgroup), seen by what runs there."""
    name, d, env, rc, up = _up(tmp_path, "q", 7, "--cpu-quota", "1,0.25")
    try:
        assert rc == 0, up
        probe = ("python3 -c 'import os, time; t, w = time.process_time(), time.time()\n"
                 "while time.time() - w < 2: pass\n"
                 "print(len(os.sched_getaffinity(0)), round((time.process_time() - t) / 2, 2))'")
        rc, ex = clusterctl_json("exec", "--", probe, env=env)
        assert rc == 0, ex
        (cores1, share1), (cores2, share2) = [tuple(map(float, n["stdout"].split())) for n in ex["nodes"]]
        assert cores1 == cores2 == 1  # pinned: one core each
        # node2 gets at most a quarter of its core; node1 more (how much more depends on what else runs on its
        # core: 0.39 was seen with the rest of the suite beside it, so only "more" is asserted)
        assert share2 <= 0.3 and share1 > share2, (share1, share2)
        assert len(_cgroups(name)) == 2
    finally:
        rc, down = clusterctl_json("lab", "down", "--name", name, "--dir", str(d), env=env)
    assert rc == 0 and sum(x.startswith("cgroup ") for x in down["removed"]) == 2
    assert not _cgroups(name)


def _cgroups(name: str) -> list[Path]:
    return [p for base in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")) if base.exists()
            for p in base.glob(f"clusterctl-{name}-node*")]
