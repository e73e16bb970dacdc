"""Shipping a user's program folder (cluster/runs/code.py): what `scan` takes and refuses, on real files;
`ship` to `connection: local` nodes with the node agent run for real; the node half's own refusals."""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster.errors import UsageError
from cluster.inventory.model import Host
from cluster.nodes.fanout import Group
from cluster.runs import code, jobs, payload, render, schema
from tests.conftest import ROOT

NODE_SIDE = ROOT / "cluster" / "agent"
AGENT = NODE_SIDE / "nodeagent.py"


def write(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    return root


def shipped(root: Path) -> set[str]:
    return set(code.scan(root).files)


# --------------------------------------------------------------------------- scan


def test_gitignore_rules_nested_negated_folders_and_clusterctlignore(tmp_path: Path) -> None:
    root = write(tmp_path / "prog", {
        ".gitignore": "*.log\nbuild/\n/top-only.txt\n!keep.log\ndata/*\n!data/small.csv\n",
        "train.py": "print('hi')\n",
        "a.log": "x", "keep.log": "kept by !", "top-only.txt": "x",
        "build/out.bin": "x", "build/deeper/x.py": "x",
        "sub/top-only.txt": "anchored at the top: shipped here",
        "sub/.gitignore": "*.tmp\n!a.log\nlocal/\n",
        "sub/a.log": "re-included by the deeper file", "sub/b.tmp": "x", "sub/c.py": "x",
        "sub/local/x.py": "x",
        "sub/build": "a file, not a folder: `build/` does not match it",
        "data/big.csv": "x", "data/small.csv": "kept",
        "notes/secret.md": "x", "notes/readme.md": "x",
        ".clusterctlignore": "notes/secret.md\n!*.tmp\n",
        "pkg/__pycache__/m.cpython-311.pyc": "x", "pkg/m.py": "x", "pkg/old.pyc": "x",
        ".git/config": "x", "sub/.git": "gitdir: elsewhere (a worktree's file)",
    })
    assert shipped(root) == {
        ".gitignore", ".clusterctlignore", "train.py", "keep.log", "sub/top-only.txt", "sub/.gitignore",
        "sub/a.log", "sub/b.tmp", "sub/c.py", "sub/build", "data/small.csv", "notes/readme.md", "pkg/m.py"}


def test_nothing_comes_back_from_under_an_ignored_folder(tmp_path: Path) -> None:
    root = write(tmp_path / "prog", {".gitignore": "out/\n!out/keep.txt\n", "out/keep.txt": "x", "m.py": "x"})
    assert shipped(root) == {".gitignore", "m.py"}  # as git: a file cannot be re-included under an ignored folder


GIT_TREES = {
    "whitelist": {  # ignore all, then bring back folders and Python files
        ".gitignore": "*\n!*/\n!*.py\n!.gitignore\n**/gen/**\n!/docs/**\nvenv\n*.o\n",
        "a.py": "x", "a.txt": "x", "pkg/b.py": "x", "pkg/b.txt": "x", "pkg/gen/c.py": "x",
        "docs/guide.md": "x", "docs/deep/x.rst": "x", "venv/lib.py": "x", "x/venv": "x",
        "src/.gitignore": "!*.txt\n*.py\n!keep.py\n", "src/n.txt": "x", "src/m.py": "x", "src/keep.py": "x",
        "src/o/.gitignore": "/k.py\n", "src/o/k.py": "x", "src/o/p/k.py": "x", "src/o/p/n.txt": "x",
        "lib/x.o": "x", "lib/y.py": "x", "weird name [1].py": "x", "#hash.py": "x", "sp ace/t.py": "x",
    },
    "folders": {  # folder patterns, contents patterns, a .gitignore under an ignored folder
        ".gitignore": "build/\nlogs/**\n!logs/keep.txt\nout\n!out/\ndoc/*.txt\n!doc/sub/\ntmp*/\n\\#lit\n",
        "build/.gitignore": "!x.py\n", "build/x.py": "x", "lib/build/y.py": "x", "build.py": "x",
        "logs/a.txt": "x", "logs/keep.txt": "x", "logs/d/e.txt": "x",
        "out/f.txt": "x", "out/g/h.txt": "x", "doc/a.txt": "x", "doc/b.md": "x", "doc/sub/c.txt": "x",
        "tmp1/z": "x", "tmp2": "x", "#lit": "x", "m.py": "x", "a/out": "x",
    },
}


@pytest.mark.parametrize("name", sorted(GIT_TREES))
def test_the_same_files_as_git(tmp_path: Path, name: str) -> None:
    """Trees of tricky rules against git itself (`ls-files --others --exclude-standard`)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = write(tmp_path / "prog", dict(GIT_TREES[name]))
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "init", "-q", str(root)], check=True, env=env, timeout=30)
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--others", "--exclude-standard"],
                         check=True, env=env, capture_output=True, timeout=30).stdout
    want = {p.decode() for p in out.split(b"\0") if p}
    assert shipped(root) == want
    assert len(want) < len(GIT_TREES[name])  # the rules did something


def test_the_manifest_is_canonical_and_says_size_sha_and_mode(tmp_path: Path) -> None:
    root = write(tmp_path / "prog", {"run.sh": "#!/bin/sh\necho hi\n", "m.py": "print(1)\n"})
    (root / "run.sh").chmod(0o750)
    (root / "m.py").chmod(0o640)
    tree = code.scan(root)
    assert tree.root == root.resolve() and tree.total == 18 + 9
    assert tree.files["run.sh"].mode == 0o755 and tree.files["m.py"].mode == 0o644
    assert tree.files["m.py"] == code.CodeFile(hashlib.sha256(b"print(1)\n").hexdigest(), 9, 0o644)
    assert json.loads(json.dumps(tree.manifest())) == tree.manifest()
    assert code.scan(root).digest == tree.digest  # the same tree, the same digest
    (root / "m.py").write_text("print(2)\n")
    assert code.scan(root).digest != tree.digest
    with pytest.raises(dataclasses.FrozenInstanceError):
        tree.total = 0  # type: ignore[misc]


def test_over_the_limit_names_the_five_largest_files_and_the_fix(tmp_path: Path) -> None:
    root = write(tmp_path / "prog", {f"f{i}.bin": b"x" * (1000 * i) for i in range(1, 8)})
    with pytest.raises(code.CodeError) as e:
        code.scan(root, limit_bytes=10_000)
    err = e.value
    assert isinstance(err, UsageError) and err.exit_code == 2
    msg = err.message
    assert "27.3 KiB in 7 files, over the limit of 9.8 KiB" in msg
    assert "f7.bin (6.8 KiB), f6.bin (5.9 KiB), f5.bin (4.9 KiB), f4.bin (3.9 KiB), f3.bin (2.9 KiB)" in msg
    assert "f2.bin" not in msg and ".clusterctlignore" in (err.fix or "")
    assert len(code.scan(root, limit_bytes=28_000).files) == 7
    (root / ".clusterctlignore").write_text("f7.bin\nf6.bin\nf5.bin\n")
    assert len(code.scan(root, limit_bytes=10_100).files) == 5  # the fix it names works (4 files and itself)


def test_a_link_inside_is_shipped_as_its_file_a_link_leaving_is_refused(tmp_path: Path) -> None:
    root = write(tmp_path / "prog", {"real/cfg.yaml": "lr: 0.1\n", "m.py": "x"})
    (root / "cfg.yaml").symlink_to("real/cfg.yaml")
    (root / "chain.yaml").symlink_to("cfg.yaml")
    tree = code.scan(root)
    assert tree.files["cfg.yaml"] == tree.files["chain.yaml"] == tree.files["real/cfg.yaml"]
    (tmp_path / "outside.txt").write_text("secret")
    (root / "leak.txt").symlink_to(tmp_path / "outside.txt")
    with pytest.raises(code.CodeError, match=r"leak\.txt is a symbolic link to .*outside\.txt, outside") as e:
        code.scan(root)
    assert "leak.txt" in (e.value.fix or "") and "replace the link" in (e.value.fix or "")
    (root / "leak.txt").unlink()
    (root / "broken").symlink_to("nowhere")
    with pytest.raises(code.CodeError, match=r"broken is a symbolic link to 'nowhere', which does not exist"):
        code.scan(root)
    (root / "broken").unlink()
    (root / "dirlink").symlink_to("real")
    with pytest.raises(code.CodeError, match=r"dirlink is a symbolic link to .*real, which is not a regular file"):
        code.scan(root)
    (root / ".clusterctlignore").write_text("dirlink\n")
    assert "dirlink" not in code.scan(root).files  # an ignored link is never looked at


def test_a_fifo_is_refused_unless_ignored(tmp_path: Path) -> None:
    root = write(tmp_path / "prog", {"m.py": "x"})
    os.mkfifo(root / "pipe")
    with pytest.raises(code.CodeError, match=r"pipe is a named pipe \(FIFO\): only regular files") as e:
        code.scan(root)  # never opened: a read would block
    assert "pipe" in (e.value.fix or "")
    (root / ".gitignore").write_text("pipe\n")
    assert shipped(root) == {"m.py", ".gitignore"}


def test_no_folder_and_nothing_to_ship_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(code.CodeError, match="no folder"):
        code.scan(tmp_path / "missing")
    root = write(tmp_path / "prog", {".git/HEAD": "x", "__pycache__/a.pyc": "x"})
    with pytest.raises(code.CodeError, match="no file to ship"):
        code.scan(root, source="job code")


# --------------------------------------------------------------------------- ship, for real on local nodes


def local_hosts(tmp_path: Path, *names: str) -> list[Host]:
    hosts = []
    for n in names:
        wd = tmp_path / "nodes" / n
        (wd / "clusterctl").mkdir(parents=True)
        for name, content in payload.agent_files().items():  # what launch's _stage puts there (ship brings codecache.py)
            (wd / render.AGENT).with_name(name).write_bytes(content)
        hosts.append(Host(name=n, address="127.0.0.1", connection="local", workdir=str(wd), python=sys.executable))
    return hosts


def run_dirs(hosts: list[Host], run: str) -> dict[str, str]:
    return {h.name: f"{h.workdir}/runs/{run}" for h in hosts}


def test_ship_sends_only_what_each_node_lacks(tmp_path: Path) -> None:
    files: dict[str, str | bytes] = {f"pkg/m{i}.py": f"X = {i}\n" * 20 for i in range(40)}
    root = write(tmp_path / "prog", {**files, "train.py": "import pkg\n", "run.sh": "#!/bin/sh\n",
                                     "same1.txt": "dup", "same2.txt": "dup"})
    (root / "run.sh").chmod(0o755)
    hosts = local_hosts(tmp_path, "a", "b")
    tree = code.scan(root)
    lines: list[str] = []
    with Group(hosts) as g:
        first = code.ship(g, hosts, tree, run_dirs(hosts, "r1"), log=lines.append)
        assert first.ok, {n: r.stderr or r.error for n, r in first.items()}
        assert lines and "44 files" in lines[0]
        for r in first.values():
            assert r.value.files == 44 and r.value.files_sent == 44 and r.value.files_reused == 0
            assert r.value.bytes_sent == tree.total - 3  # the duplicate content goes once
        for h in hosts:
            prog = Path(h.workdir) / "runs" / "r1" / "program"
            assert {p.relative_to(prog).as_posix() for p in prog.rglob("*") if p.is_file()} == set(tree.files)
            assert (prog / "pkg" / "m7.py").read_text() == files["pkg/m7.py"]
            assert (prog / "run.sh").stat().st_mode & 0o777 == 0o755  # copied: its own inode and mode
            assert (prog / "train.py").stat().st_mode & 0o777 == 0o644
            blob = Path(code.default_cache_dir(h)) / tree.files["train.py"].sha256
            assert not os.path.samefile(blob, prog / "train.py")  # a copy: the run's own (a later run's edit)

        second = code.ship(g, hosts, tree, run_dirs(hosts, "r2"))
        assert second.ok and all(r.value.bytes_sent == 0 and r.value.files_sent == 0 for r in second.values())
        assert second["a"].value.summary() == "sent 0 files (0 B), reused 44"
        assert (Path(hosts[1].workdir) / "runs/r2/program/pkg/m3.py").read_text() == files["pkg/m3.py"]

        (root / "pkg" / "m5.py").write_text("X = 'edited'\n")
        third = code.ship(g, hosts, code.scan(root), run_dirs(hosts, "r3"))
        assert third.ok
        for r in third.values():
            assert (r.value.files_sent, r.value.bytes_sent, r.value.files_reused) == (1, 13, 43)
            assert r.value.summary() == "sent 1 file (13 B), reused 43"
        assert (Path(hosts[0].workdir) / "runs/r3/program/pkg/m5.py").read_text() == "X = 'edited'\n"
        assert (Path(hosts[0].workdir) / "runs/r2/program/pkg/m5.py").read_text() == files["pkg/m5.py"]

        again = code.ship(g, hosts[:1], code.scan(root), run_dirs(hosts, "r3"))  # the same run folder again
        assert again.ok and again["a"].value.bytes_sent == 0
    prog = Path(hosts[0].workdir) / "runs/r3/program"
    assert not [p for p in prog.rglob(".*clusterctl-tmp")]  # no temporary name left
    assert not list(Path(code.default_cache_dir(hosts[0])).glob("*.part"))


@pytest.mark.skipif(os.geteuid() != 0, reason="writes into a read-only cache blob, as only root can")
def test_a_corrupted_blob_is_detected_and_sent_again(tmp_path: Path) -> None:
    root = write(tmp_path / "prog", {"train.py": "print('right')\n", "other.py": "x = 1\n"})
    hosts = local_hosts(tmp_path, "a")
    tree = code.scan(root)
    cache = Path(hosts[0].workdir) / code.CACHE
    with Group(hosts) as g:
        assert code.ship(g, hosts, tree, run_dirs(hosts, "r1")).ok
        blob = cache / tree.files["train.py"].sha256
        blob.write_text("print('evil')\n")  # same size, other bytes: what a program writing into its file does
        r = code.ship(g, hosts, tree, run_dirs(hosts, "r2"))["a"]
    assert r.ok and (r.value.files_sent, r.value.bytes_sent) == (1, len("print('right')\n"))
    assert (Path(hosts[0].workdir) / "runs/r2/program/train.py").read_text() == "print('right')\n"
    # the node half alone: a blob corrupted after code-missing looked is refused at code-tree, never linked
    blob.write_text("print('evil')\n")
    run_dir = tmp_path / "r3"
    reply = agent("code-tree", str(cache), str(run_dir), stdin=tree.manifest())
    assert reply["ok"] is False and "train.py" in reply["error"] and "corrupted" in reply["error"]
    assert not (run_dir / "program" / "train.py").exists() and not blob.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="appends to the data file, a copy as root (a read-only link otherwise)")
def test_a_runs_shipped_program_and_data_are_its_own(tmp_path: Path) -> None:
    """Run B of the same folder appends to its helper.py and its data file in place: run A's copies keep what
    A ran (program files are copies; a data file is a read-only link where the user is not root, a copy as
    root), and the cache still holds the shipped bytes."""
    root = write(tmp_path / "prog", {"train.py": "import helper\n", "helper.py": "X = 1\n"})
    data = write(tmp_path / "data", {"part-0.csv": "1,2\n"})
    hosts = local_hosts(tmp_path, "a")
    with Group(hosts) as g:
        for run in ("A", "B"):
            assert code.ship(g, hosts, code.scan(root), run_dirs(hosts, run)).ok
            assert code.ship(g, hosts, code.scan(data, source="data"), run_dirs(hosts, run), into="data").ok
    runs = Path(hosts[0].workdir) / "runs"
    with open(runs / "B/program/helper.py", "a") as f:
        f.write("X = 2  # B's edit\n")
    with open(runs / "B/data/part-0.csv", "a") as f:  # root: the copy is B's own
        f.write("3,4\n")
    assert (runs / "A/program/helper.py").read_text() == "X = 1\n"
    assert (runs / "A/data/part-0.csv").read_text() == "1,2\n"
    cache = Path(code.default_cache_dir(hosts[0]))
    assert sorted(p.read_text() for p in cache.iterdir() if len(p.name) == 64) == ["1,2\n", "X = 1\n",
                                                                                   "import helper\n"]


def test_refusals_say_plainly_what_the_file_is(tmp_path: Path) -> None:
    """A link loop is called a loop (not "broken"); a name that is not UTF-8 is shown as the user would see it
    (its odd byte as \\xNN), not as a PosixPath repr."""
    root = write(tmp_path / "loop", {"train.py": "x\n"})
    (root / "self").symlink_to("self")
    with pytest.raises(code.CodeError, match=r"self is a symbolic link to 'self', which leads back to itself \(a loop\)"):
        code.scan(root)
    odd = write(tmp_path / "odd", {"train.py": "x\n"})
    (odd / os.fsdecode(b"caf\xe9.txt")).write_text("x")
    with pytest.raises(code.CodeError) as e:
        code.scan(odd)
    assert f"code: {odd}/caf\\xe9.txt has a name that is not UTF-8" in str(e.value.message), e.value.message
    assert "PosixPath" not in str(e.value.message)


def test_a_single_data_file_is_named_data_and_bounded(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(2048)  # sparse: its size is what counts
    with pytest.raises(code.CodeError, match=r"data: .*big.bin holds 2.0 KiB, over the limit of 1.0 KiB"):
        code.data(big, 1024)
    assert set(code.data(big, 4096).files) == {"big.bin"}


NODE_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(NODE_PYTHON, os.X_OK),
                    reason="runs the node's half as another user (needs root and the system's python3)")
def test_a_data_file_written_in_place_by_a_non_root_user_fails_loudly(request: pytest.FixtureRequest) -> None:
    """The node's user is not root: a data file is a hard link to its read-only blob (no copy of a data set
    per run), so the program's in-place write is refused by the kernel rather than changing other runs' data."""
    nobody = 65534
    top = Path(tempfile.mkdtemp(prefix="cc-nobody-", dir="/tmp"))  # pytest's own folders are root's only
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    data = write(top / "data", {"part-0.csv": "1,2\n"})
    node = top / "node"
    node.mkdir()
    shutil.copy(NODE_SIDE / "codecache.py", node / "codecache.py")
    os.chown(node, nobody, nobody)
    tree = code.scan(data, source="data")
    blobs = {f.sha256: p for p, f in ((data / rel, f) for rel, f in tree.files.items())}
    cache = node / "cache"
    manifest = {**tree.manifest(), "into": "data"}

    def as_nobody() -> None:
        os.setgid(nobody)
        os.setuid(nobody)

    script = (f"import json, os, shutil, sys; sys.path.insert(0, {str(node)!r}); import codecache\n"
              f"os.makedirs({str(cache)!r}, 0o700, exist_ok=True)\n"
              f"blobs = {({s: str(p) for s, p in blobs.items()})!r}\n"
              "for sha, src in blobs.items():\n"
              f"    shutil.copyfile(src, os.path.join({str(cache)!r}, '.' + sha + '.0123456789.part'))\n"
              f"m = json.loads({json.dumps(manifest)!r}); m['incoming'] = "
              "{'.' + s + '.0123456789.part': s for s in blobs}\n"
              f"print(json.dumps(codecache.tree({str(cache)!r}, {str(node / 'runs' / 'A')!r}, m)))\n"
              f"try:\n    open({str(node / 'runs' / 'A' / 'data' / 'part-0.csv')!r}, 'a').write('x')\n"
              "except PermissionError as e:\n    print('refused', e.errno)\n")
    # the node's own Python (the agent's half is stdlib only): this one lies in root's home, out of nobody's reach
    r = subprocess.run([NODE_PYTHON, "-c", script], preexec_fn=as_nobody, capture_output=True, text=True,
                       timeout=60, cwd=str(node))
    assert r.returncode == 0, r.stderr
    reply, refused = r.stdout.splitlines()
    assert json.loads(reply)["linked"] == 1 and refused == "refused 13", r.stdout
    assert (node / "runs/A/data/part-0.csv").read_text() == "1,2\n"


def test_ship_reports_a_node_failure_as_data(tmp_path: Path) -> None:
    root = write(tmp_path / "prog", {"train.py": "x\n"})
    hosts = local_hosts(tmp_path, "a", "b")
    dirs = run_dirs(hosts, "r1")
    bad_run = Path(dirs["b"])
    bad_run.mkdir(parents=True)
    (bad_run / "program").symlink_to(tmp_path)  # a link where the program folder goes: never followed
    with Group(hosts) as g:
        res = code.ship(g, hosts, code.scan(root), dirs)
    assert res["a"].ok and not res["b"].ok
    assert res["b"].status == "failed" and "code-tree:" in res["b"].stderr and "not a folder" in res["b"].stderr
    assert not (tmp_path / "train.py").exists()


# --------------------------------------------------------------------------- the node half, alone


def agent(*args: str, stdin: object) -> dict:
    data = stdin if isinstance(stdin, bytes) else json.dumps(stdin).encode()
    r = subprocess.run([sys.executable, str(AGENT), *args], input=data, capture_output=True, timeout=60)
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 1, r  # one JSON line, as every action
    reply = json.loads(lines[0])
    assert r.returncode == (0 if reply["ok"] else 1)
    return reply


ENTRY = {"sha256": "0" * 64, "size": 1, "mode": 0o644}


@pytest.mark.parametrize("path", ["../evil.py", "a/../../evil.py", "/etc/passwd", "a/./b", "a//b", "", ".",
                                  "a\0b", "a/"])
def test_a_manifest_path_leaving_the_program_folder_is_refused(tmp_path: Path, path: str) -> None:
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    manifest = {"files": {"ok.py": ENTRY, path: ENTRY}}
    for action, args in (("code-tree", (str(cache), str(run_dir))), ("code-missing", (str(cache),))):
        reply = agent(action, *args, stdin=manifest)
        assert reply["ok"] is False and "manifest refused" in reply["error"] and repr(path) in reply["error"]
    assert not run_dir.exists() and not (tmp_path / "evil.py").exists()


@pytest.mark.parametrize("manifest", [
    b"not json", [], {"files": []}, {"files": {"a": {**ENTRY, "mode": 0o4755}}},
    {"files": {"a": {**ENTRY, "sha256": "../x"}}}, {"files": {"a": {**ENTRY, "size": True}}},
    {"files": {"a": ENTRY, "a/b": ENTRY}}, {"files": {"a": ENTRY}, "incoming": {"../x": "0" * 64}},
])
def test_a_malformed_manifest_is_refused(tmp_path: Path, manifest: object) -> None:
    reply = agent("code-tree", str(tmp_path / "cache"), str(tmp_path / "run"), stdin=manifest)
    assert reply["ok"] is False and reply["error"]
    assert not (tmp_path / "run").exists()


def test_an_upload_that_does_not_match_is_removed_and_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    sha = hashlib.sha256(b"right").hexdigest()
    part = cache / f".{sha}.{'ab' * 8}.part"
    part.write_bytes(b"wrong")
    manifest = {"files": {"m.py": {"sha256": sha, "size": 5, "mode": 0o644}}, "incoming": {part.name: sha}}
    reply = agent("code-tree", str(cache), str(tmp_path / "run"), stdin=manifest)
    assert reply["ok"] is False and "m.py" in reply["error"] and "does not match" in reply["error"]
    assert not part.exists() and not (cache / sha).exists()
    assert agent("code-missing", str(cache), stdin=manifest) == {"ok": True, "missing": [sha], "removed": []}
    part.write_bytes(b"right")
    assert agent("code-tree", str(cache), str(tmp_path / "run"), stdin=manifest)["files"] == 1
    assert (tmp_path / "run" / "program" / "m.py").read_bytes() == b"right"


def test_the_node_half_is_python_3_8(tmp_path: Path) -> None:
    for name in ("codecache.py", *payload.AGENT_FILES):
        ast.parse((NODE_SIDE / name).read_text(), name, feature_version=(3, 8))
    # shipped with the agent's files alone (no package): the agent finds it beside itself
    for name in payload.AGENT_FILES:
        shutil.copy(NODE_SIDE / name, tmp_path / name)
    shutil.copy(NODE_SIDE / "codecache.py", tmp_path / "codecache.py")
    r = subprocess.run([sys.executable, str(tmp_path / "nodeagent.py"), "code-missing", str(tmp_path / "c")],
                       input=b'{"files": {}}', capture_output=True, timeout=60)
    assert json.loads(r.stdout) == {"ok": True, "missing": [], "removed": []}
    (tmp_path / "codecache.py").unlink()
    r = subprocess.run([sys.executable, str(tmp_path / "nodeagent.py"), "code-missing", str(tmp_path / "c")],
                       input=b'{"files": {}}', capture_output=True, timeout=60)
    assert r.returncode == 1 and "codecache.py is missing" in json.loads(r.stdout)["error"]


def test_data_goes_to_the_runs_data_folder_and_nowhere_else(tmp_path: Path) -> None:
    """`into`: a job's data lands in RUN_DIR/data (program/ untouched); any other folder is refused."""
    root = write(tmp_path / "ds", {"train.csv": "1,2\n", "sub/val.csv": "3,4\n"})
    hosts = local_hosts(tmp_path, "a")
    with Group(hosts) as g:
        res = code.ship(g, hosts, code.scan(root, source="data"), run_dirs(hosts, "r1"), into="data")
    assert res.ok, res["a"]
    run = Path(run_dirs(hosts, "r1")["a"])
    assert (run / "data" / "sub" / "val.csv").read_text() == "3,4\n" and not (run / "program").exists()
    reply = agent("code-tree", str(tmp_path / "cache"), str(tmp_path / "run"), stdin={"files": {}, "into": "../x"})
    assert reply["ok"] is False and "into" in reply["error"] and not (tmp_path / "x").exists()


