"""`ssh -G`'s answers kept between commands while every file OpenSSH read for them is unchanged.

Asking OpenSSH (cluster.inventory.sshconfig) costs ~7 ms of a process per question, one per host: on 16
hosts most of a cold `clusterctl exec`'s start. An answer is kept in CLUSTERCTL_HOME/cache/ssh-G.json,
keyed by the question (the `ssh -G` arguments, the config chosen, the `ssh` program, the local user and
host), and used again only while the files OpenSSH read for it are the same: the config file, every file an
`Include` names (globs expanded as OpenSSH's glob(3) does, a relative name in ~/.ssh for a user's config and
in /etc/ssh for the system's), and /etc/ssh/ssh_config with its Includes where no `-F` is given. Each file
is fingerprinted by (path, device, inode, size, mtime_ns, mode, owner) and an absent one as absent, so an
edit, a replaced file, a changed permission or a file added where a glob looks all ask OpenSSH again.

Not kept: an answer that depends on more than those files. `Match exec` runs a command and `Match
localnetwork` reads the network interfaces, `CanonicalizeHostname` asks DNS, and `${VAR}` reads the
environment: a config with any of them (or one this reader cannot follow: an unreadable file, Includes
nested past OpenSSH's limit) is asked every time, as before. A file changed within the last RACY_S is not
trusted yet (its next change could fall in the same mtime tick and keep its fingerprint).

Host keys are not part of this: they are checked at every connection (cluster.inventory.hostkeys).
The file is written whole (a unique temporary name, then rename), read defensively (a damaged file, one
of another owner or writable by others, or an entry of the wrong shape counts as no entry) and bounded
(MAX_ENTRIES, the newest kept; MAX_BYTES read at most).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import pwd
import re
import socket
import time
from pathlib import Path
from typing import Any

from cluster import paths
from cluster.bounds import FileRefused, read_regular

FORMAT = 1  # bump when an entry changes shape: older files are then ignored
MAX_ENTRIES = 1024  # a question per host (and hop), plus OpenSSH's defaults: rooms of hundreds of PCs fit
MAX_BYTES = 4 << 20  # 1024 entries are ~0.5 MiB; a larger file is no cache of ours
MAX_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH: Includes nested deeper are OpenSSH's error, not cached
RACY_S = 2.0  # coarser than any file system's mtime tick that matters here (FAT's is 2 s)
SYSTEM_CONFIG = "/etc/ssh/ssh_config"  # OpenSSH's _PATH_HOST_CONFIG_FILE; its relative Includes are in its folder
CONFIG_FILE_CAP = 1 << 20  # a config file larger than this is not followed (its answers are not kept)
MAX_FILES = 256  # files fingerprinted for one config: a file that Includes itself twice would branch without end
_LINE = re.compile(r"\s*([^\s=\"']+)\s*=?\s*(.*)")  # keyword, then whitespace and/or one '=' (OpenSSH's strdelim)


def cache_file() -> Path:
    return paths.home() / "cache" / "ssh-G.json"


def openssh_home() -> str:
    """The home OpenSSH uses for ~ and ~/.ssh/config: the password database's, not $HOME."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return os.path.expanduser("~")


def inputs(config: str, home: str | None = None, system: str | None = None) -> tuple[str | None, str | None]:
    """(a digest of every file OpenSSH reads for `config`, None), or (None, why its answers are not kept).
    `config`: "default" (~/.ssh/config, then the system file), "none" (no file) or a `-F` path."""
    home = home or openssh_home()
    system = system or SYSTEM_CONFIG
    prints: list[list[Any]] = []
    if config == "none":
        roots: list[tuple[str, bool]] = []
    elif config == "default":
        roots = [(os.path.join(home, ".ssh", "config"), True), (system, False)]
    else:
        roots = [(os.path.abspath(config), True)]  # -F is read as a user's config (OpenSSH's SSHCONF_USERCONF)
    for path, user in roots:
        why = _walk(path, user, home, os.path.dirname(system), 0, prints)
        if why is not None:
            return None, why
    return hashlib.sha256(json.dumps(prints).encode()).hexdigest(), None


