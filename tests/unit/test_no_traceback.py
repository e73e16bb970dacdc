"""No input reaches a user as a traceback: generated job specs, `--set` values, inventories and run records.

Property-based (hypothesis): each input either works or is refused with exit 2 and a message that names
the file (or the command line) and the field. Any other exception, or the CLI's "internal error" (exit 70),
is a bug this test exists to find. No node is contacted: the one inventory the CLI sees points at a closed
port on 127.0.0.1, and generated inventories and records are only read.
"""
from __future__ import annotations

import contextlib
import io
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster import cli, errors
from cluster.runs import jobs, nodestatus, preflight, records as runs, render, schema
from cluster.nodes.replies import agent_reply
from cluster.inventory import loader as inventory, model

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CLI = settings(FAST, max_examples=60)

# --------------------------------------------------------------------------- strategies

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                      max_leaves=6)
WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_ABC019.-/~", min_size=1, max_size=10)
BASE_SPEC: dict[str, Any] = yaml.safe_load((schema.JOBS_DIR / "resnet50-ddp.yaml").read_text())
GROUPS = {k: list(v) for k, v in schema.DEFAULTS.items() if isinstance(v, dict) and k not in schema.FREE_MAPS}
SETTABLE = [k for k in schema.DEFAULTS] + [f"{g}.{s}" for g, subs in GROUPS.items() for s in subs] \
    + ["env.A_B", "env.1x", "shares.pc1", "env_from.TOKEN", "dataset.name.x", "nosuch", "optimizer.nosuch"]


def yaml_text(value: Any) -> str:
    """How a user would write `value` after `--set key=`: flow-style YAML on one line."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[:-3].strip() if text.endswith("...") else text


@st.composite
def spec_docs(draw: st.DrawFn) -> dict[str, Any]:
    """The shipped spec with a few settings replaced by anything, sub-settings included, plus unknown keys."""
    doc = json.loads(json.dumps(BASE_SPEC))
    for key in draw(st.lists(st.sampled_from([*schema.DEFAULTS, "nosuch"]), max_size=3)):
        if key in GROUPS and draw(st.booleans()):
            sub = doc.setdefault(key, {}) if isinstance(doc.get(key), dict) else {}
            sub.update(draw(st.dictionaries(st.sampled_from([*GROUPS[key], "zz"]), VALUES, max_size=2)))
            doc[key] = sub
        else:
            doc[key] = draw(VALUES)
    return doc


SPEC_TEXTS = (spec_docs().map(lambda d: yaml.safe_dump(d, allow_unicode=True))
              | st.text(max_size=80) | st.sampled_from(["", "- a\n- b\n", "name: [\n", "? [a]\n: 1\n", "a: 1\na: 2\n",
                                                      "name: x\nframework: pytorch\ndataset: {? [x]: 1}\n"]))
SET_VALUES = st.one_of(VALUES.map(yaml_text), st.text(max_size=15))
OVERRIDES = st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(SETTABLE), SET_VALUES)
                     | st.text(max_size=10), max_size=3)


# --------------------------------------------------------------------------- helpers


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gone_inventory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gone")
    p = d / "inv.yaml"
    p.write_text(f"defaults: {{known_hosts: {d / 'known_hosts'}, connect_timeout: 2}}\n"
                 f"groups: {{gpu: {{hosts: [pc2]}}}}\n"
                 f"hosts:\n  pc1: {{address: 127.0.0.1, port: {closed_port()}}}\n"
                 f"  pc2: {{address: 127.0.0.1, port: {closed_port()}}}\n")
    return p


def main(*argv: str) -> tuple[int, str, str]:
    """The CLI in this process, as `clusterctl ARGV` would run: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def assert_clean(rc: int, stderr: str, allowed: tuple[int, ...]) -> None:
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    assert rc in allowed, (rc, stderr)
    if rc == errors.EXIT_USAGE:  # our message with its fix, or argparse's usage line
        assert "fix:" in stderr or "usage: clusterctl" in stderr, stderr