def test_collect_leaves_shipped_code_on_the_node_and_honours_outputs(tmp_path: Path) -> None:
    """The agent's file list for collect: what launch shipped and is unchanged stays on the node (counted);
    what the program wrote or changed comes back; with `outputs` only those paths of program/."""
    root = write(tmp_path / "prog", {"train.py": "print(1)\n", "pkg/m.py": "X = 1\n"})
    hosts = local_hosts(tmp_path, "a")
    with Group(hosts) as g:
        assert code.ship(g, hosts, code.scan(root), run_dirs(hosts, "r1")).ok
    run = Path(run_dirs(hosts, "r1")["a"])
    write(run, {"program/results/rank0.json": "{}", "program/ckpt/last.pt": "w", "program/cache/tmp.bin": "c",
                "out/metrics-rank0.jsonl": "{}\n", "node.log": "ok\n", "logs/0/stdout.log": "x\n"})
    (run / "program" / "pkg" / "m.py").unlink()
    (run / "program" / "pkg" / "m.py").write_text("X = 2  # the program rewrote its own file\n")

    def listing() -> tuple[set[str], dict]:
        r = subprocess.run([sys.executable, str(AGENT), "manifest", str(run)], capture_output=True, timeout=60)
        doc = json.loads(r.stdout)
        return {f["path"] for f in doc["files"]}, doc

    got, doc = listing()
    assert got == {"program/results/rank0.json", "program/ckpt/last.pt", "program/cache/tmp.bin", "program/pkg/m.py",
                   "out/metrics-rank0.jsonl", "node.log", "logs/0/stdout.log", ".shipped-program.json"}, got
    assert doc["shipped"] == 1 and doc["not_outputs"] == 0  # train.py, unchanged
    (run / "job.json").write_text(json.dumps({"job": {"outputs": ["results", "ckpt/last.pt"]}}))
    got, doc = listing()
    assert got == {"program/results/rank0.json", "program/ckpt/last.pt", "out/metrics-rank0.jsonl", "node.log",
                   "logs/0/stdout.log", ".shipped-program.json", "job.json"}, got
    assert doc["not_outputs"] == 2 and doc["shipped"] == 1  # pkg/ and cache/ (not entered); train.py: shipped


