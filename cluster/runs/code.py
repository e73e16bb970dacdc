"""A user's program folder on every node: scanned on the head, and each node sent only what it lacks.

`scan` walks the folder as git sees it: `.git/` never, each `.gitignore` applied to its own folder (deeper
ones win, the last matching line of a file wins, nothing comes back from under an ignored folder), then
`.clusterctlignore` at the top, read last so its lines win (a `!` line ships what git ignores);
`__pycache__/` and `*.pyc` never, nor the head's own products (clusterctl's home, a run folder, a page
`clusterctl report` wrote). What it returns, the `CodeTree`, is a manifest (path -> sha256, size,
mode) and its digest. A symbolic link is shipped as the regular file it points to inside the folder; any
other link, and any FIFO, socket or device, is refused by name, as is a folder over the size limit.

`ship` sends a tree to every node at once, content-addressed: each node keeps the blobs of earlier
launches in `<workdir>/clusterctl/code-cache/<sha256>`, says which it lacks, gets only those (the
transport's copy, into a temporary name the node checks and renames), then builds the run's
`RUN_DIR/program/` from verified blobs by hard links (cluster/agent/codecache.py, through the node
agent). A second launch of an unchanged folder sends no byte; an edited file sends that file.
"""
from __future__ import annotations

import errno
import hashlib
import heapq
import json
import os
import posixpath
import secrets
import stat
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pathspec

from cluster import paths
from cluster.bounds import FileRefused, file_kind, read_regular
from cluster.errors import UsageError
from cluster.nodes.replies import agent_reply, error_tail
from cluster.runs import render

if TYPE_CHECKING:
    from cluster.inventory.model import Host
    from cluster.nodes.fanout import Group, GroupResult
    from cluster.transport import CommandResult, Transport

LIMIT_BYTES = 256 * 2**20
IGNORE_FILE = ".clusterctlignore"
MARK = paths.WRITTEN_BY.encode()  # in the pages `clusterctl report` writes
NEVER_DIRS = frozenset({".git", "__pycache__"})
CACHE = "clusterctl/code-cache"  # under the node's workdir
HELPER = "codecache.py"  # the node's half, put beside the node agent
HASH_RATE = 10e6  # bytes/s an old node hashes at the least (a slow disk): the bound of a node's hashing


class CodeError(UsageError):
    """The program folder cannot be shipped as it is (exit 2): the message names the path, the fix says how."""


@dataclass(frozen=True)
class CodeFile:
    sha256: str
    size: int
    mode: int  # 0o755 if the owner may execute it, else 0o644

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size, "mode": self.mode}


@dataclass(frozen=True)
class CodeTree:
    root: Path  # the folder on the head, resolved
    files: dict[str, CodeFile]  # POSIX path relative to root -> its content
    total: int  # bytes
    digest: str  # sha256 of the canonical manifest: equal digests, equal trees

    def manifest(self) -> dict[str, Any]:
        """What the nodes are sent (JSON-able); `digest` is its canonical form's sha256."""
        return _manifest(self.files)


def _manifest(files: dict[str, CodeFile]) -> dict[str, Any]:
    return {"files": {p: f.to_dict() for p, f in sorted(files.items())}}


