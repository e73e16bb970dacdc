"""Job specs: defaults, overrides, and errors that name the file, line, field and fix."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.runs import jobs, schema
from cluster.runs.schema import JobError


def test_shipped_jobs_load_and_differ_only_where_the_frameworks_do() -> None:
    ddp, tf = jobs.load("resnet50-ddp"), jobs.load("resnet50-tf")
    assert (ddp.framework, ddp.entry, tf.framework, tf.entry) == ("pytorch", "train_torch.py", "tensorflow", "train_tf.py")
    same = {k for k in ddp.settings if ddp[k] == tf[k]}
    assert same >= {"dataset", "epochs", "batch", "optimizer", "seed", "nodes", "threads"}  # one study
    assert set(jobs.available()) >= {"resnet50-ddp", "resnet50-tf"}


def test_overrides_reach_nested_settings_and_env() -> None:
    spec = jobs.load("resnet50-ddp", ["epochs=2", "optimizer.lr=0.05", "env.NCCL_DEBUG=INFO", "nodes=[pc1, pc2]"])
    assert spec["epochs"] == 2 and spec["optimizer"]["lr"] == 0.05 and spec["optimizer"]["momentum"] == 0.9
    assert spec["env"] == {"NCCL_DEBUG": "INFO"} and spec["nodes"] == ["pc1", "pc2"]
    args = spec.program_args("/d/x.npz", "out")
    assert args[args.index("--lr") + 1] == "0.05" and args[args.index("--epochs") + 1] == "2"


@pytest.mark.parametrize("text, where, message", [
    ("epochs: two\n", ":4: epochs", "expected a whole number >= 1 and <= 10000, got 'two'"),
    ("optimizer: {lr: 0}\n", ":4: optimizer.lr", "expected a number > 0"),
    ("batchsize: 32\n", ":4: batchsize", "unknown setting"),
    ("dataset: {name: imagenet}\n", ":4: dataset.name", "expected one of digits, digits-aug, cifar10"),
    ("dataset: {name: cifar10}\n", ": dataset.path", "cifar10 needs an existing path on the head"),
    ("env: {1BAD: x}\n", ": env.1BAD", "not a valid environment variable name"),
    ("procs_per_node: 0\n", ":4: procs_per_node", "expected auto or a whole number >= 1"),
    ("nodes: []\n", ":4: nodes", "expected all, a group name or a list of host names"),
])
def test_bad_specs_name_file_line_and_field(tmp_path: Path, text: str, where: str, message: str) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("# a job\nname: j\nframework: pytorch\n" + text)
    with pytest.raises(JobError) as e:
        jobs.load(str(f))
    assert f"{f}{where}: {message}" in e.value.message and e.value.fix


def test_bad_override_says_it_came_from_the_command_line() -> None:
    with pytest.raises(JobError, match=r"^command line \(--set\): batch: expected a whole number >= 1, got -3"):
        jobs.load("resnet50-ddp", ["batch=-3"])
    with pytest.raises(JobError, match="settable keys: .*optimizer.lr"):
        jobs.load("resnet50-ddp", ["optimizer.lrate=1"])



def test_a_nul_byte_in_a_setting_is_refused_naming_it() -> None:
    """It would reach the node's launch script, whose shell drops it, or a Slurm argv (ValueError)."""
    for override, field in (('args=["a\\0"]', "args[0]"), ("env.X=a\0", "env.X"), ('env={A: "\\0"}', "env.A")):
        with pytest.raises(JobError, match=rf"^command line \(--set\): {re.escape(field)}: holds a NUL byte"):
            jobs.load("resnet50-ddp", [override])

def test_unknown_job_lists_the_known_ones() -> None:
    with pytest.raises(JobError, match="cannot read the job spec") as e:
        jobs.load("resnet51")
    assert "resnet50-ddp" in (e.value.fix or "")


