"""Names and ids that become file names, shell words or link names: a trailing newline is refused everywhere.

`re.match` with `$` accepts "name\\n" (`$` also matches before a final newline); every such check anchors
with `\\Z` instead. And the job name is ASCII: `str.isalnum` accepts 'é', whose run id was then refused.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster.runs import jobs, records, schema
from cluster.lab import lifecycle, shaping
from cluster.inventory import ansible_yaml, check as inventory_check
from cluster.errors import UsageError
from cluster.runs.schema import JobError
from cluster.agent import relaynode_common

PATTERNS = [
    (inventory_check.SAFE_NAME, "pc1"), (records.RUN_ID_RE, "resnet50-ddp-20250101-120000-ab12"),
    (relaynode_common.NAME_RE, "torch-2.3.1+cpu-cp311-linux_x86_64.whl"), (lifecycle.NAME_RE, "lab"),
    (ansible_yaml.PLAIN_HOST, "pc1.lab"), (shaping.RATE_RE, "100mbit"), (schema.JOB_NAME_RE, "resnet50-ddp"),
]


@pytest.mark.parametrize("pattern, good", PATTERNS, ids=lambda p: getattr(p, "pattern", p))
def test_a_trailing_newline_is_refused(pattern: re.Pattern[str], good: str) -> None:
    assert pattern.match(good) and pattern.fullmatch(good)
    for bad in (good + "\n", good + "\r\n", good + "\nx", "\n" + good):
        assert not pattern.match(bad), repr(bad)


def test_a_run_id_with_a_newline_names_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    with pytest.raises(UsageError, match="is not a run id"):
        records.run_path("resnet50-ddp-20250101-120000-ab12\n")
    assert records.run_path("resnet50-ddp-20250101-120000-ab12").name == "resnet50-ddp-20250101-120000-ab12"


def test_a_lab_name_with_a_newline_is_refused_before_anything_is_made() -> None:
    with pytest.raises(UsageError, match="lab name 'lab\\\\n' is not valid"):
        lifecycle._validate("lab\n", 3, "10.77.0.0/24")  # noqa: SLF001 - the check `up` runs first


@pytest.mark.parametrize("name", ["é", "résnet", "ｊｏｂ", "job\n", "-job", ".job", "_job", "j" * 129, "a/b", ""])
def test_a_job_name_is_ascii_and_can_start_a_run_id(tmp_path: Path, name: str) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(f"name: {json.dumps(name)}\nframework: pytorch\n")  # JSON strings are YAML too
    with pytest.raises(JobError) as e:
        jobs.load(str(f))
    assert e.value.field == "name" and "ASCII letters, digits" in e.value.message and e.value.exit_code == 2


@pytest.mark.parametrize("name", ["j", "resnet50-ddp", "A.b_c-9", "j" * 128])
def test_good_job_names_start_valid_run_ids(tmp_path: Path, name: str) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(f"name: {name}\nframework: pytorch\n")
    spec = jobs.load(str(f))
    assert records.RUN_ID_RE.match(records.new_run_id(spec.name))


def test_a_model_name_is_ascii() -> None:
    with pytest.raises(JobError, match="expected a torchvision model name"):
        jobs.load("resnet50-ddp", ["model=résnet18"])