def canonical(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- scan (the head)

Spec = pathspec.GitIgnoreSpec
Levels = tuple[tuple[str, Spec], ...]  # (folder relative to root, its .gitignore), top down


def _read_spec(path: Path, rel: str, source: str) -> Spec:
    """An ignore file's lines, read only if it is a regular file of bounded size (a FIFO would block the scan,
    /dev/zero never end): anything else is refused as what it is, not shipped or listed."""
    try:
        text = read_regular(path, f"make {path} a regular text file of gitignore lines, or remove it",
                            noun="an ignore file").decode("utf-8", errors="replace")
    except FileRefused as e:
        raise CodeError(f"{source}: cannot read {rel} ({path}): it {e.problem}", e.fix) from None
    except OSError as e:
        raise CodeError(f"{source}: cannot read {rel}: {e.strerror}", f"make it readable (chmod u+r {path})") from None
    try:
        return pathspec.GitIgnoreSpec.from_lines(text.splitlines())
    except ValueError as e:  # a pattern pathspec cannot compile
        raise CodeError(f"{source}: {rel}: {e}", f"fix or remove that line of {path} (gitignore syntax)") from None


def _verdict(spec: Spec, path: str, is_dir: bool) -> bool | None:
    """One ignore file's word on `path` (relative to its folder): True ignored, False re-included, None silent.
    A file: GitIgnoreSpec.check_file, which weighs a line naming the file above one naming a folder it is in.
    A folder: the last line that names the folder itself, as git asks (its regexes also match what is inside
    a folder, which check_file would weigh for "src/": `*` then `!*/` must keep every folder)."""
    if not is_dir:
        return spec.check_file(path).include
    for p in reversed(spec.patterns):
        dir_only = str(p.pattern or "").rstrip().endswith("/")  # `build/`: only a folder, asked as `build/`
        if p.include is not None and p.match_file(path + "/" if dir_only else path) is not None:
            return p.include
    return None


def _ignored(rel: str, is_dir: bool, levels: Levels, top: Spec | None) -> bool:
    """git's answer, with .clusterctlignore read after every .gitignore: the deepest file with a matching
    line decides, by its last matching line (`!` re-includes)."""
    order = ([("", top)] if top is not None else []) + list(reversed(levels))
    for base, spec in order:
        hit = _verdict(spec, rel[len(base) + 1:] if base else rel, is_dir)
        if hit is not None:
            return hit
    return False


def _refuse_link(source: str, root: Path, rel: str, why: str) -> CodeError:
    return CodeError(f"{source}: {root / rel} is a symbolic link {why}: refused",
                     f"replace the link with the file itself, or list {rel} in {root / IGNORE_FILE}")


def _link_target(root: Path, rel: str, source: str) -> Path:
    """The regular file inside root a link points to (through any chain of links), or the refusal."""
    path = root / rel
    target = Path(os.path.realpath(path))
    try:
        st = os.stat(path)
    except OSError as e:
        why = "which leads back to itself (a loop)" if e.errno == errno.ELOOP else "which does not exist (broken)"
        raise _refuse_link(source, root, rel, f"to {os.readlink(path)!r}, {why}") from None
    if target != root and root not in target.parents:
        raise _refuse_link(source, root, rel, f"to {target}, outside {root}")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse_link(source, root, rel, f"to {target}, which is not a regular file")
    return target


def _walk(root: Path, source: str) -> dict[str, Path]:
    """Every file to ship: relative POSIX path -> the file to read (a link's target inside root)."""
    top_file = root / IGNORE_FILE
    top = _read_spec(top_file, IGNORE_FILE, source) if os.path.lexists(top_file) else None
    found: dict[str, Path] = {}
    home = paths.home().expanduser().resolve()
    stack: list[tuple[str, Levels]] = [("", ())]
    while stack:
        folder, levels = stack.pop()
        here = root / folder if folder else root
        gitignore = here / ".gitignore"
        try:
            if stat.S_ISREG(os.lstat(gitignore).st_mode):
                levels = (*levels, (folder, _read_spec(gitignore, posixpath.join(folder, ".gitignore"), source)))
        except FileNotFoundError:
            pass
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as e:
            raise CodeError(f"{source}: cannot read the folder {here}: {e.strerror}",
                            f"make it readable (chmod u+rx), or list it in {root / IGNORE_FILE}") from None
        for entry in entries:
            rel = f"{folder}/{entry.name}" if folder else entry.name
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except FileNotFoundError:  # removed since the listing
                continue
            is_dir = stat.S_ISDIR(mode)
            if entry.name in NEVER_DIRS and (is_dir or entry.name == ".git") or not is_dir and rel.endswith(".pyc"):
                continue  # .git (a folder, or a worktree's file), byte code
            if _ignored(rel, is_dir, levels, top) or _written_by_clusterctl(root / rel, is_dir, home):
                continue
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                raise CodeError(f"{source}: {_shown(here / entry.name)} has a name that is not UTF-8",
                                f"rename it, or list it in {root / IGNORE_FILE}") from None
            if is_dir:
                stack.append((rel, levels))
            elif stat.S_ISREG(mode):
                found[rel] = root / rel
            elif stat.S_ISLNK(mode):
                found[rel] = _link_target(root, rel, source)
            else:
                raise CodeError(f"{source}: {root / rel} is {file_kind(mode)}: only regular files can be shipped",
                                f"move it out of {root}, or list {rel} in {root / IGNORE_FILE}")
    return found


def _written_by_clusterctl(path: Path, is_dir: bool, home: Path) -> bool:
    """The head's own products in a program folder: clusterctl's home (records, collected runs), a run folder
    copied there, a page `clusterctl report` wrote (and its plots): results, never what the program needs."""
    if is_dir:
        return (path == home or _starts_with(path / "run.json", b'"run_id"', b'"job"')
                or path.name.endswith("-plots") and _starts_with(path.with_name(path.name[:-6] + ".md"), MARK))
    return path.suffix in (".html", ".md") and _starts_with(path, MARK)



def _starts_with(path: Path, *marks: bytes) -> bool:
    """Whether a regular file's first 4 KiB hold every mark (never opening a FIFO or device)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return all(m in head for m in marks)


def _shown(path: Path) -> str:
    """A path as the user would type it; a name that is not UTF-8 with its odd bytes as \\xNN escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _size(path: Path, rel: str, root: Path, source: str) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise CodeError(f"{source}: cannot read {root / rel}: {e.strerror}", "launch again") from None


def _hash(path: Path, rel: str, root: Path, source: str) -> CodeFile:
    """Read once, without blocking on a file that became a FIFO since the walk: sha256, size, mode."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CodeError(f"{source}: cannot read {root / rel}: {e.strerror}",
                        f"make it readable (chmod u+r), or list {rel} in {root / IGNORE_FILE}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CodeError(f"{source}: {root / rel} is no longer a regular file", "launch again")
        h, size = hashlib.sha256(), 0
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return CodeFile(h.hexdigest(), size, 0o755 if st.st_mode & stat.S_IXUSR else 0o644)


def scan(root: Path, *, limit_bytes: int = LIMIT_BYTES, source: str = "code") -> CodeTree:
    """The files of `root` to ship (see the module docstring); CodeError (exit 2) names what cannot be.
    `source` names the folder's setting in messages (the job's `code`)."""
    given = Path(root).expanduser()
    if not given.is_dir():
        raise CodeError(f"{source}: no folder {given} on the head", f"point {source} at your program's folder")
    base = given.resolve()
    found = _walk(base, source)
    if not found:
        raise CodeError(f"{source}: {base} has no file to ship (every file is ignored, or it is empty)",
                        f"check its .gitignore files and {base / IGNORE_FILE}")
    sizes = {rel: _size(path, rel, base, source) for rel, path in found.items()}
    total = sum(sizes.values())
    if total > limit_bytes:
        largest = heapq.nlargest(5, sizes.items(), key=lambda kv: (kv[1], kv[0]))
        raise CodeError(f"{source}: {base} holds {size_text(total)} in {len(found)} files, over the limit of "
                        f"{size_text(limit_bytes)}; the largest: "
                        + ", ".join(f"{rel} ({size_text(n)})" for rel, n in largest),
                        f"launch from the program's own folder (`cd` into it, or `--code DIR`), or list what the "
                        f"program does not need in {base / IGNORE_FILE} (gitignore syntax, e.g. `data/`, `*.ckpt`); "
                        "data belongs in `--data` (a job spec's `data:`)")
    files = {rel: _hash(found[rel], rel, base, source) for rel in sorted(found)}
    digest = hashlib.sha256(canonical(_manifest(files))).hexdigest()
    return CodeTree(base, files, sum(f.size for f in files.values()), digest)


def named(root: Path, names: list[str], source: str = "program") -> CodeTree:
    """The tree of these files of `root` only (the built-in programs: an entry point and the modules it
    imports, out of cluster/programs), shipped like any user's code."""
    base = Path(root).resolve()
    files = {n: _hash(base / n, n, base, source) for n in sorted(set(names))}
    digest = hashlib.sha256(canonical(_manifest(files))).hexdigest()
    return CodeTree(base, files, sum(f.size for f in files.values()), digest)


