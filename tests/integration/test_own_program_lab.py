"""A lab's own program on a real 2-node lab, as a new user runs it: `clusterctl launch -- python ...` in the
program's folder. Code shipped through each node's cache (only what changed), every launcher, a public DDP
program written by others, a failing rank, bad input refused before anything starts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import clusterctl, clusterctl_json, provisioned_lab, pytestmark, why  # noqa: F401

OWN = ROOT / "tests" / "fixtures" / "own"
PUBLIC = ROOT / "tests" / "fixtures" / "public_ddp" / "aws-cpu-ddp"


@pytest.fixture(scope="module")
def olab(tmp_path_factory: pytest.TempPathFactory):
    yield from provisioned_lab(tmp_path_factory, "o", 2, 24)


def launch_in(folder: Path, env: dict[str, str], *argv: str, timeout: float = 300) -> tuple[int, dict]:
    """`clusterctl launch [OPTIONS] -- COMMAND` with `folder` as the code (as if run from inside it)."""
    i = argv.index("--")
    return clusterctl_json("launch", "--code", str(folder), *argv[:i], *argv[i:], env=env, timeout=timeout)


def node_program(state, i: int, run_id: str) -> Path:
    return Path(state.nodes[i].dir) / "srv" / "runs" / run_id / "program"


def sent(rec: dict) -> dict[str, int]:
    return {n: v["bytes_sent"] for n, v in rec["code"]["nodes"].items()}


def test_own_torchrun_program_ships_only_what_changed(olab, tmp_path: Path) -> None:
    state, env = olab
    code = tmp_path / "mine"
    shutil.copytree(OWN, code)
    rc, rec = launch_in(code, env, "--", "python", "train.py", "--steps", "3", "--out", "results")
    assert rc == 0 and rec["state"] == "succeeded", why(rec)
    for i in range(2):
        got = json.loads((node_program(state, i, rec["run_id"]) / "results" / f"rank{i}.json").read_text())
        assert got["world"] == 2 and got["sum"] == 9.0 and got["argv"] == ["--steps", "3", "--out", "results"]
    first = sent(rec)
    assert all(b > 0 for b in first.values()), first
    assert rec["settings"]["program"] == "train.py" and rec["settings"]["launcher"] == "torchrun"
    rc, again = launch_in(code, env, "--", "python", "train.py", "--steps", "1")
    assert rc == 0 and sent(again) == {"node1": 0, "node2": 0}, again["code"]
    (code / "plain_job.py").write_text((code / "plain_job.py").read_text() + "# edited\n")
    rc, edited = launch_in(code, env, "--", "python", "train.py", "--steps", "1")
    size = (code / "plain_job.py").stat().st_size
    assert rc == 0 and sent(edited) == {"node1": size, "node2": size}, edited["code"]
    assert {v["files_sent"] for v in edited["code"]["nodes"].values()} == {1}
    print(f"\ncode shipped per node: first {first}, unchanged {sent(again)}, one file edited {sent(edited)}")


def test_the_spec_docs_jobs_md_shows_runs_as_written(olab, tmp_path: Path) -> None:
    """docs/jobs.md's example spec, with its program beside it (a copy of tests/fixtures/own), launched by its
    path: its folder shipped, its args given, every rank's output on its node."""
    state, env = olab
    code = tmp_path / "mnist"
    shutil.copytree(OWN, code)
    doc = (ROOT / "docs" / "jobs.md").read_text()
    example = doc[doc.index("```yaml\n", doc.index("A spec for it")) + 8:]
    spec = code / "mine.yaml"
    spec.write_text(example[:example.index("```")].replace("[--epochs, 3, --lr, 0.1]", "[--steps, 3]"))
    rc, rec = clusterctl_json("launch", str(spec), env=env, timeout=300)
    assert rc == 0 and rec["state"] == "succeeded", why(rec)
    assert rec["job"] == "mnist-ddp" and rec["settings"]["args"] == ["--steps", 3]  # YAML: a number
    for i in range(2):
        got = json.loads((node_program(state, i, rec["run_id"]) / "results" / f"rank{i}.json").read_text())
        assert got["world"] == 2 and got["argv"] == ["--steps", "3"]