def _walk(path: str, user: bool, home: str, system_dir: str, depth: int, prints: list[list[Any]]) -> str | None:
    """Fingerprint `path` and, through its Includes, every file it makes OpenSSH read; a reason not to keep
    the answers, or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        prints.append([path, None])  # absent: OpenSSH skips it; its appearing changes the digest
        return None
    except OSError as e:
        return f"{path}: {e.strerror}"
    prints.append([path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid])
    if len(prints) > MAX_FILES:
        return f"{path}: more than {MAX_FILES} files read through Includes"
    if abs(time.time_ns() - st.st_mtime_ns) < RACY_S * 1e9:
        return f"{path} changed less than {RACY_S:g} s ago"
    try:
        text = read_regular(Path(path), "", CONFIG_FILE_CAP, "an OpenSSH config file").decode("utf-8", "replace")
    except (OSError, FileRefused) as e:
        return f"{path}: {getattr(e, 'problem', None) or getattr(e, 'strerror', None) or e}"
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            return f"{path}: a line not followed here ({line.strip()[:40]})"
        keyword, args = m[1].lower(), m[2].split()
        if "${" in line:
            return f"{path}: ${{...}} reads the environment"
        if keyword == "match" and any(a.lower().lstrip("!") in ("exec", "localnetwork") for a in args):
            return f"{path}: a `Match exec` or `Match localnetwork` depends on more than the files"
        if keyword == "canonicalizehostname" and args and args[0].lower() not in ("no", "false"):
            return f"{path}: CanonicalizeHostname asks DNS"
        if keyword != "include":
            continue
        if depth + 1 > MAX_DEPTH:
            return f"{path}: Includes nested deeper than {MAX_DEPTH}"
        for arg in args:
            if arg.startswith("#"):
                break  # the rest of the line is a comment
            names = _include(arg, user, home, system_dir)
            if names is None:
                return f"{path}: Include {arg} is not followed here"
            for name in names:
                why = _walk(name, user, home, system_dir, depth + 1, prints)
                if why is not None:
                    return why
    return None


def _include(arg: str, user: bool, home: str, system_dir: str) -> list[str] | None:
    """The files `Include ARG` reads, in OpenSSH's order (readconf.c): ~ only in a user's config, a relative
    name in ~/.ssh (a user's) or /etc/ssh (the system's), then glob(3) with GLOB_NOCHECK (no match: the name
    itself, which OpenSSH then finds absent). None: a form not followed here (quotes, escapes, ~user unknown)."""
    if any(c in arg for c in "\"'\\%"):
        return None
    if arg.startswith("~"):
        if not user:
            return None  # OpenSSH refuses it in the system's config
        head, sep, rest = arg[1:].partition("/")
        if head:
            try:
                base = pwd.getpwnam(head).pw_dir
            except KeyError:
                return None
        else:
            base = home
        pattern = base + (sep + rest if sep else "")
    elif arg.startswith("/"):
        pattern = arg
    else:
        pattern = os.path.join(home, ".ssh", arg) if user else os.path.join(system_dir, arg)
    return sorted(glob.glob(pattern)) or [pattern]


def local(ssh: str) -> list[Any]:
    """What every answer depends on besides its question and files: the `ssh` program (another version may
    answer otherwise) and the local user and host (~, %u, %l, `Match localuser`)."""
    try:
        st = os.stat(ssh)
        program: list[Any] = [ssh, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    except OSError:
        program = [ssh]
    return [FORMAT, program, os.getuid(), openssh_home(), socket.gethostname()]


def question_key(argv: tuple[str, ...], config: str, local: list[Any]) -> str:
    """The key of one question: its `ssh -G` arguments and the config chosen (a path made absolute: a relative
    `-F` names another file from another folder), with `local`."""
    where = config if config in ("default", "none") else os.path.abspath(config)
    return hashlib.sha256(json.dumps([local, list(argv), where]).encode()).hexdigest()


def load(path: Path | None = None) -> dict[str, Any]:
    """The entries of the cache file; {} for a file that is absent, damaged, too large, not ours, or
    writable by others (its answers name the commands clusterctl runs: ProxyCommand)."""
    path = path or cache_file()
    try:
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return {}
        doc = json.loads(read_regular(path, "", MAX_BYTES, "clusterctl's ssh -G cache"))
    except (OSError, FileRefused, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), dict):
        return {}
    entries: dict[str, Any] = doc["entries"]
    return entries


def answer(entry: Any, digest: str, keys: tuple[str, ...]) -> dict[str, list[str]] | None:
    """A stored entry's answer if it was given for files with this digest and has the shape `ssh -G`'s parse
    gives (only `keys`, each a list of strings); else None."""
    if not isinstance(entry, dict) or entry.get("inputs") != digest:
        return None
    got = entry.get("answer")
    if not isinstance(got, dict) or not all(
            k in keys and isinstance(v, list) and all(isinstance(s, str) for s in v) for k, v in got.items()):
        return None
    return got


def store(new: dict[str, dict[str, Any]], path: Path | None = None) -> None:
    """Add `new` (key -> {"inputs", "answer"}) to the file as it is now (another clusterctl may have written
    it since), keep the newest MAX_ENTRIES and write it whole. A cache that cannot be written is no error."""
    path = path or cache_file()
    entries = load(path)
    for key, entry in new.items():
        entries.pop(key, None)
        entries[key] = entry
    kept = dict(list(entries.items())[-MAX_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        paths.write_atomic(path, json.dumps({"format": FORMAT, "entries": kept}, separators=(",", ":")))
    except OSError:
        pass