def data(path: Path, limit_bytes: int) -> CodeTree:
    """A job's `data`: a folder (scanned as code is) or one regular file, refused here, on the head, before
    anything is sent (so `--dry-run` refuses it too): a link loop, a FIFO, a device, over `limit_bytes`."""
    p = Path(path).expanduser()
    try:
        st = os.stat(p)
    except OSError as e:
        what = ("is a symbolic link that leads back to itself (a loop)" if e.errno == errno.ELOOP else
                "does not exist on the head" if e.errno == errno.ENOENT else f"cannot be read: {e.strerror}")
        raise CodeError(f"data: {_shown(p)} {what}", "data: the path of a file or folder on the head") from None
    if stat.S_ISDIR(st.st_mode):
        return scan(p, limit_bytes=limit_bytes, source="data")
    if not stat.S_ISREG(st.st_mode):
        raise CodeError(f"data: {_shown(p)} is {file_kind(st.st_mode)}: only a regular file or a folder can be shipped",
                        "data: the path of a file or folder on the head")
    if st.st_size > limit_bytes:
        raise CodeError(f"data: {_shown(p)} holds {size_text(st.st_size)}, over the limit of {size_text(limit_bytes)}",
                        "give the program a smaller file, or a path on the nodes it reads itself")
    return named(p.parent, [p.name], source="data")


