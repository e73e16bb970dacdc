"""`collect`, `report` and `study` on a real 2-node lab after tiny DDP and TF runs."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.lab import sshd
from tests.conftest import ROOT
from tests.integration.conftest import clusterctl, clusterctl_json, provisioned_lab, pytestmark  # noqa: F401

# batch 8: what is tested is the same at any batch, and ResNet50 steps at 32 on one thread cost minutes in CI
TINY = ["--set", "epochs=2", "--set", "threads=1", "--set", "max_steps=4", "--set", "log_every=1", "--set", "batch=8"]


@pytest.fixture(scope="module")
def clab(tmp_path_factory: pytest.TempPathFactory):
    """Two nodes on 200 Mbit links (so a large transfer can be interrupted), both jobs run once."""
    lab_gen = provisioned_lab(tmp_path_factory, "c", 2, 6, bandwidth="200mbit")
    state, env = next(lab_gen)
    try:
        ids = {}
        for job in ("resnet50-ddp", "resnet50-tf"):
            rc, rec = clusterctl_json("launch", job, *TINY, env=env, timeout=900)
            assert rc == 0, json.dumps(rec)[-2000:]
            ids[job] = rec["run_id"]
        yield state, env, ids, Path(env["CLUSTERCTL_HOME"])
    finally:
        lab_gen.close()  # the lab goes, whatever happened above


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def node_files(state, i: int, run_id: str, checkpoints: bool = False) -> dict[str, str]:
    """The node's run folder as collect should bring it: all but the checkpoints (unless asked) and the
    program files launch shipped, unchanged (the head has them: .shipped-program.json lists them)."""
    root = Path(state.nodes[i].dir) / "srv" / "runs" / run_id
    shipped = {f"program/{k}": v for k, v in json.loads((root / ".shipped-program.json").read_text()).items()}
    return {rel: digest for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts and (checkpoints or not any(
                part.startswith(("checkpoint", ".checkpoint-worker")) for part in p.relative_to(root).parts))
            and shipped.get(rel := p.relative_to(root).as_posix()) != (digest := sha(p))}


def test_collect_brings_everything_then_nothing_new(clab) -> None:
    state, env, ids, home = clab
    for job, run_id in ids.items():
        rc, res = clusterctl_json("collect", run_id, env=env, timeout=600)
        assert rc == 0, res
        for i, n in enumerate(state.nodes):
            got = home / "runs" / run_id / n.name
            want = node_files(state, i, run_id)
            assert want and {k: sha(got / k) for k in want} == want  # every file, byte for byte
            assert not (got / "program").exists()  # the built-in program: shipped, left on the node
            assert (got / "facts.json").exists() and (got / "provision-state.json").exists()
            assert not list(got.rglob("*.part"))
            left = {x["path"]: x["size"] for x in res["nodes"][i]["large"]}  # named, with their real size
            on_node = Path(state.nodes[i].dir) / "srv" / "runs" / run_id
            assert left and all(path.startswith("out/checkpoint") for path in left), left
            assert left == {k: sum(f.stat().st_size for f in [on_node / k, *(on_node / k).rglob("*")] if f.is_file())
                            for k in left}
        again_rc, again = clusterctl_json("collect", run_id, env=env, timeout=600)
        assert again_rc == 0 and [x["bytes"] for x in again["nodes"]] == [0, 0], again  # nothing transferred
        text = clusterctl("collect", run_id, env=env, timeout=600).stdout
        assert f"collect {run_id} --with-checkpoints` brings" in text and "MiB)" in text, text


def test_interrupted_collect_resumes_to_identical_verified_files(clab) -> None:
    state, env, ids, home = clab
    run_id = ids["resnet50-ddp"]
    ckpt_name = "out/checkpoint.pt"
    size = (Path(state.nodes[0].dir) / "srv" / "runs" / run_id / ckpt_name).stat().st_size
    part = home / "runs" / run_id / "node1" / (ckpt_name + ".part")
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "collect", run_id, "--with-checkpoints"], cwd=ROOT,
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (part.exists() and part.stat().st_size > size // 5) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)  # cut mid-transfer
    proc.wait()
    cut = part.stat().st_size
    assert 0 < cut < size, (cut, size)
    rc, res = clusterctl_json("collect", run_id, "--with-checkpoints", env=env, timeout=600)
    assert rc == 0, res
    node1 = next(x for x in res["nodes"] if x["node"] == "node1")
    assert node1["bytes"] <= size - cut + 1_000_000  # the cut copy kept its bytes (only the rest and new logs)
    want = node_files(state, 0, run_id, checkpoints=True)
    assert ckpt_name in want
    assert {k: sha(home / "runs" / run_id / "node1" / k) for k in want} == want
    assert not part.exists()


def test_a_node_cannot_make_collect_write_outside_the_run_folder(clab) -> None:
    state, env, ids, home = clab
    run_id = ids["resnet50-tf"]
    node2 = Path(state.nodes[1].dir) / "srv"
    rdir = node2 / "runs" / run_id
    (rdir / "out" / "etc").symlink_to("/etc")
    (rdir / "out" / "passwd").symlink_to("/etc/passwd")
    agent = node2 / "clusterctl" / "nodeagent.py"
    real = agent.read_text()
    outside = home.parent / "escaped-by-collect"
    # a node that lies: its agent lists names that climb out of the folder or are absolute
    crafted = [{"path": p, "size": 5, "sha256": hashlib.sha256(b"evil\n").hexdigest()}
               for p in ("../../../escaped-by-collect", str(outside), "out/../../../../escaped-by-collect")]
    agent.write_text(real.replace('            result = manifest(run_dir, len(argv) > 2 and argv[2] == "checkpoints")',
                                  '            result = manifest(run_dir, len(argv) > 2 and argv[2] == "checkpoints")\n'
                                  f'            result["files"] += {crafted!r}'))
    try:
        before = set(home.parent.rglob("*"))
        rc, res = clusterctl_json("collect", run_id, env=env, timeout=600)
    finally:
        agent.write_text(real)
    node = next(x for x in res["nodes"] if x["node"] == "node2")
    assert rc == 1  # refusals are reported as a failure
    assert sorted(x["path"] for x in node["refused"]) == sorted(c["path"] for c in crafted)
    assert {x["path"]: x["reason"] for x in node["skipped"]} == {"out/etc": "symbolic link",
                                                                   "out/passwd": "symbolic link"}
    assert not outside.exists()
    created = {p for p in set(home.parent.rglob("*")) - before}
    assert all(p.is_relative_to(home / "runs" / run_id) for p in created), created
    assert not (home / "runs" / run_id / "node2" / "out" / "etc").exists()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_numbers_match_the_metrics_and_the_page_renders_in_chromium(clab, tmp_path: Path) -> None:
    state, env, ids, home = clab
    for run_id in ids.values():
        clusterctl_json("collect", run_id, env=env, timeout=600)
    page = tmp_path / "report.html"
    rc, rep = clusterctl_json("report", *ids.values(), "--html", str(page), "--markdown", str(tmp_path / "r.md"),
                              "--price-kwh", "0.3", env=env, timeout=300)
    assert rc == 0, rep
    html_text = page.read_text()
    for fig in rep["runs"]:
        recs = [json.loads(x) for x in (home / "runs" / fig["run_id"] / "node1" / "out" / "metrics-rank0.jsonl")
                .read_text().splitlines()]
        epochs = [r for r in recs if r["type"] == "epoch"]
        assert fig["final_val_acc"] == epochs[-1]["val_acc"]
        assert fig["best_val_acc"] == max(e["val_acc"] for e in epochs)
        assert fig["images_per_s"] == pytest.approx(statistics.median([e["images_per_s"] for e in epochs[1:]]))
        assert f"{fig['final_val_acc']:.4f}" in html_text and f"{fig['images_per_s']:.1f}" in html_text
        assert fig["energy_kwh"] > 0 and fig["cost"] == pytest.approx(fig["energy_kwh"] * 0.3)
        assert {n["node"] for n in fig["per_node"]} == {"node1", "node2"}
        assert all("cores" in n["hardware"] for n in fig["per_node"])  # from the facts collect brought
    assert (tmp_path / "r-plots" / "accuracy_loss.png").exists() and "r-plots/step_time.png" in (tmp_path / "r.md").read_text()
    chromium = _chromium()
    assert chromium, "chromium is installed by scripts/setup.sh"
    probe = tmp_path / "probe.html"  # the page plus a check that runs in the browser after it loaded
    probe.write_text(html_text.replace("</body>", "<script>window.addEventListener('load', () => {"
                     "const imgs = [...document.images]; const ok = imgs.filter(i => i.complete && i.naturalWidth > 0);"
                     "const rows = document.querySelectorAll('table tbody tr').length;"
                     "const w = document.documentElement.scrollWidth;"
                     "document.body.insertAdjacentHTML('beforeend', `<p id=probe>images ${ok.length}/${imgs.length} rows ${rows} width ${w}</p>`);"
                     "});</script></body>"))
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                        "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                       timeout=120)
    m = re.search(r"<p id=\"probe\">images (\d+)/(\d+) rows (\d+) width (\d+)</p>", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    loaded, total, rows, width = map(int, m.groups())
    assert width <= 1280, f"the page is {width} px wide in a 1280 px window: it scrolls sideways"
    assert total >= 3 and loaded == total  # every plot decoded and laid out (single-point plots are left out)
    assert rows >= 2 + 2 * 2  # the runs table and each run's per-node table


def test_study_runs_the_matrix_and_reports_scaling_for_both_frameworks(clab) -> None:
    """Plain and PowerSGD in one command: a setting that only changes the wire runs one node once, the
    baseline of every variant's scaling; each framework's program ships and runs its PowerSGD (fp16's wire is
    the training programs' unit tests')."""
    state, env, _, home = clab
    # one epoch of 3 steps per cell (six cells, three of them TensorFlow's)
    study = ["--set", "epochs=1", "--set", "threads=1", "--set", "max_steps=3", "--set", "log_every=1",
             "--set", "batch=8"]
    args = ["study", "resnet50-ddp", "resnet50-tf", "--nodes", "1,2", "--vary", "grad_compression=none,powersgd",
            "--set", "powersgd_start_step=1", *study]
    rc, res = clusterctl_json(*args, env=env, timeout=2400)
    assert rc == 0, json.dumps(res)[-3000:]
    none, psgd = (f"grad_compression={c}" for c in ("none", "powersgd"))
    assert [(c["job"], c["setting"], c["nodes"], c["state"]) for c in res["cells"]] == [
        (job, setting, n, "succeeded") for job in ("resnet50-ddp", "resnet50-tf")
        for setting, n in ((none, 1), (none, 2), (psgd, 2))]
    page = Path(res["report"])
    assert page.exists() and "scaling eff." in page.read_text()
    figs = json.loads((page.parent / "report.json").read_text())
    two = {(f["framework"], f["grad_compression"]): f for f in figs if len(f["nodes"]) == 2}
    assert set(two) == {(fw, c) for fw in ("pytorch", "tensorflow") for c in ("none", "powersgd")}
    for (fw, c), f in two.items():
        one = next(x for x in figs if x["run_id"] == f["scaling"]["baseline"])
        assert len(one["nodes"]) == 1 and one["job"] == f["job"]
        assert f["scaling"]["efficiency"] == pytest.approx(f["images_per_s"] / (2 * one["images_per_s"]))
        plain = two[(fw, "none")]
        if c != "none":  # fewer bytes of the same gradients, on the same baseline
            assert f["scaling"]["baseline"] == plain["scaling"]["baseline"]
        if c == "powersgd":  # rank 2: ResNet50 in ~1/100 of its bytes (docs/jobs.md)
            assert 60 < plain["allreduce_payload_bytes"] / f["allreduce_payload_bytes"] < 150
    rc, again = clusterctl_json(*args, env=env, timeout=600)  # resumable: nothing is run twice
    assert rc == 0 and all(c["skipped"] for c in again["cells"])
    assert [c["run_id"] for c in again["cells"]] == [c["run_id"] for c in res["cells"]]


def test_collect_while_running_after_stop_and_with_a_node_down(clab) -> None:
    state, env, _, home = clab
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "--detach", "--set", "threads=1", "--set", "log_every=1",
                              env=env, timeout=300)
    assert rc == 0, rec
    run_id = rec["run_id"]
    deadline = time.monotonic() + 300
    node_metrics = [Path(n.dir) / "srv" / "runs" / run_id / "out" for n in state.nodes]
    while not all(list(d.glob("metrics-rank*.jsonl")) for d in node_metrics) and time.monotonic() < deadline:
        time.sleep(0.5)
    rc, during = clusterctl_json("collect", run_id, env=env, timeout=600)  # while it runs
    assert rc == 0 and all(x["files"] > 0 for x in during["nodes"]), during
    rc, _ = clusterctl_json("stop", run_id, env=env, timeout=120)
    assert rc == 0
    rc, after = clusterctl_json("collect", run_id, env=env, timeout=600)  # the stopped run: the rest of it
    assert rc == 0 and sum(x["bytes"] for x in after["nodes"]) > 0
    for i, n in enumerate(state.nodes):
        assert {k: sha(home / "runs" / run_id / n.name / k) for k in node_files(state, i, run_id)} \
            == node_files(state, i, run_id)
    sshd.stop_sshd(state, "node2")  # node2 is 'off'
    try:
        rc, down = clusterctl_json("collect", run_id, env=env, timeout=600)
    finally:
        sshd.restart_sshd(state, "node2")
    by = {x["node"]: x for x in down["nodes"]}
    assert rc == 3 and by["node2"]["status"] == "unreachable" and by["node2"]["error"]
    assert by["node1"]["status"] == "ok" and by["node1"]["files"] > 0  # the others are collected all the same


ROTATING = '''"""Rotates temporary files under its own folder in a tight loop and rewrites one file in place,
as a running program does; writes one file once; its log grows."""
import os
import time

os.makedirs("rot", exist_ok=True)
with open("stable.txt", "w") as f:
    f.write("written once\\n")
with open("state.bin", "wb") as f:
    f.write(bytes(131072))
live, i = [], 0
with open("state.bin", "r+b") as state:
    while True:
        i += 1
        name = os.path.join("rot", "%08x.dat" % (i * 2654435761 % 2 ** 32))
        with open(name, "wb") as f:
            f.write(b"%d " % i * 8192)
        live.append(name)
        if len(live) > 16:
            os.unlink(live.pop(0))
        state.seek(0)
        state.write(bytes([i % 256]) * 131072)  # the same size, other bytes
        state.flush()
        if i % 50 == 0:
            print("rotated", i, flush=True)
        time.sleep(0.002)
'''


def test_collect_of_a_running_program_that_rotates_and_rewrites_files(clab, tmp_path: Path) -> None:
    """Files deleted under the listing or rewritten under the copy never fail a node: each is fetched as the
    node has it or named in the node's `changed`, and every file that holds still comes to the head."""
    state, env, _, home = clab
    code = tmp_path / "rotating"
    code.mkdir()
    (code / "rotate.py").write_text(ROTATING)
    rc, rec = clusterctl_json("launch", "--code", str(code), "--launcher", "plain", "--detach", "--",
                              "python", "rotate.py", env=env, timeout=300)
    assert rc == 0, json.dumps(rec)[-2000:]
    run_id = rec["run_id"]
    programs = [Path(n.dir) / "srv" / "runs" / run_id / "program" for n in state.nodes]
    deadline = time.monotonic() + 120
    while not all(len(list((p / "rot").glob("*.dat"))) >= 16 for p in programs) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        for attempt in range(3):
            rc, res = clusterctl_json("collect", run_id, env=env, timeout=600)
            assert rc == 0, (attempt, res)
            assert [(x["node"], x["status"]) for x in res["nodes"]] == [("node1", "ok"), ("node2", "ok")], res
            for x in res["nodes"]:
                got = home / "runs" / run_id / x["node"]
                assert (got / "program" / "stable.txt").read_text() == "written once\n"
                assert (got / "program" / "rotate.py").exists() is False  # shipped, unchanged: left there
                assert (got / "node.log").is_file() and (got / "job.json").is_file()
                assert all(c["path"] == "program/state.bin" or c["path"].startswith("program/rot/")
                           for c in x["changed"]), x["changed"]  # only what the program moves is named
                assert x["files"] > 0 and not list(got.rglob("*.part"))
            print(f"\ncollect {attempt + 1} while it runs: " + "; ".join(
                f"{x['node']} {x['files']} files, changed {sorted({c['reason'] for c in x['changed']})}"
                for x in res["nodes"]))
    finally:
        rc, stopped = clusterctl_json("stop", run_id, env=env, timeout=120)
    assert rc == 0, stopped
    rc, after = clusterctl_json("collect", run_id, env=env, timeout=600)  # stopped: every file holds still
    assert rc == 0 and all(x["changed"] == [] for x in after["nodes"]), after
    for i, n in enumerate(state.nodes):
        want = node_files(state, i, run_id)
        assert "program/state.bin" in want and {k: sha(home / "runs" / run_id / n.name / k) for k in want} == want
