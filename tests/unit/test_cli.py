"""The CLI as a user meets it: help, exit codes, JSON, the local inventory (no SSH, no root)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, write

COMMANDS = [["lab"], ["lab", "up"], ["lab", "down"], ["lab", "status"], ["trust"], ["check"], ["exec"], ["provision"],
            ["launch"], ["runs"], ["status"], ["logs"], ["stop"], ["collect"], ["report"], ["study"], ["bench"],
            ["plan"], ["context"]]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster", *args], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ.copy(), timeout=120)


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_command_has_help(cmd: list[str]) -> None:
    r = run(*cmd, "--help")
    assert r.returncode == 0 and "usage: clusterctl" in r.stdout


def local_inventory(tmp_path: Path) -> Path:
    return write(tmp_path, f"""\
defaults: {{connection: local}}
hosts:
  a: {{address: 127.0.0.1, workdir: {tmp_path / 'a'}}}
  b: {{address: 127.0.0.1, workdir: {tmp_path / 'b'}}}
""")


def test_exec_on_local_nodes_json_and_exit_codes(tmp_path: Path) -> None:
    inv = local_inventory(tmp_path)
    r = run("exec", str(inv), "--json", "--", "echo", "$((6*7))")
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert data["command"] == "echo $((6*7))"
    assert [(n["host"], n["stdout"]) for n in data["nodes"]] == [("a", "42\n"), ("b", "42\n")]
    r = run("exec", "-i", str(inv), "--", "exit 5")
    assert r.returncode == 1 and "0 ok, 2 failed, 0 unreachable" in r.stdout
    r = run("exec", str(inv))
    assert r.returncode == 2 and "put it after --" in r.stderr


def test_check_local_nodes(tmp_path: Path) -> None:
    r = run("check", str(local_inventory(tmp_path)), "--json")
    data = json.loads(r.stdout)
    assert [n["status"] for n in data["nodes"]] == ["ok", "ok"]
    assert data["nodes"][0]["facts"]["python"] is not None
    # the project machine's hostname resolves to 127.0.0.1: a warning, not a blocker
    assert r.returncode == (1 if any(p["blocking"] for p in data["problems"]) else 0)


def test_bad_inventory_exits_2_naming_file_line_field(tmp_path: Path) -> None:
    inv = write(tmp_path, "hosts:\n  pc1:\n    address: 10.0.0.1\n    prot: 22\n")
    r = run("check", str(inv))
    assert r.returncode == 2
    assert f"{inv}:4: hosts.pc1.prot: unknown key" in r.stderr and "did you mean 'port'" in r.stderr
    assert r.stdout == ""


def test_context_and_defaults(tmp_path: Path) -> None:
    r = run("context", "--json")
    assert json.loads(r.stdout) == {"inventory": None}
    # no inventory, no context: the embedded local default, said on stderr
    r = run("exec", "--json", "--", "true")
    assert r.returncode == 0 and "embedded default" in r.stderr
    assert [n["host"] for n in json.loads(r.stdout)["nodes"]] == ["local1", "local2"]
    inv = local_inventory(tmp_path)
    assert run("context", str(inv)).returncode == 0
    r = run("exec", "--json", "--", "true")
    assert [n["host"] for n in json.loads(r.stdout)["nodes"]] == ["a", "b"] and "current context" in r.stderr


def test_dash_dash_only_for_exec() -> None:
    r = run("check", "--", "ls")
    assert r.returncode == 2 and "only go with `clusterctl exec`" in r.stderr


# --------------------------------------------------------------------------- exit codes (docs/cli.md)


def closed_port() -> int:
    """A loopback port nobody listens on: bound by us, then released (connecting to it is refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mixed_inventory(tmp_path: Path, local: str = "", gone: bool = True) -> Path:
    """Local nodes (`local` extra fields) and, with `gone`, an SSH node on a closed loopback port."""
    hosts = f"  a: {{connection: local, address: 127.0.0.1, workdir: {tmp_path / 'a'}{local}}}\n"
    if gone:
        hosts += f"  gone: {{address: 127.0.0.1, port: {closed_port()}, connect_timeout: 3}}\n"
    return write(tmp_path, f"defaults: {{known_hosts: {tmp_path / 'known_hosts'}}}\nhosts:\n{hosts}")


def only_gone(tmp_path: Path) -> Path:
    return write(tmp_path, f"defaults: {{known_hosts: {tmp_path / 'known_hosts'}}}\nhosts:\n"
                           f"  gone: {{address: 127.0.0.1, port: {closed_port()}, connect_timeout: 3}}\n")


def test_check_exit_3_unreachable_1_blocking_0_ok(tmp_path: Path) -> None:
    r = run("check", str(mixed_inventory(tmp_path)), "--json")
    assert r.returncode == 3, r.stderr
    assert {n["host"]: n["status"] for n in json.loads(r.stdout)["nodes"]} == {"a": "ok", "gone": "unreachable"}
    # reachable, with a blocking problem (no Python there): 1
    r = run("check", str(mixed_inventory(tmp_path, ", python: /nonexistent/python3", gone=False)))
    assert r.returncode == 1 and "python-missing" not in r.stderr and "does not run on the node" in r.stdout
    # both at once: unreachable wins
    r = run("check", str(mixed_inventory(tmp_path, ", python: /nonexistent/python3")))
    assert r.returncode == 3


def test_exec_exit_3_when_a_node_is_unreachable_even_if_others_failed(tmp_path: Path) -> None:
    r = run("exec", str(mixed_inventory(tmp_path)), "--json", "--", "true")
    assert r.returncode == 3
    assert [n["status"] for n in json.loads(r.stdout)["nodes"]] == ["ok", "unreachable"]
    r = run("exec", str(mixed_inventory(tmp_path)), "--", "exit 5")
    assert r.returncode == 3 and "0 ok, 1 failed, 1 unreachable" in r.stdout


def two_gone(tmp_path: Path) -> Path:
    """Two SSH nodes on a closed loopback port: `poweroff` selects them and reaches none (nothing goes off)."""
    port = closed_port()
    return write(tmp_path, f"defaults: {{known_hosts: {tmp_path / 'known_hosts'}}}\nhosts:\n" + "".join(
        f"  {n}: {{address: 127.0.0.1, port: {port}, connect_timeout: 3}}\n" for n in ("g1", "g2")), "gone.yaml")


def test_wake_and_poweroff_take_inventory_and_limit_as_every_node_command(tmp_path: Path) -> None:
    """`wake INVENTORY --limit PATTERN`, as check and exec; `-i INVENTORY PATTERN` (a positional that is no file)
    works too. poweroff meets only the unreachable SSH nodes here: never the local ones."""
    inv, gone = str(local_inventory(tmp_path)), str(two_gone(tmp_path))
    for shape in ([inv, "--limit", "b"], ["-i", inv, "b"], ["--limit", "b", "-i", inv]):
        r = run("wake", *shape, "--json")
        assert r.returncode == 0, r.stderr
        assert [(w["host"], w["status"]) for w in json.loads(r.stdout)["wake"]] == [("b", "up")]
    r = run("wake", inv, "--json")
    assert r.returncode == 0 and [w["host"] for w in json.loads(r.stdout)["wake"]] == ["a", "b"]
    for shape in ([gone, "--limit", "g2"], ["-i", gone, "g2"]):
        r = run("poweroff", *shape, "--json")
        assert r.returncode == 3, r.stderr
        assert [(p["host"], p["status"]) for p in json.loads(r.stdout)["poweroff"]] == [("g2", "unreachable")]


def test_wake_and_poweroff_say_how_to_name_the_inventory_and_the_hosts_once(tmp_path: Path) -> None:
    inv, gone = str(local_inventory(tmp_path)), str(two_gone(tmp_path))
    r = run("poweroff", "g1", "-i", gone, "--limit", "g2")
    assert r.returncode == 2 and "'g1' is no inventory file, and --limit 'g2' names the hosts too" in r.stderr
    assert "clusterctl poweroff INVENTORY --limit PATTERN" in r.stderr
    r = run("wake", str(tmp_path / "typo.yaml"), "--limit", "b")
    assert r.returncode == 2 and "typo.yaml: no such inventory file" in r.stderr, r.stderr
    r = run("wake", inv, "-i", gone)
    assert r.returncode == 2 and "two inventories given" in r.stderr, r.stderr
    r = run("poweroff", "--help")
    assert r.returncode == 0 and "[INVENTORY]" in r.stdout and "--limit PATTERN" in r.stdout


def test_trust_exit_3_unreachable_0_local(tmp_path: Path) -> None:
    r = run("trust", str(only_gone(tmp_path)), "--yes")
    assert r.returncode == 3 and "unreachable" in r.stdout and "refused the connection" in r.stderr
    r = run("trust", str(mixed_inventory(tmp_path, gone=False)), "--yes")
    assert r.returncode == 0 and "local" in r.stdout


def test_provision_exit_3_unreachable_1_failed(tmp_path: Path) -> None:
    r = run("provision", str(only_gone(tmp_path)), "--dry-run", "--json")
    assert r.returncode == 3
    assert [(n["host"], n["status"]) for n in json.loads(r.stdout)["nodes"]] == [("gone", "unreachable")]
    assert json.loads(r.stdout)["wall_s"] >= 0  # what the user waited, beside each node's own step times
    # reachable but its Python does not run: the node failed (1); nothing is installed in a dry run
    r = run("provision", str(mixed_inventory(tmp_path, ", python: /nonexistent/python3", gone=False)),
            "--dry-run", "--json")
    assert r.returncode == 1
    node = json.loads(r.stdout)["nodes"][0]
    assert node["status"] == "failed" and "does not run on the node" in node["error"]
    r = run("provision", str(mixed_inventory(tmp_path, ", python: /nonexistent/python3")), "--dry-run")
    assert r.returncode == 3 and "dry run took " in r.stdout and " s in all" in r.stdout


def test_bench_exit_1_when_reachable_nodes_are_not_provisioned(tmp_path: Path) -> None:
    r = run("bench", "-i", str(mixed_inventory(tmp_path, gone=False)), "--jobs", "resnet50-ddp")
    assert r.returncode == 1 and "not provisioned" in r.stderr


def test_bench_exit_3_when_a_node_is_unreachable(tmp_path: Path) -> None:
    r = run("bench", "-i", str(mixed_inventory(tmp_path)), "--jobs", "resnet50-ddp")
    assert r.returncode == 3 and "cannot reach gone" in r.stderr


def test_launch_exit_3_when_a_node_is_unreachable(tmp_path: Path) -> None:
    r = run("launch", "resnet50-ddp", "-i", str(mixed_inventory(tmp_path)), "--dry-run")
    assert r.returncode == 3 and "cannot reach gone" in r.stderr


def test_launch_exit_1_when_reachable_nodes_are_not_provisioned(tmp_path: Path) -> None:
    r = run("launch", "resnet50-ddp", "-i", str(mixed_inventory(tmp_path, gone=False)), "--dry-run")
    assert r.returncode == 1 and "not provisioned" in r.stderr


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    r = run("check", "--forks", "many")
    assert r.returncode == 2 and "argument --forks: expected a whole number, got 'many'" in r.stderr
    r = run("nosuchcommand")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    for args in (("exec", "--timeout", "1e300", "--", "true"), ("exec", "--timeout", "nan", "--", "true"),
                 ("stop", "--grace", "1e300")):  # a wait past a day, or not a number: refused, never sent
        r = run(*args)
        assert r.returncode == 2 and "expected" in r.stderr and "<=" in r.stderr, (args, r.stderr)
    r = run("launch", "resnet50-ddp", "-i", str(mixed_inventory(tmp_path)), "--set", "epochs=zero", "--dry-run")
    assert r.returncode == 2 and "epochs: expected a whole number >= 1 and <= 10000, got 'zero'" in r.stderr
    assert "Traceback" not in r.stderr


def test_nan_and_infinity_are_usage_errors_on_the_command_line(tmp_path: Path) -> None:
    """`launch --dry-run` accepted optimizer.lr=.nan and batch=10^22; an argument type takes no `nan` either."""
    inv = str(mixed_inventory(tmp_path))
    for setting, message in (("optimizer.lr=.nan", "optimizer.lr: expected a finite number > 0 and <= 10, got nan"),
                             ("batch=10000000000000000000000", "batch: expected a whole number <= 65536")):
        r = run("launch", "resnet50-ddp", "-i", inv, "--set", setting, "--dry-run")
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run("exec", inv, "--timeout", "nan", "--", "true")
    assert r.returncode == 2 and "argument --timeout: expected a finite number > 0 and <= 86400, got 'nan'" in r.stderr, r.stderr
    r = run("report", "--target-acc", "inf")
    assert r.returncode == 2 and "expected a finite number > 0 and <= 1, got 'inf'" in r.stderr, r.stderr


@pytest.mark.parametrize("argv", [["exec", "--timeout", "-1", "--", "true"], ["check", "--forks", "0"],
                                  ["logs", "-n", "-3"], ["bench", "--steps", "0"], ["stop", "--grace", "nan"],
                                  ["study", "resnet50-ddp", "--nodes", "a"], ["lab", "up", "0"]])
def test_numbers_out_of_range_exit_2_before_anything_runs(argv: list[str]) -> None:
    r = run(*argv)
    assert r.returncode == 2 and "expected" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_lab_without_root_exits_4(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`lab up` as a user without root: exit 4, the reason and the way out (the euid is the only thing
    changed: this interpreter lives under /root, out of reach of a real unprivileged user)."""
    from cluster import cli
    from cluster.lab import lifecycle

    monkeypatch.setattr(lifecycle.os, "geteuid", lambda: 1000)
    assert cli.main(["lab", "up", "1", "--name", "tnoroot"]) == 4
    e = capsys.readouterr().err
    assert "needs root" in e and "inventory/local.yaml" in e and "Traceback" not in e


def test_internal_error_is_one_line_exit_70_traceback_with_debug(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A bug (an exception that is not a ClusterError) reaches the user as one line and exit 70."""
    from cluster import cli
    from cluster.cli import context as context_command

    def broken(args: object) -> int:
        raise KeyError("surprise")

    monkeypatch.setattr(context_command, "cmd_context", broken)
    assert cli.main(["context"]) == 70
    e = capsys.readouterr().err
    assert "internal error: KeyError: 'surprise'" in e and "CLUSTERCTL_DEBUG=1" in e and "Traceback" not in e
    monkeypatch.setenv("CLUSTERCTL_DEBUG", "1")
    assert cli.main(["context"]) == 70
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None, reason="runs the CLI as user nobody")
def test_a_clusterctl_home_this_user_cannot_use_is_refused_naming_it(tmp_path: Path) -> None:
    """Root's CLUSTERCTL_HOME inherited by another user (sudo -u, runuser): a refusal naming the folder and
    the way out, exit 4, not an internal error."""
    from tests.integration.conftest import as_user

    home = tmp_path / "roots-home"
    (home / "runs").mkdir(parents=True)
    home.chmod(0o700)
    r = subprocess.run([*as_user("nobody"), sys.executable, "-m", "cluster", "runs"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CLUSTERCTL_HOME": str(home)})
    said = " ".join(r.stderr.split())
    assert r.returncode == 4 and f"permission denied: {home}" in said, r.stderr
    assert f"{home} (CLUSTERCTL_HOME) holds clusterctl's records, and user nobody cannot use it" in said, said
    assert "internal error" not in said and "Traceback" not in said


def test_interrupt_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster import cli
    from cluster.cli import context as context_command

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(context_command, "cmd_context", interrupted)
    assert cli.main(["context"]) == 130 and "interrupted" in capsys.readouterr().err


def test_main_returns_argparse_codes_instead_of_exiting(capsys: pytest.CaptureFixture[str]) -> None:
    from cluster import cli

    assert cli.main(["--version"]) == 0
    assert cli.main(["check", "--forks", "x"]) == 2
    assert "argument --forks: expected a whole number" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["runs", "--json"], ["status"], ["status", "nosuch"], ["logs", "nosuch"],
                                  ["stop", "nosuch"], ["collect", "nosuch"], ["report"], ["context", "/nonexistent"]])
def test_no_such_run_or_file_exits_2(argv: list[str]) -> None:
    """An empty $CLUSTERCTL_HOME: naming a run that is not there (or none) is bad input; listing is fine."""
    r = run(*argv)
    if argv[0] == "runs":
        assert r.returncode == 0 and json.loads(r.stdout) == []
    else:
        assert r.returncode == 2 and "fix:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_plan_and_launch_plan_without_a_benchmark_exit_1(tmp_path: Path) -> None:
    inv = str(mixed_inventory(tmp_path, gone=False))
    r = run("plan", "resnet50-ddp", "-i", inv)
    assert r.returncode == 1 and "no benchmark" in r.stderr and "clusterctl bench" in r.stderr
    r = run("launch", "resnet50-ddp", "-i", inv, "--plan")
    assert r.returncode == 1 and "no plan for resnet50-ddp" in r.stderr


def test_study_exit_1_when_a_cell_did_not_succeed(tmp_path: Path) -> None:
    r = run("study", "resnet50-ddp", "--nodes", "1", "-i", str(only_gone(tmp_path)), "--json")
    assert r.returncode == 1
    cells = json.loads(r.stdout)["cells"]
    assert [(c["nodes"], c["state"]) for c in cells] == [(1, "error")] and "cannot reach" in cells[0]["error"]


def test_lab_status_of_a_lab_that_is_not_up_exits_1() -> None:
    r = run("lab", "status", "--name", "nolab", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["up"] is False


# --------------------------------------------------------------------------- the package: help and lazy imports


def test_top_level_help_says_what_the_tool_is_and_the_order_of_work() -> None:
    r = run("--help")
    assert r.returncode == 0 and "distributed" in r.stdout and "deep learning" in r.stdout
    order = r.stdout[r.stdout.index("the order of work"):]
    steps = ["lab up", "trust", "check", "provision", "launch", "collect", "report"]
    at = [order.index(f"clusterctl {s}") for s in steps]
    assert at == sorted(at)
    assert "clusterctl bench" in order and "clusterctl plan" in order and "--plan" in order


def test_every_command_is_in_the_top_level_help_and_has_a_module() -> None:
    from cluster import cli

    r = run("--help")
    for name in cli.COMMANDS:
        assert f"\n    {name}" in r.stdout
    for name in cli.COMMANDS:  # each group module declares its commands' arguments and handlers
        parser = cli.build_parser(name)
        args = parser.parse_args([name, "up", "1"] if name == "lab" else
                                 [name, "x"] if name in ("launch", "plan", "study") else [name])
        assert callable(args.fn)


IMPORTED = ("import sys, json; from cluster.cli import main; main({argv!r}); "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('cluster', 'rich')))))")
GROUPS = {"cluster.cli.lab", "cluster.cli.nodes", "cluster.cli.provision", "cluster.cli.runs", "cluster.cli.results",
          "cluster.cli.bench", "cluster.cli.context"}