# --------------------------------------------------------------------------- ship (head -> nodes)


@dataclass(frozen=True)
class Shipped:
    """One node's result (`HostResult.value`). A failure has exit_code 1 and the reason in stderr, so the
    node's HostResult is `failed` with it (launch.require names it)."""
    files: int  # in the run's program/ folder
    files_sent: int  # of those, the ones whose content this launch sent
    bytes_sent: int  # each missing blob once (from the head, or from a peer when relayed)
    linked: int = 0  # hard links to the cache (the others are copies)
    via: str = "sftp"  # how the missing blobs came: sftp (the head to each node) or relay (node to node)
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""

    @property
    def files_reused(self) -> int:
        return self.files - self.files_sent

    def summary(self) -> str:
        """e.g. `sent 1 file (812 B), reused 41`."""
        via = " by relay" if self.via == "relay" and self.files_sent else ""
        return (f"sent {self.files_sent} file{'' if self.files_sent == 1 else 's'} ({size_text(self.bytes_sent)}"
                f"{via}), reused {self.files_reused}")


def default_cache_dir(host: Host) -> str:
    return f"{host.workdir}/{CACHE}"


def _bound(nbytes: int, nfiles: int) -> float:
    """Seconds a node may take to hash `nbytes` and write `nfiles` (the agent's command timeout)."""
    return 60.0 + nbytes / HASH_RATE + nfiles * 0.01


def _failed(step: str, r: CommandResult | None, reply: dict[str, Any] | None) -> Shipped:
    why = (reply or {}).get("error") or (r and (error_tail(r.stderr or r.stdout) or f"exit {r.exit_code}"))
    return Shipped(0, 0, 0, exit_code=1, stdout=r.stdout if r else "", stderr=f"{step}: {why}")