def test_collect_leaves_what_the_job_names_large_and_nothing_by_file_name_alone(tmp_path: Path) -> None:
    """`large_outputs` says what stays on the node unless asked: a user's own checkpoint.pt comes back when the
    job names nothing large; its `*.ckpt` stays when it names them; a run whose job.json predates the key keeps
    the built-in checkpoints on the node; `checkpoints` (collect --with-checkpoints) brings everything."""
    run = tmp_path / "run"
    write(run, {"program/checkpoint.pt": "mine", "program/model.ckpt": "big", "out/checkpoint/w": "tf",
                "out/.checkpoint-worker1/w": "tmp", "node.log": "ok\n"})

    def listing(job: dict | None, *extra: str) -> set[str]:
        if job is not None:
            (run / "job.json").write_text(json.dumps({"job": job}))
        r = subprocess.run([sys.executable, str(AGENT), "manifest", str(run), *extra], capture_output=True,
                           timeout=60)
        return {f["path"] for f in json.loads(r.stdout)["files"]} - {"job.json"}

    everything = {"program/checkpoint.pt", "program/model.ckpt", "out/checkpoint/w", "out/.checkpoint-worker1/w",
                  "node.log"}
    assert listing({"large_outputs": []}) == everything
    assert listing({"large_outputs": ["*.ckpt"]}) == everything - {"program/model.ckpt"}
    assert listing({"large_outputs": ["*.ckpt"]}, "checkpoints") == everything
    assert listing({}) == {"program/model.ckpt", "node.log"}  # no key: the built-in programs' checkpoints stay
    assert jobs.load("resnet50-ddp")["large_outputs"] == ["checkpoint*", ".checkpoint-worker*"]
    assert jobs.from_command(["python", "train.py"], write(tmp_path / "p", {"train.py": ""}))["large_outputs"] == []
    with pytest.raises(schema.JobError, match="large_outputs: expected a list of file or folder names"):
        jobs.load("resnet50-ddp", ["large_outputs=[out/checkpoint.pt]"])