HEAVY = {"rich.live", "rich.progress", "cluster.runs.launch", "cluster.study.report", "cluster.provision.apply", "cluster.planner.bench",
         "cluster.planner.placement", "cluster.study.matrix", "cluster.lab.lifecycle"}


@pytest.mark.parametrize("argv, own", [(["--help"], None), (["exec", "--help"], "cluster.cli.nodes"),
                                       (["exec", "--json", "--", "true"], "cluster.cli.nodes")],
                         ids=["help", "exec help", "exec"])
def test_a_command_imports_its_own_group_only(argv: list[str], own: str | None) -> None:
    """pip's lazy commands: `--help` needs no command module (nor rich), `exec` only its own group."""
    r = subprocess.run([sys.executable, "-c", IMPORTED.format(argv=argv)], capture_output=True, text=True, cwd=ROOT,
                       env=os.environ.copy(), timeout=120)
    modules = set(json.loads(r.stdout.splitlines()[-1]))
    assert modules & GROUPS == ({own} if own else set())
    assert not modules & HEAVY, modules & HEAVY
    if own is None:
        assert not any(m.startswith("rich") for m in modules) and "cluster.cli.output" not in modules


def test_report_writes_the_pages_asked_for_with_the_target_accuracy(tmp_path: Path) -> None:
    from tests.unit.test_collect_report import _write_run

    _write_run(Path(os.environ["CLUSTERCTL_HOME"]), "one", ["a"], [50.0, 60.0, 62.0], [0.2, 0.6, 0.7])
    md = tmp_path / "pages" / "r.md"
    r = run("report", "one", "--json", "--target-acc", "0.5", "--markdown", str(md))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["runs"][0]["target_acc"] == 0.5 and doc["written"] == [str(md.resolve())] and md.exists()
    r = run("report", "one", "--target-acc", "90")  # a percentage where a fraction is meant
    assert r.returncode == 2 and "expected a number > 0 and <= 1, got '90'" in r.stderr


