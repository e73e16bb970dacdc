"""The communication settings of a job reach the training programs, and bad values are refused clearly."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from cluster.runs import jobs, schema
from cluster.runs.schema import JobError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cluster" / "programs"))
import wlcommon  # noqa: E402


def test_a_value_the_program_would_refuse_is_refused_on_the_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in job's command line goes through the program's own parser before anything starts: a program
    that took at most 5 epochs refuses `--set epochs=6` on the head, naming what it said."""
    real = jobs.program_parser

    def strict() -> argparse.ArgumentParser:
        ap = real()
        for a in ap._actions:
            if a.dest == "epochs":
                a.type = lambda v: int(v) if int(v) <= 5 else int("at most 5")
        return ap

    monkeypatch.setattr(jobs, "program_parser", strict)
    assert jobs.load("resnet50-ddp", ["epochs=5"])["epochs"] == 5
    with pytest.raises(JobError, match="the training program refuses its command line: argument --epochs"):
        jobs.load("resnet50-ddp", ["epochs=6"])
    assert not set(schema.RETIRED) & {a.dest for a in real()._actions}  # retired: gone from the program too


def test_sqrt_scaling_is_linear_up_to_a_workers_batch_then_by_the_square_root() -> None:
    """4 workers of 32: linear gives 4x one worker's rate, sqrt 2x; one worker gets the same by either rule."""
    one = wlcommon.peak_lr(0.01, 32)
    assert one == 0.005 == wlcommon.peak_lr(0.01, 32, "sqrt", 32)
    assert wlcommon.peak_lr(0.01, 128) == pytest.approx(4 * one)
    assert wlcommon.peak_lr(0.01, 128, "sqrt", 32) == pytest.approx(2 * one)
    assert wlcommon.peak_lr(0.01, 128, "sqrt", 128) == pytest.approx(4 * one)  # one process at 128: its own batch


def test_lr_scaling_reaches_the_program_only_where_set_and_a_bad_one_is_refused() -> None:
    ap = argparse.ArgumentParser()
    wlcommon.add_args(ap)
    assert "--lr-scaling" not in jobs.load("resnet50-tf").program_args("/d/x.npz", "out")
    for job in ("resnet50-tf", "resnet18-ddp"):
        args = jobs.load(job, ["optimizer.lr_scaling=sqrt"]).program_args("/d/x.npz", "out")
        assert ap.parse_args(args).lr_scaling == "sqrt"
    with pytest.raises(JobError) as e:
        jobs.load("resnet50-tf", ["optimizer.lr_scaling=log"])
    assert e.value.field == "optimizer.lr_scaling" and "expected linear or sqrt, got 'log'" in str(e.value)
    assert e.value.exit_code == 2 and e.value.fix


def test_a_run_recorded_before_lr_scaling_reads_as_linear() -> None:
    """with_defaults fills a group's keys added since (here the optimizer's), so an older run still compares
    equal to the same job today (the plan's references) and `launch --continue` renders it."""
    old = dict(jobs.load("resnet50-tf").settings)
    old["optimizer"] = {k: v for k, v in old["optimizer"].items() if k != "lr_scaling"}
    filled = jobs.with_defaults(old)
    assert filled["optimizer"]["lr_scaling"] == "linear" and filled == jobs.load("resnet50-tf").settings
    assert "--lr-scaling" not in jobs.from_run("resnet50-tf", old).program_args("/d/x.npz", "out")