def test_plain_and_module_forms(olab) -> None:
    state, env = olab
    rc, rec = launch_in(OWN, env, "--launcher", "plain", "--outputs", "results", "--", "python", "plain_job.py")
    assert rc == 0 and rec["state"] == "succeeded", why(rec)
    (node_program(state, 1, rec["run_id"]) / "scratch.bin").write_bytes(b"not an output")
    rc, res = clusterctl_json("collect", rec["run_id"], env=env, timeout=300)
    got = Path(env["CLUSTERCTL_HOME"]) / "runs" / rec["run_id"] / "node2"
    assert rc == 0 and {p.relative_to(got).as_posix() for p in (got / "program").rglob("*") if p.is_file()} == {
        "program/results/node1.json"}, res  # its `outputs` only: not the code, not the scratch file
    assert (got / "node.log").is_file() and (got / "job.json").is_file()
    told = [json.loads((node_program(state, i, rec["run_id"]) / "results" / f"node{i}.json").read_text())
            for i in range(2)]
    addrs = ",".join(n.address for n in state.nodes)
    assert [t["CLUSTER_NODE_RANK"] for t in told] == ["0", "1"] and {t["CLUSTER_NNODES"] for t in told} == {"2"}
    assert {t["CLUSTER_NODE_ADDRS"] for t in told} == {addrs}
    assert {t["CLUSTER_COORDINATOR"] for t in told} == {f"{state.nodes[0].address}:{told[0]['MASTER_PORT']}"}
    rc, rec = launch_in(OWN, env, "--", "python", "-m", "pkg.hello")
    assert rc == 0 and rec["state"] == "succeeded", why(rec)


def test_a_public_ddp_program_written_by_others_runs_as_is(olab) -> None:
    """aws-samples' CPU DDP example, unmodified: torchrun, gloo, its own checkpoint (snapshot.pt), collected."""
    state, env = olab
    rc, rec = launch_in(PUBLIC, env, "--", "python", "ddp.py", "2", "1", timeout=600)
    assert rc == 0 and rec["state"] == "succeeded", why(rec)
    assert (node_program(state, 0, rec["run_id"]) / "snapshot.pt").stat().st_size > 0
    rc, res = clusterctl_json("collect", rec["run_id"], env=env, timeout=300)
    assert rc == 0, res
    home = Path(env["CLUSTERCTL_HOME"])
    got = home / "runs" / rec["run_id"] / "node1"
    assert (got / "program" / "snapshot.pt").stat().st_size > 0  # what it wrote comes back ...
    assert not (got / "program" / "ddp.py").exists() and res["nodes"][0]["shipped"] == 3  # ... not what was shipped


KUBEFLOW = ROOT / "tests" / "fixtures" / "public_ddp" / "kubeflow-mnist"
KUBEFLOW_ARGV = ("--data", str(KUBEFLOW / "data"), "--set", "requirements=[tensorboardX==2.6.2.2]",
                 "--outputs", "mnist_cnn.pt", "--outputs", "logs",
                 "--", "python", "mnist.py", "--epochs", "1", "--save-model", "--no-cuda")


def test_a_public_program_with_a_requirement_it_lacks_runs_and_comes_back(olab, tmp_path: Path) -> None:
    """Kubeflow's distributed MNIST example, unmodified (tensorboardX, absent from the provisioned environment;
    its data read from `../data`, the run's staged `data`): the requirement installed offline from the head's
    wheelhouse, the model and event files it writes collected, the report's wall time and per-node CPU; a
    second launch installs nothing and, after one file is edited, sends only that file."""
    state, env = olab
    src = tmp_path / "src"
    shutil.copytree(KUBEFLOW / "src", src)
    rc, rec = launch_in(src, env, *KUBEFLOW_ARGV, timeout=900)
    assert rc == 0 and rec["state"] == "succeeded", (rec.get("failure"), rec.get("requirements"))
    assert rec["requirements"]["lock"] == ["tensorboardx==2.6.2.2"]  # numpy, packaging, protobuf: from the base
    assert all(v["installed"] and v["bytes"] > 0 for v in rec["requirements"]["nodes"].values()), rec["requirements"]
    rc, res = clusterctl_json("collect", rec["run_id"], env=env, timeout=300)
    assert rc == 0, res
    for node in ("node1", "node2"):
        got = Path(env["CLUSTERCTL_HOME"]) / "runs" / rec["run_id"] / node / "program"
        assert (got / "mnist_cnn.pt").stat().st_size > 100_000 and list((got / "logs").glob("events.out.tfevents.*"))
        assert not (got / "mnist.py").exists()  # shipped, unchanged: left on the node
    rc, rep = clusterctl_json("report", rec["run_id"], "--html", str(tmp_path / "r.html"), env=env, timeout=300)
    fig = rep["runs"][0]
    assert rc == 0 and fig["wall_s"] > 0 and all(n["cpu_percent"] for n in fig["per_node"]), fig

    rc, again = launch_in(src, env, *KUBEFLOW_ARGV, timeout=900)
    assert rc == 0 and again["state"] == "succeeded", again.get("failure")
    assert all(not v["installed"] and v["bytes"] == 0 for v in again["requirements"]["nodes"].values())
    assert sent(again) == {"node1": 0, "node2": 0} and {v["bytes_sent"] for v in again["data"]["nodes"].values()} == {0}
    (src / "mnist.py").write_text((src / "mnist.py").read_text() + "# a student's edit\n")
    rc, edited = launch_in(src, env, *KUBEFLOW_ARGV, timeout=900)
    assert rc == 0 and edited["state"] == "succeeded", edited.get("failure")
    size = (src / "mnist.py").stat().st_size
    assert sent(edited) == {"node1": size, "node2": size} and {v["files_sent"] for v in edited["code"]["nodes"].values()} == {1}
    print(f"\nkubeflow mnist, bytes sent per node: code first {sent(rec)}, again {sent(again)}, one file edited "
          f"{sent(edited)}; wheels first {[v['bytes'] for v in rec['requirements']['nodes'].values()]}, again "
          f"{[v['bytes'] for v in again['requirements']['nodes'].values()]}; wall {fig['wall_s']:.1f} s, CPU % "
          f"{[n['cpu_percent'] for n in fig['per_node']]}")