@pytest.mark.parametrize("override, message", [
    ("optimizer.lr=.nan", "optimizer.lr: expected a finite number > 0 and <= 10, got nan"),
    ("optimizer.lr=.inf", "optimizer.lr: expected a finite number > 0 and <= 10, got inf"),
    ("optimizer.lr=11", "optimizer.lr: expected a number <= 10, got 11"),
    ("optimizer.momentum=.nan", "optimizer.momentum: expected a finite number >= 0 and < 1, got nan"),
    ("optimizer.momentum=1", "optimizer.momentum: expected a number < 1, got 1"),
    ("optimizer.weight_decay=-.inf", "optimizer.weight_decay: expected a finite number >= 0 and <= 1, got -inf"),
    ("optimizer.warmup_epochs=.nan", "optimizer.warmup_epochs: expected a finite number"),
    ("collective_timeout_s=.nan", "collective_timeout_s: expected a finite number >= 0 and <= 86400, got nan"),
    ("collective_timeout_s=.inf", "collective_timeout_s: expected a finite number >= 0 and <= 86400, got inf"),
    ("bucket_mb=.nan", "bucket_mb: expected a finite number >= 0 and <= 4096, got nan"),
    ("batch=10000000000000000000000", "batch: expected a whole number <= 65536, got 10000000000000000000000"),
    ("batch=.nan", "batch: expected a whole number >= 1 and <= 65536, got nan"),
    ("epochs=.inf", "epochs: expected a whole number >= 1 and <= 10000, got inf"),
    ("seed=4294967296", "seed: expected a whole number <= 4294967295, got 4294967296"),
    ("port=70000", "port: expected a whole number <= 65535, got 70000"),
    ("accumulate=1025", "accumulate: expected a whole number <= 1024, got 1025"),
    ("procs_per_node=.nan", "procs_per_node: expected auto or a whole number >= 1 and <= 64, got nan"),
    ("shares={pc1: .nan}", "shares.pc1: expected a whole number >= 1 and <= 65536"),
    ("target_acc=1.5", "target_acc: expected a number <= 1, got 1.5"),
    ("max_epochs=-1", "max_epochs: expected a whole number >= 0"),
])
def test_numbers_must_be_finite_and_within_their_bounds(override: str, message: str) -> None:
    """NaN compared false with every bound and passed `launch --dry-run`; infinity or 10^22 reached the nodes."""
    with pytest.raises(JobError) as e:
        jobs.load("resnet50-ddp", [override])
    assert message in e.value.message and e.value.exit_code == 2 and e.value.fix
    if e.value.field in schema.NUMBERS and e.value.field != "procs_per_node":  # the fix: a valid value, the range
        assert f"{e.value.field} is {schema.NUMBERS[e.value.field]}" in e.value.fix