def ship(group: Group, hosts: list[Host], tree: CodeTree, run_dirs: dict[str, str],
         cache_dir: Callable[[Host], str] | None = None,
         log: Callable[[str], None] = lambda s: None, into: str = "program") -> GroupResult:
    """`tree` into `run_dirs[host.name]/<into>/` on every node at once, each sent only the blobs its cache
    lacks: over SFTP from the head, or by the peer relay (cluster/relay) when the nodes lack
    `distribute.RELAY_MIN_BYTES` or more in all. Needs the node agent staged (launch's _stage); puts
    codecache.py beside it. One HostResult per node, its value a `Shipped` (`.summary()`: "sent 1 file
    (812 B), reused 41")."""
    from cluster.nodes.fanout import GroupResult, HostResult
    from cluster.provision.wheelhouse import distribution_mode
    from cluster.relay import distribute, routes

    lacking = [h.name for h in hosts if h.name not in run_dirs]
    if lacking:
        raise ValueError(f"no run folder given for {', '.join(lacking)}")
    manifest = tree.manifest()
    body = canonical(manifest)
    helper = resources.files("cluster.agent").joinpath(HELPER).read_bytes()
    source_of: dict[str, str] = {}  # sha256 -> the first path with that content
    for rel, f in sorted(tree.files.items()):
        source_of.setdefault(f.sha256, rel)
    size_of = {sha: tree.files[rel].size for sha, rel in source_of.items()}
    where = cache_dir or default_cache_dir
    log(f"shipping {tree.root}: {len(tree.files)} files ({size_text(tree.total)}), digest {tree.digest[:12]}")

    def ask(t: Transport) -> Shipped | list[str]:  # a Shipped only when it failed
        """The blobs this node's cache lacks (it re-hashes those it has and drops any damaged one)."""
        host = t.host
        t.put_bytes(helper, f"{host.workdir}/{posixpath.dirname(render.AGENT)}/{HELPER}", 0o644)
        r = t.run(render.agent_command(host, "code-missing", where(host)),
                  timeout=_bound(tree.total, len(tree.files)), stdin=body)
        reply = agent_reply(r.stdout)
        if r.exit_code != 0 or not reply or reply.get("ok") is not True:
            return _failed("code-missing", r, reply)
        missing = reply.get("missing")
        if not isinstance(missing, list) or not all(isinstance(s, str) and s in source_of for s in missing):
            return _failed("code-missing", r, {"error": f"the agent asked for blobs not in the manifest: {missing!r}"})
        return sorted(set(missing))

    asked = group.call(ask, hosts)
    out = GroupResult((h.name, asked[h.name]) for h in hosts if not asked[h.name].ok)  # a failed Shipped
    need: dict[str, list[str]] = {h.name: asked[h.name].value for h in hosts if asked[h.name].ok}
    wanting = [h for h in hosts if need.get(h.name)]
    received: dict[str, int] = {}
    if wanting and distribute.worth_relaying(sum(size_of[s] for h in wanting for s in need[h.name]), len(wanting)):
        blobs = sorted({s for h in wanting for s in need[h.name]})
        items = [routes.item(s, tree.root / source_of[s], size_of[s], s) for s in blobs]
        log(f"relaying {len(blobs)} blobs ({size_text(sum(size_of[s] for s in blobs))}) to {len(wanting)} nodes")
        _, relayed = distribute.distribute(group, wanting, items, {h.name: where(h) for h in wanting},
                                           mode=distribution_mode(wanting[0]), log=log)
        for h in wanting:
            r = relayed[h.name]
            if not r.ok:
                out[h.name] = HostResult(h.name, r.status, r.duration, value=_failed("relay", None, {
                    "error": r.error or r.stderr}), exit_code=1, stderr=f"relay: {r.error or r.stderr}", fix=r.fix)
                del need[h.name]
            else:
                received[h.name] = r.value.received
                need[h.name] = []  # in the cache under their names, verified by the relay

    def build(t: Transport) -> Shipped:
        host, cache = t.host, where(t.host)
        incoming: dict[str, str] = {}
        sent = received.get(host.name, 0)
        for sha in need[host.name]:
            tmp = f".{sha}.{secrets.token_hex(8)}.part"
            t.put_file(tree.root / source_of[sha], f"{cache}/{tmp}", 0o600)  # the transport's copy, bounded
            incoming[tmp] = sha
            sent += size_of[sha]
        r = t.run(render.agent_command(host, "code-tree", cache, run_dirs[host.name]),
                  timeout=_bound(tree.total + sent, len(tree.files)),
                  stdin=canonical({**manifest, "incoming": incoming, "into": into}))
        reply = agent_reply(r.stdout)
        if r.exit_code != 0 or not reply or reply.get("ok") is not True:
            return _failed("code-tree", r, reply)
        if reply.get("files") != len(tree.files):
            return _failed("code-tree", r, {"error": f"{reply.get('files')!r} files made, {len(tree.files)} sent"})
        lacked = set(asked[host.name].value)
        return Shipped(len(tree.files), sum(f.sha256 in lacked for f in tree.files.values()), sent,
                       int(reply.get("linked") or 0), via="relay" if host.name in received else "sftp")

    built = group.call(build, [h for h in hosts if h.name in need])
    return GroupResult((h.name, out.get(h.name) or built[h.name]) for h in hosts)
