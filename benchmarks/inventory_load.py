"""Loading a 200-host Ansible inventory through ansible-core: cold (Ansible reads it) and cached.

The inventory is generated as a lab admin would write it: an INI file with groups, ranges, group vars
in `[group:vars]`, a group_vars/ directory and templated values. Nothing is contacted.
Target (issue 12): under 2 s cold on this machine; the cached load is what every later command pays.

    .venv/bin/python -m benchmarks.inventory_load [--hosts 200] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from cluster.inventory import ansible_core, loader


def write_inventory(d: Path, hosts: int) -> Path:
    """An INI inventory of `hosts` PCs in rooms of 25, with group_vars/ and Jinja in the vars."""
    rooms = max(1, (hosts + 24) // 25)
    lines: list[str] = []
    made = 0
    for r in range(rooms):
        n = min(25, hosts - made)
        lines += [f"[room{r}]", f"pc{r:02d}-[01:{n:02d}] ansible_host_suffix={r}", ""]
        lines += [f"[room{r}:vars]", f"room_net=10.99.{r}", "ansible_port=22", ""]
        made += n
    lines += ["[lab:children]"] + [f"room{r}" for r in range(rooms)] + [""]
    src = d / "hosts.ini"
    src.write_text("\n".join(lines))
    (d / "group_vars").mkdir()
    (d / "group_vars" / "all.yml").write_text(
        "ansible_user: student\n"
        "ansible_ssh_private_key_file: ~/.ssh/lab_ed25519\n"
        "ansible_host: \"{{ room_net }}.{{ inventory_hostname[-2:] | int + 10 }}\"\n"
        "ansible_python_interpreter: auto_silent\n"
        "clusterctl_workdir: /srv/cluster\n")
    return src


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not ansible_core.available():
        print("ansible-core is not installed: pip install 'clusterctl[ansible]'")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CLUSTERCTL_HOME"] = str(Path(tmp) / "home")  # a cache of its own
        inv_dir = Path(tmp) / "inv"
        inv_dir.mkdir()
        src = write_inventory(inv_dir, args.hosts)
        cold, cached = [], []
        for _ in range(args.repeats):
            for f in (Path(tmp) / "home").glob("cache/ansible/*.json"):
                f.unlink()
            cold.append(timed(lambda: loader.load(src, check_files=False, reader="ansible")))
            cached.append(timed(lambda: loader.load(src, check_files=False, reader="ansible")))
        inv = loader.load(src, check_files=False, reader="ansible")
        assert len(inv.hosts) == args.hosts, len(inv.hosts)
        first = next(iter(inv.hosts.values()))
        print(f"{args.hosts} hosts, {args.repeats} repeats; first host: {first.name} {first.user}@{first.address}"
              f":{first.port} ({len(inv.groups)} groups)")
        print(f"{'load':<28}{'median s':>10}{'min s':>10}{'max s':>10}")
        for label, xs in (("cold (ansible-core reads)", cold), ("cached (source unchanged)", cached)):
            print(f"{label:<28}{statistics.median(xs):>10.3f}{min(xs):>10.3f}{max(xs):>10.3f}")
        verdict = "meets" if statistics.median(cold) < 2.0 else "MISSES"
        print(f"target < 2 s cold: {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