def test_a_nan_in_a_spec_file_names_its_line(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: j\nframework: pytorch\noptimizer:\n  lr: .nan\n")
    with pytest.raises(JobError, match=r":4: optimizer.lr: expected a finite number"):
        jobs.load(str(f))


def test_the_bounds_keep_the_values_people_use() -> None:
    spec = jobs.load("resnet50-ddp", ["optimizer.lr=10", "optimizer.momentum=0.99", "batch=65536", "bucket_mb=1000",
                                      "collective_timeout_s=86400", "seed=4294967295", "tf_bytes_per_pack=4194304"])
    assert spec["optimizer"]["lr"] == 10 and spec["batch"] == 65536 and spec["bucket_mb"] == 1000


def test_a_retired_setting_or_value_is_refused_naming_where_and_what_replaces_it(tmp_path: Path) -> None:
    """grad_compression: localsgd and its two settings are retired (docs/jobs.md "Retired settings"): a spec
    file or --set that names one stops with exit 2, the file and line (or the command line), the field and
    what to use instead; a run recorded with one reads as today's job without it."""
    f = tmp_path / "job.yaml"
    for text, line, field in (("grad_compression: localsgd\n", 4, "grad_compression"),
                              ("localsgd_period: 8\n", 4, "localsgd_period"),
                              ("grad_compression: powersgd\nlocalsgd_start_step: 1\n", 5, "localsgd_start_step")):
        f.write_text("# a job\nname: j\nframework: pytorch\n" + text)
        with pytest.raises(JobError) as e:
            jobs.load(str(f))
        assert (e.value.file, e.value.line, e.value.field, e.value.exit_code) == (str(f), line, field, 2)
        assert "retired" in e.value.message and "grad_compression: powersgd" in (e.value.fix or ""), e.value
    for override, field in (("grad_compression=localsgd", "grad_compression"), ("localsgd_period=16", "localsgd_period"),
                            ("localsgd_start_step=0", "localsgd_start_step")):
        with pytest.raises(JobError) as e:
            jobs.load("resnet50-tf", [override])
        assert (e.value.file, e.value.field, e.value.exit_code) == ("command line (--set)", field, 2)
        assert str(e.value).startswith(f"command line (--set): {field}: ") and "retired" in str(e.value)
        assert 'docs/jobs.md "Retired settings"' in (e.value.fix or "")
    old = {**jobs.load("resnet50-ddp").settings, "localsgd_period": 8, "localsgd_start_step": 0}
    assert jobs.with_defaults(old) == jobs.load("resnet50-ddp").settings  # an older run, the same job
    with pytest.raises(JobError, match="'localsgd' is retired"):
        jobs.from_run("resnet50-ddp", {**old, "grad_compression": "localsgd"})  # launch --continue of such a run


def test_a_launcher_that_is_not_a_name_is_refused_by_field(tmp_path: Path) -> None:
    """Found by test_no_traceback's fuzzing: `launcher: [null]` on a program of one's own was a TypeError."""
    (tmp_path / "train.py").write_text("print(1)\n")
    with pytest.raises(JobError, match="launcher: expected one of"):
        jobs.from_command(["python", "train.py"], tmp_path, "torchrun", None, ["launcher=[null]"])


def test_training_until_a_target_needs_the_target_and_room_past_epochs_and_reaches_the_program() -> None:
    """max_epochs means nothing without target_acc and cannot be below epochs: refused with the fix. Given,
    both reach the built-in program's command line (only then: the defaults pass nothing)."""
    with pytest.raises(JobError, match="max_epochs: 6 epochs at most, but no target_acc") as e:
        jobs.load("resnet50-ddp", ["max_epochs=6"])
    assert "target_acc: 0.98" in e.value.fix
    with pytest.raises(JobError, match=r"max_epochs: 3 is below epochs \(4\)") as e:
        jobs.load("resnet50-ddp", ["target_acc=0.9", "max_epochs=3"])
    assert "max_epochs: 12" in e.value.fix
    args = jobs.load("resnet50-ddp", ["target_acc=0.98", "max_epochs=12"]).program_args("d.npz", "out")
    assert args[args.index("--target-acc") + 1] == "0.98" and args[args.index("--max-epochs") + 1] == "12"
    plain = jobs.load("resnet50-ddp").program_args("d.npz", "out")
    assert "--target-acc" not in plain and "--max-epochs" not in plain


def _settings_keys() -> list[str]:
    """Every key a spec may hold, dotted inside a group (optimizer.lr), from the schema itself."""
    keys: list[str] = []
    for k, v in schema.DEFAULTS.items():
        keys += [f"{k}.{sub}" for sub in v] if isinstance(v, dict) and k not in schema.FREE_MAPS else [k]
    return keys


def test_docs_jobs_md_has_a_row_for_every_setting_and_no_row_for_another() -> None:
    """docs/jobs.md's settings tables against the schema (schema.DEFAULTS): a key added without its row, or a row
    left after its key went (retired keys have a table of their own), fails here."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "jobs.md").read_text()
    own = doc.split("## Your own program", 1)[1].split("\n## ", 1)[0]
    reference = doc.split("\n## Settings", 1)[1].split("\n## ", 1)[0]
    rows: set[str] = set()
    for section in (own, reference):
        for line in section.splitlines():
            if line.startswith("| `"):
                rows |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    keys = _settings_keys()
    assert [k for k in keys if k not in rows] == []
    launchers = set(schema.LAUNCHERS)  # "Your own program" also has a table of the launchers
    assert sorted(rows - set(keys) - launchers) == []


def test_a_specs_relative_code_and_data_are_its_folders_wherever_launch_runs(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/jobs.md's example says `code: .`: the spec's folder, not the folder launch happens to run in."""
    proj = tmp_path / "proj"
    (proj / "in").mkdir(parents=True)
    (proj / "train.py").write_text("print(1)\n")
    (proj / "in" / "x.csv").write_text("1\n")
    (proj / "mine.yaml").write_text("name: m\ncode: .\nprogram: train.py\ndata: in\n")
    monkeypatch.chdir(tmp_path)  # elsewhere
    spec = jobs.load(str(proj / "mine.yaml"))
    assert (spec["code"], spec["data"]) == (str(proj.resolve()), str((proj / "in").resolve()))
    (tmp_path / "in").mkdir()
    spec = jobs.load(str(proj / "mine.yaml"), ["data=in"])  # --set: the command line's folder
    assert spec["data"] is not None and Path(spec["data"]).resolve() == (tmp_path / "in").resolve()