USES_METRICS = """import json, os, torch, torchmetrics
acc = torchmetrics.classification.BinaryAccuracy()(torch.tensor([0.9, 0.2, 0.7]), torch.tensor([1, 0, 1]))
os.makedirs("results", exist_ok=True)
with open(f"results/{os.environ['CLUSTER_NODE_NAME']}.json", "w") as f:
    json.dump({"acc": float(acc), "torchmetrics": torchmetrics.__file__, "torch": torch.__file__}, f)
"""


def test_a_folders_requirements_txt_that_needs_torch_adds_only_its_own_wheels(olab, tmp_path: Path) -> None:
    """A student's folder whose requirements.txt names torchmetrics (it needs torch and numpy, which the
    provisioned environment has), launched without --requirements: the file is used, the head's wheelhouse
    grows by torchmetrics and lightning-utilities alone (about 1 MB: pip download of the resolution took torch
    and CUDA, 2.9 GB), each node installs that layer and the program imports it over the environment's torch."""
    from tests.unit.test_layer_resolution import stored_bytes

    state, env = olab
    code = tmp_path / "metrics"
    code.mkdir()
    (code / "requirements.txt").write_text("torchmetrics==1.9.0\n")
    (code / "uses_metrics.py").write_text(USES_METRICS)
    wh = Path(env["CLUSTERCTL_HOME"]) / "wheelhouse"
    before = stored_bytes(wh)
    rc, rec = launch_in(code, env, "--launcher", "plain", "--", "python", "uses_metrics.py", timeout=900)
    assert rc == 0 and rec["state"] == "succeeded", (why(rec), rec.get("requirements"))
    assert rec["settings"]["requirements"] == "requirements.txt"
    assert [p.split("==")[0] for p in rec["requirements"]["lock"]] == ["lightning-utilities", "torchmetrics"]
    grown = stored_bytes(wh) - before
    assert 0 < grown < 100 * 2**20, f"the wheelhouse grew by {grown / 2**20:.0f} MiB"
    for i in range(2):
        got = json.loads((node_program(state, i, rec["run_id"]) / "results" / f"node{i + 1}.json").read_text())
        assert got["acc"] == 1.0 and "/clusterctl/layers/" in got["torchmetrics"], got
        assert "/clusterctl/layers/" not in got["torch"], got  # the environment's torch, not a copy
    print(f"\nwheelhouse grew by {grown / 2**20:.1f} MiB for {rec['requirements']['lock']}; wheels sent per node "
          f"{[v['bytes'] for v in rec['requirements']['nodes'].values()]}")


def test_a_rank_that_raises_on_the_second_node_fails_the_run_naming_it(olab) -> None:
    state, env = olab
    rc, rec = launch_in(OWN, env, "--", "python", "train.py", "--fail-on-group-rank", "1", timeout=300)
    assert rc == 1 and rec["state"] == "failed", rec
    assert rec["failure"]["node"] == "node2", rec["failure"]
    assert rec["failure"]["log"][0].startswith("Traceback") and "RuntimeError: deliberate failure on group rank 1" \
        in rec["failure"]["log"], rec["failure"]["log"]
    for n in ("node1", "node2"):  # nothing left running on either node
        assert not [p for p in Path("/proc").glob("[0-9]*") if _carries(p, rec["run_id"], n)]
    r = clusterctl("logs", rec["run_id"], "--node", "node2", env=env, timeout=120)  # each line: its rank
    assert "[rank1]:" in r.stdout and r.returncode == 0, r.stdout[-2000:]
    logs = node_program(state, 1, rec["run_id"]).parent / "logs"  # torchrun's --log-dir, beside program/
    rank_logs = sorted(p.relative_to(logs).parts[-2:] for p in logs.rglob("*.log"))
    assert rank_logs == [("0", "stderr.log"), ("0", "stdout.log")], rank_logs  # one file per local rank


