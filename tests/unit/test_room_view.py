"""`clusterctl room`: the room's queue and PCs as the controller's squeue and sinfo print them (recorded in
tests/fixtures/room/), and the state suffixes sinfo adds (a PC not responding, powered off)."""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

from cluster.room import view
from tests.conftest import FIXTURES, ROOT

F = FIXTURES / "room"


def test_every_users_jobs_with_their_pcs_since_and_limit() -> None:
    jobs = view.parse_jobs((F / "squeue.txt").read_text())
    assert [(j.job_id, j.user, j.state, j.pcs, j.time_limit, j.reason) for j in jobs] == [
        ("3", "root", "PENDING", "", "UNLIMITED", "Resources"),
        ("2", "root", "RUNNING", "node[1-2]", "1:00:00", "None")]
    assert jobs[1].name == "resnet50-ddp-20261207-183000-aaaa" and jobs[1].since == "2026-12-07T18:36:17"


def test_each_pcs_state_and_what_its_suffix_says() -> None:
    pcs = view.parse_pcs((F / "sinfo.txt").read_text())
    assert [(p.name, p.state, p.notes) for p in pcs] == [("node1", "allocated", ()), ("node2", "allocated", ()),
                                                          ("node3", "drained", ())]
    # sinfo's own `down*` (tests/fixtures/slurm/sinfo_node_down.txt) and the power-saving `idle~`
    down = (FIXTURES / "slurm" / "sinfo_node_down.txt").read_text().splitlines()[1].split()
    assert view.parse_pcs(f"{down[0]}|{down[2]}\nnode9|idle~\n") == [
        view.Pc("node2", "down", ("not responding",)), view.Pc("node9", "idle", ("powered off",))]


def test_the_command_asks_the_rooms_partition_only_then_reads_the_power_log() -> None:
    assert view.command("room") == ("squeue -h -p room -o '%i|%u|%j|%T|%N|%S|%l|%r' && echo @@pcs && "
                                    "sinfo -h -N -p room -o '%N|%T'; rc=$?; echo @@power; "
                                    "tail -n 20000 /var/log/slurm/clusterctl-power.log 2>/dev/null; exit $rc")


def test_hours_off_and_energy_saved_over_the_last_hours_from_the_power_log() -> None:
    """The power program's lines (cluster/room/slurm_power.py's format): node2 off from 2 h ago to 1 h ago,
    node3 off since 30 minutes ago; node1 never."""
    from cluster.cli.room import power_saved

    now = dt.datetime.now(dt.timezone.utc)

    def line(minutes_ago: float, action: str, node: str) -> str:
        t = (now - dt.timedelta(minutes=minutes_ago)).isoformat(timespec="seconds")
        return json.dumps({"time": t, "action": action, "node": node, "ok": True, "detail": ""})

    seen = view.RoomView("room", [], [view.Pc(n, "idle") for n in ("node1", "node2", "node3")],
                         [line(120, "suspend", "node2"), line(60, "resume", "node2"), line(30, "suspend", "node3")])
    got = {r["node"]: r for r in power_saved(seen, 24)["pcs"]}
    assert got["node1"]["hours"] == 0 and abs(got["node2"]["hours"] - 1.0) < 0.01
    assert abs(got["node3"]["hours"] - 0.5) < 0.01 and abs(got["node2"]["kwh_saved"] - 0.04) < 0.001  # 40 W
    assert got["node2"]["idle_w_source"] == "estimate"
    assert power_saved(view.RoomView("room", [], seen.pcs), 24) is None  # no power saving: nothing said


def test_runs_all_on_an_inventory_without_a_room_lists_ones_runs_and_says_so(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "cluster", "runs", "--all", "--json", "-i", "inventory/local.yaml"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={**os.environ, "CLUSTERCTL_HOME": str(tmp_path)})
    assert r.returncode == 0 and json.loads(r.stdout) == {"runs": [], "rooms": {}}, r.stdout + r.stderr
    assert "declares no room: only this head's runs are shown" in " ".join(r.stderr.split())
