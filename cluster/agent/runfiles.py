"""A run folder's files, read on the node (stdlib only, beside nodeagent.py): the log's tail, the last metrics
and the failure for `status`, and the listing of the files `collect` brings back (size and sha256 each)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the node's system Python may be older than the head's: aliases for mypy only
    Doc = dict[str, Any]  # one JSON object: a file of the run folder, or a reply

TMP = ".tmp"  # the run's TMPDIR (nodeagent's module doc), never collected


def read_json(path: Path) -> Doc | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def tail_lines(path: Path, n: int, max_bytes: int = 65536) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read().split(b"\n")  # on line feeds only: a carriage return redraws a line, it ends none
    except OSError:
        return []
    if lines[-1] == b"":
        lines.pop()
    return [shown(x.decode("utf-8", "replace")) for x in lines[-n:]]


def shown(line: str) -> str:
    """What a terminal shows of a line: after its last carriage return (a redrawn progress bar: the last
    drawing; a CR LF line end redraws nothing)."""
    line = line.rstrip("\r")
    return line[line.rfind("\r") + 1:]


RANK = re.compile(r"\[rank\d+\]:")  # torchrun's prefix on each worker's line (launch.sh: --log-line-prefix-template)
BAR = re.compile(r"\d+%\|.*\|")  # a progress bar's drawing, as tqdm draws it: "train:  45%|####5     | 9/20 [...]"


def screen(lines: "list[str]") -> "list[str]":
    """Log lines as a terminal shows them, each progress bar once. A bar redraws its line after a carriage
    return: only the last drawing stays. Under torchrun (--tee) a worker's output reaches node.log read from a
    file in text mode, a line at a time: each carriage return has become a line end, and a drawing not yet
    ended when read comes with its line end apart, as its prefix alone ("[rank0]:train:  5%|...[rank0]:").
    So, per prefix, a drawing replaces the one before it until another of that prefix's lines comes, and the
    lone line ends around drawings go."""
    pieces = []  # type: list[tuple[str, str]]
    for raw in lines:
        line = shown(raw)
        m = RANK.match(line)
        p = m.group(0) if m else ""
        parts = line[len(p):].split(p) if p else [line]
        if len(parts) > 1 and parts[-1] == "":
            parts.pop()  # the line end of an unended drawing, read apart
        pieces += [(p, x) for x in parts]
    out, bar_at = [], {}  # type: list[str], dict[str, int]
    for i, (p, body) in enumerate(pieces):
        if BAR.search(body):
            if p in bar_at:
                out[bar_at[p]] = p + body
            else:
                bar_at[p] = len(out)
                out.append(p + body)
            continue
        if p and not body and (p in bar_at or BAR.search(next((b for q, b in pieces[i + 1:] if q == p), ""))):
            continue  # a drawing's line end, read apart
        bar_at.pop(p, None)
        out.append(p + body)
    return out


def user_metrics(path: Path, most: int = 40) -> Doc:
    """The newest value of each numeric field in the last lines of a user's program's $CLUSTER_METRICS (JSON
    lines it writes as it likes: `status` shows its step, loss, images_per_s and epoch); {} without one."""
    found = {}  # type: Doc
    for line in tail_lines(path, 200):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written right now, or not JSON
        for k, v in rec.items() if isinstance(rec, dict) else ():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (k in found or len(found) < most):
                found[k] = v
    return found


def last_records(path: Path) -> Doc:
    """The last step and epoch records of a metrics file (and its start record's world size)."""
    out: Doc = {}
    for line in tail_lines(path, 200, 262144):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written right now
        out[rec.get("type")] = rec
    first = first_record(path)
    if first:
        out.setdefault("start", first)
    return out


def first_record(path: Path) -> Doc | None:
    try:
        with open(path) as f:
            rec = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


PREFIX = re.compile(r"^(?:\[[\w:-]*\]:\s?)+")  # the per-rank prefixes on a worker's lines ([rank1]:[rank1]: ...)


def failure(log: Path, most: int = 12) -> Doc:
    """What failed, for the user to read: the program's last Python traceback in the log (its last `most`
    lines, down to the exception line), and the global ranks torchrun's error summary names
    (`rank : 1 (local_rank: 0)`). torchrun's own traceback (its ChildFailedError) is passed over."""
    tail = [PREFIX.sub("", x) for x in tail_lines(log, 400, 262144)]
    ranks = sorted({int(m.group(1)) for m in (re.match(r"\s*rank\s*:\s*(\d+)\s*\(local_rank", x) for x in tail) if m})
    blocks = []
    for i, line in enumerate(tail):
        if line.startswith("Traceback (most recent call last)"):
            j = i + 1
            while j < len(tail) and (tail[j].startswith((" ", "\t")) or not tail[j].strip()):
                j += 1
            blocks.append(tail[i:j + 1])  # through the exception line
    mine = [b for b in blocks if not any("torch/distributed/elastic" in x or "distributed/run.py" in x for x in b)]
    chosen = (mine or blocks or [[]])[-1]
    return {"failed_ranks": ranks, "traceback": chosen[-most:]}


# a run whose job.json names no large_outputs (launched before jobs declared them): the built-in checkpoints
LARGE_OUTPUTS = ("checkpoint*", ".checkpoint-worker*")
PRIVATE_FILES = ("secrets.env",)
SHIPPED = ".shipped-%s.json"  # codecache.SHIPPED: what launch shipped into program/ or data/


def sha256_prefix(path: Path, length: int | None = None) -> "tuple[str, int]":
    """(sha256, bytes hashed) of the first `length` bytes (the whole file without one). Fewer bytes than
    asked when a running program shortened the file meanwhile: the pair always describes the same bytes.
    Never follows a link (a file swapped for one after the listing's lstat fails with ELOOP)."""
    import hashlib

    h = hashlib.sha256()
    left, done = length, 0
    with os.fdopen(os.open(str(path), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
        while left is None or left > 0:
            chunk = f.read(1 << 20 if left is None else min(1 << 20, left))
            if not chunk:
                break
            h.update(chunk)
            done += len(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest(), done


def _shipped(run_dir: Path) -> "dict[str, str]":
    """{run-relative path: sha256} of what launch shipped into program/ and data/ (codecache.SHIPPED)."""
    found = {}  # type: dict[str, str]
    for into in ("program", "data"):
        try:
            with open(run_dir / (SHIPPED % into)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            found.update({"%s/%s" % (into, k): v for k, v in doc.items() if isinstance(v, str)})
    return found


def _job(run_dir: Path) -> "dict[str, Any]":
    """The job's settings, from the run's job.json ({} when it cannot be read)."""
    try:
        with open(run_dir / "job.json") as f:
            job = json.load(f).get("job", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return job if isinstance(job, dict) else {}


def _outputs(job: "dict[str, Any]") -> "list[str] | None":
    """The job's `outputs` (paths under program/); None: all the program wrote."""
    out = job.get("outputs")
    if not isinstance(out, list):
        return None
    return ["program/" + o.rstrip("/") for o in out if isinstance(o, str) and o and ".." not in o.split("/")]


def _large(job: "dict[str, Any]") -> "tuple[str, ...]":
    """The job's `large_outputs`: name patterns of files and folders left on the node unless asked."""
    large = job.get("large_outputs")
    if not isinstance(large, list):
        return LARGE_OUTPUTS
    return tuple(x for x in large if isinstance(x, str) and x)


def _wanted(rel: str, outputs: "list[str] | None", folder: bool) -> bool:
    """Whether rel (run-relative) is collected under `outputs`: anything outside program/, and inside it the
    outputs and what lies under them (a folder also when an output lies under it)."""
    if outputs is None or not rel.startswith("program/"):
        return True
    return any(rel == o or rel.startswith(o + "/") or (folder and o.startswith(rel + "/")) for o in outputs)


def manifest(run_dir: Path, checkpoints: bool = False) -> Doc:
    """Every regular file under the run folder (never following a link), with size and sha256;
    links and other special files are listed as skipped, not read. Left out, and counted: files the
    launch shipped that are unchanged (the head has them: `shipped`) and, where the job names its
    `outputs`, the rest of the program's folder (`not_outputs`); not listed: what the job names large
    (`large_outputs`: the built-in checkpoints) unless `checkpoints` asks for it: those are named with
    their size (`large`). A running program deletes
    files while this lists them: a file (or folder: os.walk passes over one it cannot open) gone by the time
    it is read is not there, so it is not listed."""
    import fnmatch
    import stat as stat_mod

    files, skipped = [], []

    job = _job(run_dir)
    shipped, outputs = _shipped(run_dir), _outputs(job)
    large = () if checkpoints else _large(job)

    def is_large(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in large)
    unchanged = left = 0
    large_left = []  # type: list[dict[str, Any]]
    for root, dirs, names in os.walk(run_dir, followlinks=False):
        rel_root = Path(root).relative_to(run_dir)
        for d in list(dirs):
            rel = (rel_root / d).as_posix()
            if os.path.islink(Path(root) / d):
                skipped.append({"path": rel, "reason": "symbolic link"})
                dirs.remove(d)
            elif d == "__pycache__" or rel == TMP:
                dirs.remove(d)  # __pycache__: what Python compiled there (never shipped either); TMP: scratch
            elif not _wanted(rel, outputs, True):
                dirs.remove(d)
                left += 1
            elif is_large(d):
                dirs.remove(d)
                large_left.append({"path": rel + "/", "size": _tree_bytes(Path(root) / d)})
        for n in sorted(names):
            full, rel = Path(root) / n, (rel_root / n).as_posix()
            if n.endswith(".tmp"):
                continue
            if rel in PRIVATE_FILES:
                skipped.append({"path": rel, "reason": "secret (env_from): stays on the node"})
                continue
            if not _wanted(rel, outputs, False):
                unchanged, left = (unchanged + 1, left) if rel in shipped else (unchanged, left + 1)  # its code
                continue
            if is_large(n):
                large_left.append({"path": rel, "size": _tree_bytes(full)})
                continue
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue  # deleted since the walk listed it (a running program's temporary file): not there
            if not stat_mod.S_ISREG(st.st_mode):
                skipped.append({"path": rel, "reason": "symbolic link" if stat_mod.S_ISLNK(st.st_mode)
                                else "not a regular file"})
                continue
            try:
                sha, size = sha256_prefix(full, st.st_size)
            except FileNotFoundError:
                continue  # deleted since the lstat
            except OSError as e:
                skipped.append({"path": rel, "reason": "unreadable: %s" % e.strerror})
                continue
            if shipped.get(rel) == sha:
                unchanged += 1
                continue
            files.append({"path": rel, "size": size, "sha256": sha})
    return {"ok": True, "files": files, "skipped": skipped, "shipped": unchanged, "not_outputs": left,
            "large": large_left}


def _tree_bytes(path: Path) -> int:
    """The bytes of a file, or of every regular file under a folder (links not followed): what a large
    output left on the node weighs, so collect can say what `--with-checkpoints` would bring."""
    import stat as stat_mod

    total = 0
    for root, _dirs, names in os.walk(path, followlinks=False) if path.is_dir() else [("", [], [str(path)])]:
        for n in names:
            try:
                st = os.lstat(os.path.join(root, n))
            except OSError:
                continue  # gone since the walk: a running program's
            total += st.st_size if stat_mod.S_ISREG(st.st_mode) else 0
    return total


def prefix_sha(path: Path, length: int | None) -> Doc:
    """sha256 and size of a file's first `length` bytes (resuming a copy), or of all of it: the head's fresh
    listing of one file that changed or vanished while it was copied. `gone`: it is not there any more."""
    try:
        sha, size = sha256_prefix(path, length)
    except OSError as e:
        return {"ok": False, "gone": isinstance(e, FileNotFoundError), "error": "%s: %s" % (path, e.strerror)}
    return {"ok": True, "sha256": sha, "size": size}