def _carries(p: Path, run_id: str, node: str) -> bool:
    try:
        env = (p / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"CLUSTER_RUN_ID={run_id}".encode() in env and f"CLUSTER_NODE_NAME={node}".encode() in env


@pytest.mark.parametrize("argv, field", [
    (["--", "python", "nosuch.py"], "program"),
    (["--", "python", "../outside.py"], "program"),
    (["--launcher", "plain", "--set", "args=notalist", "--", "python", "plain_job.py"], "args"),
    (["--requirements", "nosuch.txt", "--", "python", "plain_job.py"], "requirements"),
    (["--set", "requirements=[nosuch-package-clusterctl-test==1.0]", "--", "python", "plain_job.py"], "requirements"),
    (["--outputs", "../elsewhere", "--", "python", "plain_job.py"], "outputs"),
])
def test_bad_input_is_refused_before_anything_starts(olab, argv: list[str], field: str) -> None:
    state, env = olab
    rc_before, before = clusterctl_json("runs", env=env)
    r = clusterctl("launch", "--code", str(OWN), *argv, env=env, timeout=120)
    assert r.returncode == 2 and f"{field}:" in r.stderr, r.stderr
    _, after = clusterctl_json("runs", env=env)
    assert len(after) == len(before), "nothing was recorded or started"


def test_own_tensorflow_program_gets_its_tf_config(olab) -> None:
    state, env = olab
    rc, rec = launch_in(OWN, env, "--launcher", "tensorflow", "--", "python", "tf_job.py", timeout=600)
    assert rc == 0 and rec["state"] == "succeeded", (rec.get("failure"), rec.get("last_status"))
    for i in range(2):
        got = json.loads((node_program(state, i, rec["run_id"]) / "results" / f"worker{i}.json").read_text())
        assert got == {"workers": 2, "sum": 3.0}, got


def test_requirements_install_offline_once_and_never_replace_the_base(olab) -> None:
    """tabulate (absent from the provisioned environment) resolved on the head, sent and installed as a
    layer; the second launch installs nothing; a pin that would replace a base package is refused."""
    state, env = olab
    argv = ("--launcher", "plain", "--requirements", "tabulate.txt", "--", "python", "needs_tabulate.py")
    rc, rec = launch_in(OWN, env, *argv, timeout=600)
    assert rc == 0 and rec["state"] == "succeeded", (rec.get("failure"), rec.get("requirements"))
    assert rec["requirements"]["lock"] == ["tabulate==0.9.0"]
    first = rec["requirements"]["nodes"]
    assert all(v["installed"] and v["bytes"] > 0 for v in first.values()), first
    table = (node_program(state, 1, rec["run_id"]) / "results" / "table1.txt").read_text()
    assert "node2" in table and "rank" in table
    rc, again = launch_in(OWN, env, *argv, timeout=600)
    assert rc == 0 and all(not v["installed"] and v["bytes"] == 0 for v in again["requirements"]["nodes"].values())
    import importlib.metadata as md

    base = md.version("termcolor")
    other = "2.3.0" if base != "2.3.0" else "2.2.0"
    r = clusterctl("launch", "--code", str(OWN), "--launcher", "plain", "--set", f"requirements=[termcolor=={other}]",
                   "--", "python", "plain_job.py", env=env, timeout=300)
    flat = " ".join(r.stderr.split())
    assert r.returncode == 2 and f"termcolor=={other} would replace termcolor=={base}" in flat, r.stderr
    print(f"\nrequirements layer per node: first {first}, again {again['requirements']['nodes']}")


def test_report_of_an_own_program_shows_wall_time_exit_codes_usage_and_its_metrics(olab, tmp_path: Path) -> None:
    """Nothing of clusterctl imported by the program: the node agent's samples and $CLUSTER_METRICS make the
    report; the page fits 1280 px without a horizontal scroll and draws no plot from a single point."""
    import re
    import subprocess

    from tests.integration.test_collect_report_lab import _chromium

    state, env = olab
    rc, rec = launch_in(OWN, env, "--", "python", "train.py", "--seconds", "16", timeout=300)
    assert rc == 0 and rec["state"] == "succeeded", rec.get("failure")
    rc, _ = clusterctl_json("collect", rec["run_id"], env=env, timeout=300)
    assert rc == 0
    page = tmp_path / "own.html"
    rc, rep = clusterctl_json("report", rec["run_id"], "--html", str(page), env=env, timeout=300)
    assert rc == 0, rep
    fig = rep["runs"][0]
    assert fig["wall_s"] and fig["wall_s"] >= 16 and fig["images_per_s"] is None
    assert [n["exit_code"] for n in fig["per_node"]] == [0, 0], fig["per_node"]
    assert all(n["cpu_percent"] and n["rss_mb_peak"] for n in fig["per_node"]), fig["per_node"]
    text = page.read_text()
    assert "Runs on the cluster" in text and "$CLUSTER_METRICS" in text and "CPU use and resident memory" in text
    assert "Images/s against the number of nodes" not in text  # one run, one node count: not drawn
    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", "<script>window.addEventListener('load', () => {"
                     "document.body.insertAdjacentHTML('beforeend', `<p id=probe>width ${document.documentElement"
                     ".scrollWidth} images ${[...document.images].filter(i => i.naturalWidth > 0).length}</p>`);"
                     "});</script></body>"))
    r = subprocess.run([_chromium() or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
                        "--window-size=1280,900", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"<p id=\"probe\">width (\d+) images (\d+)</p>", r.stdout)
    assert m, r.stdout[-1500:] + r.stderr[-1500:]
    assert int(m.group(1)) <= 1280 and int(m.group(2)) == 2, m.group(0)


def test_data_is_staged_once_and_named_to_the_program(olab, tmp_path: Path) -> None:
    state, env = olab
    data = tmp_path / "my data.csv"  # a space: every value reaches the node shell-quoted
    data.write_text("".join(f"{i},{i * i}\n" for i in range(1000)))
    argv = ("--launcher", "plain", "--data", str(data), "--", "python", "reads_data.py")
    rc, rec = launch_in(OWN, env, *argv)
    assert rc == 0 and rec["state"] == "succeeded", rec.get("failure")
    for i in range(2):
        assert (node_program(state, i, rec["run_id"]) / "results" / f"rows{i}.txt").read_text() == "1000"
    size = data.stat().st_size
    assert {v["bytes_sent"] for v in rec["data"]["nodes"].values()} == {size}
    rc, again = launch_in(OWN, env, *argv)
    assert rc == 0 and {v["bytes_sent"] for v in again["data"]["nodes"].values()} == {0}


def test_status_shows_the_step_and_loss_a_program_writes_to_cluster_metrics(olab) -> None:
    """A program of one's own that appends {"step", "loss"} lines to $CLUSTER_METRICS (train.py: rank 0, every
    10 steps): `status` has the newest step and loss while it runs and after, every number it wrote in
    `user_metrics`; the node that writes none shows its program's last line instead."""
    from tests.integration.conftest import wait_until

    state, env = olab
    rc, rec = launch_in(OWN, env, "--detach", "--", "python", "train.py", "--seconds", "20")
    assert rc == 0, why(rec)
    seen: list[dict] = []

    def stepped() -> bool:
        seen.append(clusterctl_json("status", rec["run_id"], env=env)[1])
        return seen[-1]["state"] == "running" and (seen[-1]["last_status"]["node1"].get("step") or 0) >= 11

    wait_until(stepped, 90, "node1's step in `status` while the run runs", step=1.0)
    wait_until(lambda: clusterctl_json("status", rec["run_id"], env=env)[1]["state"] != "running", 120,
               "the run's end", step=2.0)
    rc, st = clusterctl_json("status", rec["run_id"], env=env)
    assert rc == 0 and st["state"] == "succeeded", why(st)
    node1, node2 = st["last_status"]["node1"], st["last_status"]["node2"]
    step = node1["step"]
    assert step % 10 == 1 and node1["loss"] == pytest.approx(1 / step), node1
    assert node1["user_metrics"]["step"] == step and node1["user_metrics"]["sum"] > 0, node1
    assert node2["step"] is None and node2["user_metrics"] == {}, node2
    r = clusterctl("status", rec["run_id"], env={**env, "COLUMNS": "250"})
    row1 = next(x for x in r.stdout.splitlines() if "node1" in x)
    row2 = next(x for x in r.stdout.splitlines() if "node2" in x)
    assert f" {step} " in row1 and f"{1 / step:.4f}" in row1, r.stdout
    assert "rank 1 of 2 on node2" in row2, r.stdout  # its last line: not torchrun's shutdown trace