def test_dry_run_checks_the_env_from_sources_before_any_node(tmp_path: Path) -> None:
    """`launch --dry-run` reads every env_from source as launch would (and says which one is missing),
    before contacting a node: the unreachable node of this inventory would give exit 3 otherwise."""
    inv = mixed_inventory(tmp_path)
    r = run("launch", "resnet50-ddp", "-i", str(inv), "--dry-run", "--set", f"env_from.TOKEN={{file: {tmp_path / 'nope'}}}")
    assert r.returncode == 2 and "env_from.TOKEN: cannot read" in r.stderr, r.stderr
    r = run("launch", "resnet50-ddp", "-i", str(inv), "--dry-run", "--set", "env_from.TOKEN={env: CLUSTERCTL_NO_SUCH_VAR}")
    assert r.returncode == 2 and "has no CLUSTERCTL_NO_SUCH_VAR" in r.stderr, r.stderr
    os.mkfifo(tmp_path / "fifo")  # read without blocking: refused for what it is
    r = run("launch", "resnet50-ddp", "-i", str(inv), "--dry-run", "--set", f"env_from.TOKEN={{file: {tmp_path / 'fifo'}}}")
    assert r.returncode == 2 and "env_from.TOKEN: cannot read" in r.stderr and "named pipe (FIFO)" in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["device", "loop", "fifo", "broken"])
