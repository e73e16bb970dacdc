"""Both training programs on a real 2-node lab (torchrun / TF_CONFIG by hand, as launch will render them).

The nodes use the head's .venv through the shared filesystem: the inventory explicitly
reuses that interpreter (provisioning is tested in test_provision.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import clusterctl_json, lab_up, pytestmark  # noqa: F401

sys.path.insert(0, str(ROOT / "cluster" / "programs"))
import wlmetrics  # noqa: E402

PY = sys.executable
WL = ROOT / "cluster" / "programs"
COMMON = "--dataset digits --epochs 3 --batch 32 --lr 0.01 --threads 1"


@pytest.fixture(scope="module")
def wlab(tmp_path_factory: pytest.TempPathFactory):
    with lab_up(tmp_path_factory, "w", 2, 4) as (state, d):
        yield state, {"CLUSTERCTL_HOME": str(d / "home")}


def _epochs(state, sub: str) -> dict[int, list[dict]]:
    out = {}
    for r, n in enumerate(state.nodes):
        recs = [json.loads(x) for x in (Path(n.dir) / "srv" / sub / f"metrics-rank{r}.jsonl").read_text().splitlines()]
        assert all(wlmetrics.validate(x) == [] for x in recs)
        out[r] = [x for x in recs if x["type"] == "epoch"]
    return out


def _check(state, sub: str) -> list[float]:
    ep = _epochs(state, sub)
    # both ranks agree on the global loss, the accuracy and the step counts
    assert [(e["step"], round(e["train_loss"], 5), e["val_acc"]) for e in ep[0]] == \
           [(e["step"], round(e["train_loss"], 5), e["val_acc"]) for e in ep[1]]
    accs = [e["val_acc"] for e in ep[0]]
    assert accs[-1] > 0.6 and accs[-1] > accs[0] + 0.4, accs  # validation accuracy clearly rises
    summary = json.loads((Path(state.nodes[0].dir) / "srv" / sub / "summary.json").read_text())
    assert summary["world"] == 2 and summary["final_val_acc"] == accs[-1]
    return accs


def test_ddp_trains_digits_on_two_nodes(wlab) -> None:
    state, env = wlab
    master = state.nodes[0].address
    cmd = (f'R=$(( ${{HOSTNAME#node}} - 1 )); cd /srv/cluster && GLOO_SOCKET_IFNAME=eth0 {PY} -m torch.distributed.run '
           f"--nnodes 2 --nproc_per_node 1 --node_rank $R --master_addr {master} --master_port 29511 "
           f"{WL}/train_torch.py {COMMON} --out /srv/cluster/ddp")
    rc, res = clusterctl_json("exec", state.inventory, "--timeout", "900", "--", cmd, env=env, timeout=1000)
    assert rc == 0, json.dumps(res)[-3000:]
    print("DDP val_acc per epoch:", _check(state, "ddp"))


def test_tf_trains_digits_on_two_nodes(wlab) -> None:
    state, env = wlab
    workers = json.dumps([f"{n.address}:23461" for n in state.nodes])
    cmd = ('R=$(( ${HOSTNAME#node} - 1 )); cd /srv/cluster && '
           f"TF_CONFIG='{{\"cluster\": {{\"worker\": {workers}}}, \"task\": {{\"type\": \"worker\", \"index\": '$R'}}}}' "
           f"{PY} {WL}/train_tf.py {COMMON} --out /srv/cluster/tf")
    rc, res = clusterctl_json("exec", state.inventory, "--timeout", "900", "--", cmd, env=env, timeout=1000)
    assert rc == 0, json.dumps(res)[-3000:]
    print("TF val_acc per epoch:", _check(state, "tf"))