def test_a_large_tree_goes_by_relay_and_builds_the_same_program_folder(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Over distribute.RELAY_MIN_BYTES in all (lowered here), the blobs go head -> a -> b -> c, not the head
    to each; the run folders are the same as by SFTP, and a second launch sends nothing."""
    from cluster.relay import distribute

    monkeypatch.setattr(distribute, "RELAY_MIN_BYTES", 4096)
    root = write(tmp_path / "prog", {"train.py": "print(1)\n", "weights.bin": os.urandom(300_000),
                                     "pkg/m.py": "X = 1\n", "pkg/same.py": "X = 1\n"})
    hosts = local_hosts(tmp_path, "a", "b", "c")
    tree = code.scan(root)
    with Group(hosts) as g:
        first = code.ship(g, hosts, tree, run_dirs(hosts, "r1"))
        assert first.ok, {n: r.stderr or r.error for n, r in first.items()}
        assert {r.value.via for r in first.values()} == {"relay"}
        assert all(r.value.bytes_sent == tree.total - 6 and r.value.files_sent == 4 for r in first.values())
        for h in hosts:
            prog = Path(h.workdir) / "runs" / "r1" / "program"
            assert (prog / "weights.bin").read_bytes() == (root / "weights.bin").read_bytes()
            assert (prog / "pkg" / "same.py").read_text() == "X = 1\n"
            assert not Path(distribute.pidfile(h)).exists()  # no relay left running
        second = code.ship(g, hosts, tree, run_dirs(hosts, "r2"))
        assert second.ok and all(r.value.bytes_sent == 0 and r.value.via == "sftp" for r in second.values())


def test_what_collect_leaves_as_large_is_named_with_its_size(tmp_path: Path) -> None:
    """Nothing stays on a node silently: each large output left there (file or folder) is listed with its bytes
    (a folder's: every regular file under it), so collect can name it and the flag that brings it."""
    run = tmp_path / "run"
    write(run, {"out/checkpoint/a": "x" * 300, "out/checkpoint/sub/b": "y" * 20, "out/checkpoint-epoch2.pt": "z" * 7,
                "node.log": "ok\n", "job.json": json.dumps({"job": {"large_outputs": ["checkpoint*"]}})})
    (run / "out" / "checkpoint" / "link").symlink_to(run / "node.log")  # a link counts for nothing

    def large(*extra: str) -> list[dict]:
        r = subprocess.run([sys.executable, str(AGENT), "manifest", str(run), *extra], capture_output=True,
                           timeout=60)
        return sorted(json.loads(r.stdout)["large"], key=lambda x: x["path"])

    assert large() == [{"path": "out/checkpoint-epoch2.pt", "size": 7}, {"path": "out/checkpoint/", "size": 320}]
    assert large("checkpoints") == []


def test_the_heads_own_products_in_a_program_folder_are_never_shipped(tmp_path: Path, monkeypatch) -> None:
    """A report written into the folder (HTML, or Markdown with its plots), a collected run folder, and
    clusterctl's home inside the folder stay on the head; files that merely share their names ship."""
    from cluster.study import report

    root = write(tmp_path / "proj", {"train.py": "print(1)\n", "notes.md": "# mine\n", "page.html": "<html>mine",
                                     "mine-plots/a.png": "png", "runs/r1/run.json": '{"run_id": "r1", "job": "j"}',
                                     "runs/r1/node1/out.txt": "x", "results/run.json": '{"step": 3}',
                                     "home/context.json": "{}"})
    (root / "run.html").write_text(report.html_page([], {}, None))
    (root / "run.md").write_text(report.markdown_page([], root / "run-plots", {"throughput": b"png"}))
    monkeypatch.setenv("CLUSTERCTL_HOME", str(root / "home"))
    assert (root / "run-plots" / "throughput.png").exists()
    assert set(code.scan(root).files) == {"train.py", "notes.md", "page.html", "mine-plots/a.png", "results/run.json"}


def test_a_folder_too_large_to_ship_names_cd_and_code(tmp_path: Path) -> None:
    root = write(tmp_path / "proj", {"train.py": "x" * 2000})
    with pytest.raises(code.CodeError) as e:
        code.scan(root, limit_bytes=1000)
    assert "`cd` into it, or `--code DIR`" in e.value.fix and code.IGNORE_FILE in e.value.fix