def test_dry_run_refuses_data_that_cannot_be_shipped_before_any_node(tmp_path: Path, kind: str) -> None:
    """`--data` is read on the head in `prepare`, before any node is contacted (this inventory's second node is
    unreachable: exit 3 otherwise) and before the code upload: a device, a link loop, a FIFO, a broken link."""
    code = tmp_path / "prog"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    data = tmp_path / "data"
    if kind == "device":
        data = Path("/dev/zero")
    elif kind == "loop":
        data.symlink_to(data)
    elif kind == "fifo":
        os.mkfifo(data)
    else:
        data.symlink_to(tmp_path / "nowhere")
    r = run("launch", "-i", str(mixed_inventory(tmp_path)), "--dry-run", "--code", str(code), "--data", str(data),
            "--", "python", "train.py")
    want = {"device": "is a character device: only a regular file or a folder", "loop": "leads back to itself (a loop)",
            "fifo": "is a named pipe (FIFO): only a regular file or a folder", "broken": "no file or folder"}[kind]
    assert r.returncode == 2 and "data: " in r.stderr and str(data) in r.stderr and want in r.stderr, r.stderr


def test_a_students_command_shape_mistakes_get_the_corrected_command_before_anything_starts(tmp_path: Path) -> None:
    """`launch -- train.py`, `launch python train.py` (no `--`) and `launch train.py`: exit 2 with the command
    that works, before any node is contacted (the inventory given names a node that cannot be reached)."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    inv = str(mixed_inventory(tmp_path))

    def launch(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cluster", "launch", "-i", inv, "--code", str(tmp_path), *argv],
                              capture_output=True, text=True, cwd=tmp_path, env=os.environ.copy(), timeout=120)

    r = launch("--", "train.py", "--steps", "3")
    assert r.returncode == 2 and "fix: clusterctl launch -- python train.py --steps 3" in r.stderr, r.stderr
    r = launch("python", "train.py", "--steps", "3")
    assert r.returncode == 2 and "goes after `--`: clusterctl launch -- python train.py --steps 3" in r.stderr
    r = launch("train.py")
    assert r.returncode == 2 and "train.py is a program, not a job spec" in r.stderr
    assert "clusterctl launch -- python train.py" in r.stderr
    assert all("cannot reach" not in x for x in (r.stderr, r.stdout))
    r = launch("resnet50-ddp", "extra")  # a job with a stray word: no program hint
    assert r.returncode == 2 and "unrecognized arguments: extra" in r.stderr and "--`" not in r.stderr


def test_a_student_with_no_inventory_is_pointed_at_the_room_not_at_provisioning_this_machine(tmp_path: Path) -> None:
    """No -i, no $CLUSTERCTL_INVENTORY, no context: the embedded inventory (this machine) is not provisioned,
    and the message says how to name the room's inventory, exit 2."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    env = {k: v for k, v in os.environ.items() if k != "CLUSTERCTL_INVENTORY"}
    env |= {"HOME": str(tmp_path / "home"), "CLUSTERCTL_HOME": str(tmp_path / "ch")}
    r = subprocess.run([sys.executable, "-m", "cluster", "launch", "--", "python", "train.py"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    for fix in ("clusterctl context ROOM.yaml", "-i ROOM.yaml", "CLUSTERCTL_INVENTORY=ROOM.yaml", "admin"):
        assert fix in r.stderr, r.stderr


def test_an_error_in_a_value_given_by_an_option_names_no_set(tmp_path: Path) -> None:
    """`--outputs ../x` is named as the command line, not as a --set the user never typed; a --set still is."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    r = run("launch", "--code", str(tmp_path), "--outputs", "../x", "--", "python", "train.py")
    assert r.returncode == 2 and "error: command line: outputs:" in r.stderr and "--set" not in r.stderr, r.stderr
    r = run("launch", "--code", str(tmp_path), "--set", "outputs=[../x]", "--", "python", "train.py")
    assert r.returncode == 2 and "error: command line (--set): outputs:" in r.stderr, r.stderr


def test_every_command_readme_names_has_help_and_json_but_completion() -> None:
    """README: "Every command has `--help`, and every one but `completion` has `--json`": held for each command
    README names (and each subcommand of those that have them)."""
    import re

    from cluster.cli import build_parser

    named = set(re.findall(r"`clusterctl ([a-z]+)", (ROOT / "README.md").read_text()))
    assert {"launch", "provision", "collect", "report"} <= named, named
    words: list[list[str]] = []
    for name in sorted(named):
        sub = next(a for a in build_parser(name)._actions if a.dest == "cmd")
        child = sub.choices[name]._subparsers  # type: ignore[attr-defined]
        subs = next((a for a in child._group_actions if a.choices), None) if child else None
        words += [[name, s] for s in subs.choices] if subs else [[name]]
    for w in words:
        r = run(*w, "--help")
        assert r.returncode == 0, (w, r.stderr)
        assert (" --json" in r.stdout) == (w != ["completion"]), (w, r.stdout[:300])