def test_default_jobs_pass_no_communication_flags_and_changed_ones_reach_the_program() -> None:
    args = jobs.load("resnet50-ddp").program_args("/d/x.npz", "out")
    assert not any(a.startswith(("--grad-compression", "--accumulate", "--collective-timeout-s")) for a in args)
    spec = jobs.load("resnet50-ddp", ["grad_compression=powersgd", "powersgd_rank=4", "accumulate=3",
                                      "bucket_mb=50", "collective_timeout_s=300"])
    args = spec.program_args("/d/x.npz", "out")
    ap = argparse.ArgumentParser()
    wlcommon.add_args(ap)
    a = ap.parse_args(args)
    assert (a.grad_compression, a.powersgd_rank, a.accumulate, a.bucket_mb, a.collective_timeout_s) == \
           ("powersgd", 4, 3, 50.0, 300.0)
    assert "--bn-recompute" not in args and ap.parse_args(jobs.load("resnet18-ddp", ["bn_recompute=256"]).program_args(
        "/d/x.npz", "out")).bn_recompute == 256  # passed only where set
    assert schema.POWERSGD_WIRES == tuple(wlcommon.POWERSGD_WIRES)
    wired = ["grad_compression=powersgd", "powersgd_wire=bfloat16"]
    assert ap.parse_args(jobs.load("resnet18-ddp", wired).program_args("/d/x.npz", "out")).powersgd_wire == "bfloat16"
    assert "--powersgd-wire" not in jobs.load("resnet18-ddp", ["grad_compression=fp16", "powersgd_wire=bfloat16"]
                                               ).program_args("/d/x.npz", "out")  # PowerSGD's only
    tf = jobs.load("resnet50-tf", ["grad_compression=fp16", "tf_implementation=ring", "tf_bytes_per_pack=4194304"])
    a = ap.parse_args(tf.program_args("/d/x.npz", "out"))
    assert (a.grad_compression, a.tf_implementation, a.tf_bytes_per_pack) == ("fp16", "ring", 4194304)
    tf = jobs.load("resnet50-tf", ["grad_compression=powersgd", "powersgd_rank=4", "powersgd_wire=bfloat16"])
    a = ap.parse_args(tf.program_args("/d/x.npz", "out"))  # TensorFlow has PowerSGD too (tfcomm)
    assert (a.grad_compression, a.powersgd_rank, a.powersgd_wire) == ("powersgd", 4, "bfloat16")


@pytest.mark.parametrize("job, override, field, message", [
    ("resnet50-ddp", "grad_compression=int8", "grad_compression", "expected none, fp16 or powersgd, got 'int8'"),
    ("resnet50-ddp", "powersgd_rank=0", "powersgd_rank", "expected a whole number >= 1"),
    ("resnet50-ddp", "accumulate=0", "accumulate", "expected a whole number >= 1"),
    ("resnet50-ddp", "accumulate=1.5", "accumulate", "expected a whole number >= 1"),
    ("resnet50-ddp", "bucket_mb=-1", "bucket_mb", "expected a number >= 0"),
    ("resnet50-tf", "tf_implementation=mpi", "tf_implementation", "expected auto, ring or nccl"),
    ("resnet50-ddp", "collective_timeout_s=5", "collective_timeout_s", "shorter than a slow step's all-reduce"),
    ("resnet50-ddp", "collective_timeout_s=soon", "collective_timeout_s", "expected a number >= 0"),
    ("resnet50-ddp", "bn_recompute=-1", "bn_recompute", "expected a whole number >= 0"),
    ("resnet50-ddp", "powersgd_wire=fp16", "powersgd_wire", "expected float32 or bfloat16, got 'fp16'"),
])
def test_bad_communication_settings_name_the_field_and_a_fix(job: str, override: str, field: str,
                                                              message: str) -> None:
    with pytest.raises(JobError) as e:
        jobs.load(job, [override])
    assert e.value.field == field and e.value.file == "command line (--set)"
    assert message in str(e.value)
    assert e.value.exit_code == 2 and e.value.fix  # a usage error with a fix


def test_a_bad_setting_in_a_spec_file_names_its_line(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: j\nframework: tensorflow\ngrad_compression: int8\n")
    with pytest.raises(JobError) as e:
        jobs.load(str(f))
    assert str(e.value).startswith(f"{f}:3: grad_compression:")