def load_job(path: Path, overrides: list[str]) -> jobs.JobSpec | errors.ClusterError:
    """The job loader's answer: a spec, or a usage error that names the file or the command line, and a field."""
    try:
        spec = jobs.load(str(path), overrides)
    except errors.ClusterError as e:
        assert e.exit_code == errors.EXIT_USAGE
        assert str(path) in e.message or "command line" in e.message, e.message
        assert e.fix, e.message
        if isinstance(e, schema.JobError):
            assert e.field and e.field in e.message
        return e
    for field, rng in schema.NUMBERS.items():  # a spec that loads holds no NaN, infinity or out-of-bounds number
        value: Any = spec.settings
        for part in field.split("."):
            value = value[part]
        for v in value.values() if field == "shares" else [] if value == "auto" else [value]:
            assert rng.accepts(v), (field, v)
    return spec


# --------------------------------------------------------------------------- job specs and --set


@FAST
@given(text=SPEC_TEXTS, overrides=OVERRIDES)
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["dataset=1"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["optimizer=x"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["framework=[1]"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["dataset={name: synthetic, bogus: 1}"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["dataset.path=/nonexistent/x"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["dataset={name: cifar10, path: ~nosuchuserzz/x}"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["name={}", "name="])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["epochs"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["shares={pc1: 8}"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["optimizer.lr=.nan", "collective_timeout_s=.nan"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["bucket_mb=.inf", "optimizer.momentum=.nan"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["batch=10000000000000000000000"])
@example(text="name: x\nframework: pytorch\n? [a]\n: 1\n", overrides=[])
def test_job_loader_and_render_never_raise_anything_else(tmp_path_factory: pytest.TempPathFactory,
                                                         gone_inventory: Path, text: str,
                                                         overrides: list[str]) -> None:
    """jobs.load, then what `launch --dry-run` does with a loaded spec (select the nodes, render every
    node's files): a spec, or exit 2 naming the file/field. The render gets real targets, no node needed."""
    path = tmp_path_factory.mktemp("spec") / "job.yaml"
    path.write_text(text)
    got = load_job(path, overrides)
    if isinstance(got, errors.ClusterError):
        return
    inv = inventory.load(gone_inventory)  # read only: render needs hosts, not nodes
    try:
        hosts = preflight.select_hosts(inv, got, None)
        targets = [render.Target(h) for h in hosts]
        plan = render.render(got, targets, "run-1", "data.npz", {h.name: 29400 + i for i, h in enumerate(hosts)})
    except errors.ClusterError as e:  # e.g. `nodes:` naming no host of the inventory
        assert e.exit_code == errors.EXIT_USAGE and e.fix, e
        return
    assert len(plan.nodes) == len(hosts) and all("launch.sh" in n.files for n in plan.nodes)


def test_non_utf8_spec_is_exit_2(tmp_path: Path) -> None:
    p = tmp_path / "job.yaml"
    p.write_bytes(b"name: caf\xe9\n")
    e = load_job(p, [])
    assert isinstance(e, errors.ClusterError) and "UTF-8" in e.message


@CLI
@given(text=SPEC_TEXTS, overrides=OVERRIDES)
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["dataset=1"])
@example(text=yaml.safe_dump(BASE_SPEC), overrides=["optimizer=x"])
def test_launch_cli_exit_2_or_reaches_the_nodes(tmp_path_factory: pytest.TempPathFactory, gone_inventory: Path,
                                               text: str, overrides: list[str]) -> None:
    """`clusterctl launch SPEC --dry-run --set ...`: a bad spec or value exits 2 with the loader's message;
    a good one gets as far as the nodes (here unreachable: exit 3). Never a traceback."""
    path = tmp_path_factory.mktemp("spec") / "job.yaml"
    path.write_text(text)
    expected = load_job(path, overrides)
    argv = ["launch", str(path), "-i", str(gone_inventory), "--dry-run"]
    argv += [f"--set={o}" for o in overrides]  # `--set -x` would be read as an option by argparse
    rc, _, stderr = main(*argv)
    assert_clean(rc, stderr, (errors.EXIT_USAGE, errors.EXIT_UNREACHABLE))
    if isinstance(expected, errors.ClusterError):
        assert rc == errors.EXIT_USAGE and expected.message.splitlines()[0] in stderr
    elif rc == errors.EXIT_UNREACHABLE:
        assert "cannot reach" in stderr


# --------------------------------------------------------------------------- inventories


HOST_FIELD_VALUES = st.fixed_dictionaries({}, optional={
    "port": VALUES, "user": VALUES, "python": VALUES, "workdir": VALUES, "connection": VALUES, "gpu": VALUES,
    "connect_timeout": VALUES, "command_timeout": VALUES, "vars": VALUES, "nosuch": VALUES})


@st.composite
def own_inventories(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(WORDS, min_size=1, max_size=3, unique=True))
    hosts = {}
    for n in names:
        h = {"address": draw(st.sampled_from(["127.0.0.1", "10.0.0.1"]) | VALUES)}
        h.update(draw(HOST_FIELD_VALUES))
        hosts[n] = h
    doc: dict[str, Any] = {"hosts": hosts if draw(st.integers(0, 9)) else draw(VALUES)}
    if draw(st.booleans()):
        doc["defaults"] = draw(HOST_FIELD_VALUES | VALUES)
    if draw(st.booleans()):
        doc["groups"] = draw(st.dictionaries(WORDS, st.fixed_dictionaries(
            {"hosts": st.lists(st.sampled_from(names) | WORDS, max_size=3) | VALUES}) | VALUES, max_size=2))
    if draw(st.booleans()):
        doc["rank0"] = draw(st.sampled_from(names) | VALUES)
    if draw(st.booleans()):
        doc["name"] = draw(VALUES)
    return doc


@st.composite
def ansible_inventories(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(WORDS, min_size=1, max_size=3, unique=True))
    ans_vars = st.fixed_dictionaries({}, optional={
        "ansible_host": st.sampled_from(["127.0.0.1"]) | VALUES, "ansible_port": VALUES, "ansible_user": VALUES,
        "ansible_python_interpreter": VALUES, "ansible_connection": st.sampled_from(["ssh", "local"]) | VALUES,
        "clusterctl_gpu": VALUES, "other": VALUES})
    hosts = {n: draw(ans_vars | st.none()) for n in names}
    group = {"hosts": hosts}
    if draw(st.booleans()):
        group["vars"] = draw(ans_vars | VALUES)
    if draw(st.booleans()):
        group["children"] = draw(st.dictionaries(WORDS, st.fixed_dictionaries(
            {"hosts": st.dictionaries(st.sampled_from(names) | WORDS, st.none() | ans_vars, max_size=2)})
            | st.none() | VALUES, max_size=2))
    return {"all": group if draw(st.integers(0, 9)) else draw(VALUES)}


def check_inventory(path: Path, overrides: list[str] = ()) -> None:
    try:
        inv = inventory.load(path, overrides=overrides)
    except errors.ClusterError as e:
        assert e.exit_code == errors.EXIT_USAGE, e
        assert str(path) in e.message or "command line" in e.message or "environment" in e.message, e.message
        return
    assert inv.hosts and inv.rank0 in inv.hosts
    for h in inv.hosts.values():  # an inventory that loads holds no NaN, infinity or out-of-bounds number
        for field in ("port", "connect_timeout", "command_timeout"):
            assert model.NUMBERS[field].accepts(getattr(h, field)), (h.name, field)


@FAST
@given(doc=own_inventories() | ansible_inventories(), as_text=st.booleans())
def test_inventory_loader_exit_2_or_an_inventory(tmp_path_factory: pytest.TempPathFactory,
                                                 monkeypatch: pytest.MonkeyPatch, doc: dict[str, Any],
                                                 as_text: bool) -> None:
    """Generated inventories (own schema and Ansible YAML), read by the built-in reader: an inventory, or
    exit 2 naming the file."""
    monkeypatch.setenv("CLUSTERCTL_INVENTORY_READER", "builtin")
    path = tmp_path_factory.mktemp("inv") / "inv.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    check_inventory(path)


@FAST
@given(text=st.text(max_size=80) | st.sampled_from(["? [a, b]\n: 1\n", "hosts:\n  ? {a: 1}\n  : {address: x}\n",
                                                     "hosts: {pc1: {address: 127.0.0.1}}\nhosts: {}\n"]))
def test_inventory_loader_on_any_text(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
                                      text: str) -> None:
    monkeypatch.setenv("CLUSTERCTL_INVENTORY_READER", "builtin")
    path = tmp_path_factory.mktemp("inv") / "inv.yaml"
    path.write_text(text)
    check_inventory(path)


@example(overrides=["user=\0"])  # found by a suite run: ValueError (embedded null byte) from ssh -G
@example(overrides=["identity_file=\0"])
@FAST
@given(overrides=st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(
    ["port", "user", "python", "workdir", "connection", "connect_timeout", "command_timeout", "vars", "vars.x",
     "address", "nosuch", "identity_file", "known_hosts"]), SET_VALUES) | st.text(max_size=10), max_size=3))
def test_inventory_set_values_exit_2_or_an_inventory(tmp_path_factory: pytest.TempPathFactory,
                                                     gone_inventory: Path, overrides: list[str]) -> None:
    """`--set` host fields on the command line."""
    check_inventory(gone_inventory, overrides)


@pytest.mark.parametrize("field, value", [("connect_timeout", ".nan"), ("connect_timeout", ".inf"),
                                          ("command_timeout", ".inf"), ("command_timeout", "1.0e+30")])
def test_inventory_numbers_nan_or_infinite_are_exit_2(tmp_path: Path, field: str, value: str) -> None:
    """A NaN connect_timeout reached a socket (exit 70, a traceback); an infinite command_timeout removed the bound."""
    p = tmp_path / "inv.yaml"
    p.write_text(f"defaults: {{{field}: {value}}}\nhosts:\n  pc1: {{address: 127.0.0.1, port: {closed_port()}}}\n")
    check_inventory(p)
    rc, _, stderr = main("exec", str(p), "--", "true")
    assert_clean(rc, stderr, (errors.EXIT_USAGE,))
    p.write_text(f"hosts:\n  pc1: {{address: 127.0.0.1, port: {closed_port()}}}\n")
    rc, _, stderr = main("exec", str(p), "--set", f"{field}={value}", "--", "true")
    assert_clean(rc, stderr, (errors.EXIT_USAGE,))
    assert f"--set {field}: expected a finite number" in stderr or "expected a number <=" in stderr, stderr


@pytest.mark.parametrize("value", ["{count: 1}", "{count: x}", "{bad: 1}", "[1]", "none"])
def test_inventory_set_gpu(gone_inventory: Path, value: str) -> None:
    check_inventory(gone_inventory, [f"gpu={value}"])
    rc, _, stderr = main("exec", str(gone_inventory), "--set", f"gpu={value}", "--", "true")
    assert_clean(rc, stderr, (errors.EXIT_USAGE, errors.EXIT_UNREACHABLE))


def test_non_utf8_inventory_is_exit_2(tmp_path: Path) -> None:
    p = tmp_path / "inv.yaml"
    p.write_bytes(b"hosts:\n  caf\xe9: {address: 127.0.0.1}\n")
    check_inventory(p)
    rc, _, stderr = main("context", str(p))
    assert_clean(rc, stderr, (errors.EXIT_USAGE,))


def test_list_as_yaml_key_is_exit_2_naming_the_line(tmp_path: Path) -> None:
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  pc1: {address: 127.0.0.1}\n  ? [a, b]\n  : {address: 127.0.0.1}\n")
    rc, _, stderr = main("context", str(p))
    assert_clean(rc, stderr, (errors.EXIT_USAGE,))
    assert f"{p}:3" in stderr and "key" in stderr


# --------------------------------------------------------------------------- run records


def template_record(port: int) -> dict[str, Any]:
    host = {"name": "pc1", "address": "127.0.0.1", "port": port, "user": "nobody", "workdir": "/nonexistent",
            "connect_timeout": 2.0, "command_timeout": 5.0, "groups": [], "vars": {}}
    return {"run_id": "job-1", "job": "job", "framework": "pytorch", "state": "succeeded", "created": 1.0,
            "started": 2.0, "ended": 3.0, "world_size": 1,
            "nodes": [{"node": "pc1", "node_rank": 0, "nproc": 1, "run_dir": "/nonexistent/runs/job-1"}],
            "inventory": {"path": "inv.yaml", "name": "inv", "hosts": [host]}}


RECORD_FIELDS = ["run_id", "job", "framework", "state", "created", "started", "ended", "world_size", "nodes",
                 "settings", "failure", "last_status", "last_seen", "stop_pending", "stop_results", "watcher",
                 "prediction", "collected", "endpoint", "secrets"]
# inventory.hosts is only ever given a wrong type: a generated address could be any name on any network
INVENTORY_VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=2),
                             st.fixed_dictionaries({"hosts": SCALARS | st.lists(SCALARS, max_size=2)}))


@st.composite
def record_files(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "json":
        return json.dumps(draw(VALUES)).encode()
    doc = template_record(closed_port())
    for key in draw(st.lists(st.sampled_from([*RECORD_FIELDS, "inventory"]), min_size=1, max_size=3)):
        doc[key] = draw(INVENTORY_VALUES if key == "inventory" else VALUES)
    return json.dumps(doc).encode()


@settings(CLI, max_examples=40)
@given(data=record_files())
@example(data=b"\xff\xfe garbage")
@example(data=b"[]")
@example(data=json.dumps({**template_record(1), "nodes": "x"}).encode())
def test_damaged_run_record_exit_2_or_a_clean_answer(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    """A run.json that is garbage or has wrong types: `runs`, `status` and `logs` say so, never a traceback."""
    d = runs.runs_dir() / "job-1"
    d.mkdir(parents=True, exist_ok=True)
    (d / "run.json").write_bytes(data)
    for argv in (["runs"], ["status", "job-1"], ["logs", "job-1"]):
        rc, _, stderr = main(*argv)
        assert_clean(rc, stderr, (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USAGE, errors.EXIT_UNREACHABLE))
        if rc == errors.EXIT_USAGE:
            assert "run.json" in stderr or "job-1" in stderr, stderr
    rc, stdout, stderr = main("runs", "--json")  # the damage is in the JSON document, with its fix
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    listed = json.loads(stdout)
    assert rc == (errors.EXIT_USAGE if any("error" in r for r in listed) else errors.EXIT_OK)
    assert all("run.json" in r["error"] and r["fix"] for r in listed if "error" in r)


# --------------------------------------------------------------------------- any command line


NUMBERS = st.one_of(st.integers(-3, 40).map(str), st.text(alphabet="0123456789.-einf", max_size=5))
JOB_NAMES = st.sampled_from(["resnet50-ddp", "resnet50-tf", "nosuch", ".", "/nonexistent.yaml"]) | WORDS
KEY_VALUES = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(SETTABLE + ["user", "port", "gpu"]), SET_VALUES)


@st.composite
def command_lines(draw: st.DrawFn, inv: str) -> list[str]:
    """A command line a user could type: every command that reads inventories, specs, records or numbers.
    The only inventory with nodes is `inv` (a closed port on 127.0.0.1); nothing writes outside the test's
    CLUSTERCTL_HOME (no `lab up/down`, no report files), and `logs -f` is left out (it follows a run)."""
    invs = st.sampled_from([inv, "/nonexistent/inv.yaml"])
    opt = lambda flag, values: st.one_of(st.just([]), values.map(lambda v: [f"{flag}={v}"]))  # noqa: E731
    pick = draw(st.sampled_from(["runs", "status", "logs", "stop", "collect", "report", "plan", "bench", "study",
                                 "exec", "check", "trust", "provision", "context", "launch", "lab"]))
    run_ids = st.lists(WORDS, max_size=1)
    line: list[str] = {
        "runs": lambda: ["runs"],
        "status": lambda: ["status", *draw(run_ids)],
        "logs": lambda: ["logs", *draw(run_ids), *draw(opt("--node", WORDS)), *draw(opt("--lines", NUMBERS))],
        "stop": lambda: ["stop", *draw(run_ids), *draw(opt("--grace", NUMBERS))],
        "collect": lambda: ["collect", *draw(st.sampled_from([["--all"], []]) | run_ids), *draw(opt("-i", invs)),
                            *draw(opt("--forks", NUMBERS))],
        "report": lambda: ["report", *draw(run_ids), *draw(opt("--price-kwh", NUMBERS))],
        "plan": lambda: ["plan", draw(JOB_NAMES), "-i", draw(invs), *draw(opt("--set", KEY_VALUES))],
        "bench": lambda: ["bench", "-i", draw(invs), f"--jobs={draw(JOB_NAMES)}", *draw(opt("--steps", NUMBERS)),
                          *draw(opt("--set", KEY_VALUES))],
        "study": lambda: ["study", draw(JOB_NAMES), "-i", draw(invs), *draw(opt("--nodes", NUMBERS)),
                          *draw(opt("--set", KEY_VALUES))],
        "exec": lambda: ["exec", draw(invs), *draw(opt("--timeout", NUMBERS)), *draw(opt("--set", KEY_VALUES)),
                         *draw(opt("--limit", WORDS)), "--", "true"],
        "check": lambda: ["check", draw(invs), *draw(opt("--forks", NUMBERS)), *draw(opt("--set", KEY_VALUES))],
        "trust": lambda: ["trust", draw(invs), "--yes"],
        "provision": lambda: ["provision", draw(invs), "--dry-run", *draw(opt("--set", KEY_VALUES))],
        "context": lambda: ["context", draw(invs | WORDS)],
        "launch": lambda: ["launch", draw(JOB_NAMES), "-i", draw(invs), "--dry-run",
                           *draw(opt("--set", KEY_VALUES)), *draw(opt("--host-set", KEY_VALUES)),
                           *draw(opt("--limit", WORDS))],
        "lab": lambda: ["lab", "status", *draw(opt("--name", WORDS))],
    }[pick]()
    if draw(st.booleans()) and pick not in ("exec",):
        line.append("--json")
    return line


@settings(CLI, max_examples=80)
@given(data=st.data())
def test_any_command_line_exits_with_a_documented_code(gone_inventory: Path, data: st.DataObject) -> None:
    """Generated command lines through `main()`: 0, 1, 2 or 3 (docs/cli.md), never a traceback or exit 70."""
    argv = data.draw(command_lines(str(gone_inventory)))
    rc, _, stderr = main(*argv)
    assert_clean(rc, stderr, (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USAGE, errors.EXIT_UNREACHABLE))


# --------------------------------------------------------------------------- node agent replies


AGENT_DOCS = st.fixed_dictionaries({}, optional={
    "state": st.sampled_from(list(nodestatus.AGENT_STATES)) | VALUES, "log": VALUES, "error": VALUES,
    "processes": VALUES, "exit": st.fixed_dictionaries({}, optional={"code": VALUES, "ended": VALUES}) | VALUES,
    "metrics": st.dictionaries(st.text(alphabet="0123456789٣x", max_size=3), st.fixed_dictionaries(
        {}, optional={"start": VALUES, "step": VALUES, "end": VALUES}) | VALUES, max_size=3) | VALUES})


@FAST
@given(doc=AGENT_DOCS, noise=st.text(max_size=30))
@example(doc={"state": ["running"]}, noise="")
def test_agent_reply_is_read_or_unanswered_never_raised(doc: dict[str, Any], noise: str) -> None:
    """A garbled reply from a node's agent (wrong types, odd rank keys, text around it) is read defensively:
    a NodeStatus, `unanswered` when its state cannot be read; never an exception (it would crash `status`)."""
    for stdout in (json.dumps(doc), noise + "\n" + json.dumps(doc), noise):
        parsed = agent_reply(stdout)
        assert parsed is None or isinstance(parsed, dict)
        if parsed is not None:
            s = nodestatus.NodeStatus.from_agent("pc1", parsed)
            json.dumps(s.to_dict())  # goes into the run record as it is
            assert s.state in nodestatus.AGENT_STATES or s.state == "unanswered"


def test_agent_reply_with_a_superscript_rank_key() -> None:
    s = nodestatus.NodeStatus.from_agent("pc1", {"state": "running", "metrics": {"²": {}, "0": {}}})
    assert s.state == "running" and s.ranks == 1
