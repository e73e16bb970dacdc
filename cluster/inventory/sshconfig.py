"""How OpenSSH would reach a host: the user's client configuration (~/.ssh/config), read by OpenSSH itself.

`ssh -G DEST` prints the configuration OpenSSH would use for DEST after every `Host` and `Match` block,
`Include`, token and default: the reference tool's own answer, so clusterctl reads the file exactly as
`ssh` does (paramiko's parser has no `Include`). Where the inventory sets a field it is given to `ssh -G`
as a command-line option (`-l`, `-p`, `-o ...`), which OpenSSH ranks above any config file: the inventory
wins, and `Match user` sees the user clusterctl logs in as. A value counts as the config's only where it
differs from what `ssh -G -F none` (no file at all) prints, so OpenSSH's defaults never override
clusterctl's. Read: HostName, User, Port, IdentityFile, ProxyJump (every hop resolved the same way, the
hops' own jump hosts first), ProxyCommand, UserKnownHostsFile, HostKeyAlias. IdentitiesOnly needs nothing:
with a key file, clusterctl offers that key only (no agent, no ~/.ssh/id_*).
StrictHostKeyChecking set to "no" or "accept-new" is not followed (host keys are recorded by `clusterctl trust`
only) and is said once. Without an `ssh` program on the head a config file is refused, not half-read.
Answers are kept between commands while the files OpenSSH read are unchanged (cluster.inventory.sshconfig_cache);
host keys are not: they are checked at every connection.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

from cluster.bounds import file_problem
from cluster.errors import InventoryError
from cluster.inventory import sshconfig_cache
from cluster.inventory.model import Host

SSH_G_TIMEOUT_S = 10.0  # a `Match exec` in the user's file runs a command: bounded like every wait
KEYS = ("hostname", "user", "port", "identityfile", "identitiesonly", "proxyjump", "proxycommand",
        "userknownhostsfile", "hostkeyalias", "stricthostkeychecking")
DEFAULT_FILES = ("~/.ssh/config", sshconfig_cache.SYSTEM_CONFIG)
# ProxyJump hops: [user@]host[:port] or ssh://[user@]host[:port] (OpenSSH's parse_ssh_uri / parse_user_host_port)
_HOP = re.compile(r"(?:ssh://)?(?:(?P<user>[^@:/\s]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^@:/\s\[\]]+)(?::(?P<port>\d{1,5}))?/?\Z")
_TOKEN = re.compile(r"%(.)")
PROXY_TOKENS = "%hprn"  # ProxyCommand's tokens clusterctl expands: %% %h %p %r %n


def parse(stdout: str) -> dict[str, list[str]]:
    """`ssh -G` output: one `key value` per line (keys lower-case, repeated for lists such as identityfile)."""
    out: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        key, _, value = line.strip().partition(" ")
        if key in KEYS:
            out.setdefault(key, []).append(value.strip())
    return out


def hops(spec: str) -> list[tuple[str | None, str, int | None]]:
    """A ProxyJump value as its hops: (user, host, port); ValueError names a hop OpenSSH would refuse."""
    out = []
    for hop in spec.split(","):
        m = _HOP.match(hop.strip())
        if not m or (m["port"] and not 0 < int(m["port"]) < 65536):
            raise ValueError(f"{hop!r} is not [user@]host[:port]")
        out.append((m["user"], m["host"].strip("[]"), int(m["port"]) if m["port"] else None))
    return out


def expand_proxy_command(command: str, host: Host, dest: str) -> str:
    """ProxyCommand's tokens as OpenSSH expands them (%h host, %p port, %r user, %n the name given, %% a
    %), each value shell-quoted; any other token is refused (clusterctl would run another command)."""
    import shlex

    values = {"%": "%", "h": host.address, "p": str(host.port), "r": host.user, "n": dest}

    def one(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise ValueError(f"token %{m.group(1)} in ProxyCommand {command!r}: clusterctl expands only "
                             "%h, %p, %r, %n and %%")
        return values[m.group(1)] if m.group(1) == "%" else shlex.quote(values[m.group(1)])

    return _TOKEN.sub(one, command)


class Resolver:
    """Resolves hosts against one config choice, asking `ssh -G` once per distinct question (and not at all
    while the cache holds its answer for unchanged files)."""

    def __init__(self, source: str) -> None:
        self.source = source  # the inventory file, for errors
        self._answers: dict[tuple[str, ...], Future[dict[str, list[str]]]] = {}
        self._lock = threading.Lock()  # hosts are resolved in parallel (resolve_all)
        self.notes: list[str] = []
        self.asked = 0  # `ssh -G` runs (the others were answered from the cache)
        self.not_kept: dict[str, str] = {}  # config -> why its answers are asked every time
        self._kept: dict[str, Any] | None = None  # the cache file's entries, read at the first question
        self._local: list[Any] = []
        self._inputs: dict[str, str | None] = {}  # config -> the digest of the files OpenSSH reads for it
        self._new: dict[str, dict[str, Any]] = {}  # answers the cache file does not hold yet
        self._batch = 0  # inside resolve_all: the cache file is written once, at its end

    def resolve_all(self, build: Callable[[str], Host], names: Iterable[str]) -> dict[str, Host]:
        """`build(name)` for every name at once (each costs an `ssh -G` or two, ~7 ms, unless cached), in the
        names' order."""
        names = list(names)
        with self._lock:
            self._batch += 1
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
                return dict(zip(names, pool.map(build, names)))
        finally:
            with self._lock:
                self._batch -= 1
            self._save()

    def _ask(self, argv: tuple[str, ...], config: str) -> dict[str, list[str]]:
        """OpenSSH's answer to `ssh -G ARGV` with `config` ("default", "none" or a -F path). Hosts asking the
        same question at once wait for the first one's answer."""
        with self._lock:
            pending = self._answers.get(argv)
            mine = pending is None
            if pending is None:
                pending = self._answers[argv] = Future()
        if mine:
            try:
                pending.set_result(self._answer(argv, config))
            except BaseException as e:  # noqa: BLE001 - every asker gets the same error
                pending.set_exception(e)
        return pending.result()  # bounded: the first asker's `ssh -G` has SSH_G_TIMEOUT_S

    def _answer(self, argv: tuple[str, ...], config: str) -> dict[str, list[str]]:
        """From the cache while the files OpenSSH reads for `config` are unchanged (their digest taken before
        `ssh -G` runs: a file changed while it runs is seen as changed next time), else `ssh -G` itself."""
        ssh = self._ssh(config)
        with self._lock:
            if self._kept is None:
                self._kept = sshconfig_cache.load()
                self._local = sshconfig_cache.local(ssh)
            if config not in self._inputs:
                self._inputs[config], why = sshconfig_cache.inputs(config, system=DEFAULT_FILES[1])
                if why is not None:
                    self.not_kept[config] = why
            digest, key = self._inputs[config], sshconfig_cache.question_key(argv, config, self._local)
            if digest is not None:
                got = sshconfig_cache.answer(self._kept.get(key), digest, KEYS)
                if got is not None:
                    return got
            self.asked += 1
        got = self._run(ssh, argv, config)
        if digest is not None:
            with self._lock:
                self._new[key] = {"inputs": digest, "answer": got}
        return got

    def _save(self) -> None:
        with self._lock:
            new, self._new = self._new, {}
        if new:
            sshconfig_cache.store(new)

    def _check_files(self, config: str) -> None:
        """The config file(s) `ssh -G` would read, each a regular file of bounded size: a FIFO blocks OpenSSH
        until the timeout, which would then blame a `Match exec`. (An absent one is OpenSSH's to name.)"""
        for f in DEFAULT_FILES if config == "default" else (config,):
            path = Path(f).expanduser()
            try:
                st = path.stat()
            except OSError:
                continue
            problem = file_problem(st, noun="an OpenSSH config file")
            if problem is not None:
                raise InventoryError(self.source, None, "ssh_config", f"cannot read {path}: it {problem}",
                                     "point `ssh_config` (or -F) at a regular file, or set `ssh_config: none`")

    def _ssh(self, config: str) -> str:
        ssh = shutil.which("ssh")
        if ssh is None:
            raise InventoryError(self.source, None, "ssh_config", f"cannot read {_shown(config)}: no `ssh` program "
                                 "on this PC (clusterctl asks OpenSSH itself, `ssh -G`, how it reads the file)",
                                 "install openssh-client, or set `ssh_config: none` to read no OpenSSH config")
        return ssh

    def _run(self, ssh: str, argv: tuple[str, ...], config: str) -> dict[str, list[str]]:
        """`ssh -G ARGV`, parsed; an error names the config file OpenSSH refused (or could not be run for)."""
        config = _shown(config)
        try:
            r = subprocess.run([ssh, "-G", *argv], capture_output=True, text=True, timeout=SSH_G_TIMEOUT_S,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise InventoryError(self.source, None, "ssh_config", f"`ssh -G` on {config} still running after "
                                 f"{SSH_G_TIMEOUT_S:g} s (a `Match exec` command that does not return?)",
                                 "fix the config file, or set `ssh_config: none`") from None
        if r.returncode != 0:
            tail = "; ".join(ln.strip() for ln in r.stderr.splitlines() if ln.strip())[:600]
            raise InventoryError(self.source, None, "ssh_config", f"OpenSSH refuses {config}: {tail}",
                                 "fix the line it names (`ssh -G HOST` shows the same), or set "
                                 "`ssh_config: none`")
        return parse(r.stdout)

    def resolve(self, host: Host, given: Iterable[str]) -> Host:
        """`host` as OpenSSH would reach it: the config's values where the inventory set none (`given`),
        its jump hosts resolved into `jumps`. A `connection: local` host, or `ssh_config: none` with no
        jump host, is returned as it is."""
        try:
            return self._resolve_host(host, set(given))
        finally:
            if not self._batch:
                self._save()

    def _resolve_host(self, host: Host, given: set[str]) -> Host:
        if host.connection != "ssh":
            return host
        config = _config_file(host, self.source)
        if config is None:
            if host.proxy_jump in (None, "none"):  # OpenSSH's word for no jump host
                return replace(host, proxy_jump=None)
            return replace(host, jumps=self._jumps(host, host.proxy_jump, None, host))
        return self._resolve(host, given, config)

    def _resolve(self, host: Host, given: set[str], config: str) -> Host:
        dest = host.address
        opts: list[str] = []
        if "user" in given:
            opts += ["-l", host.user]
        if "port" in given:
            opts += ["-p", str(host.port)]
        for key, option in (("proxy_jump", "ProxyJump"), ("proxy_command", "ProxyCommand"),
                            ("host_key_alias", "HostKeyAlias"), ("known_hosts", "UserKnownHostsFile")):
            value = getattr(host, key)
            if key in given and value:
                opts += ["-o", f"{option}={value}"]
        self._check_files(config)
        files = [] if config == "default" else ["-F", config]
        got = self._ask((*files, *opts, "--", dest), config)
        # OpenSSH's defaults for these options: the same for every destination but its hostname, so asked once
        base = self._ask(("-F", "none", *opts, "--", "clusterctl-defaults.invalid"), "none")
        changed = {k for k in KEYS if k != "hostname" and got.get(k) != base.get(k)}
        fields: dict[str, object] = {}
        hostname = (got.get("hostname") or [dest])[0]
        if hostname != dest:
            fields["address"] = hostname
        if "user" in changed and "user" not in given:
            fields["user"] = got["user"][0]
        if "port" in changed and "port" not in given:
            fields["port"] = int(got["port"][0])
        if "identityfile" in changed and "identity_file" not in given:
            found = [k for k in got["identityfile"] if Path(k).expanduser().is_file()]  # OpenSSH skips the others
            if found:
                fields["identity_file"] = found[0]
        if "userknownhostsfile" in changed and "known_hosts" not in given:
            fields["known_hosts"] = got["userknownhostsfile"][0].split()[0]
        alias = (got.get("hostkeyalias") or ["none"])[0]
        if alias != "none":
            fields["host_key_alias"] = alias
        command = (got.get("proxycommand") or ["none"])[0]
        jump = (got.get("proxyjump") or ["none"])[0]
        fields["proxy_command"] = None if command == "none" else command
        fields["proxy_jump"] = None if jump == "none" else jump
        strict = (got.get("stricthostkeychecking") or ["ask"])[0]
        if "stricthostkeychecking" in changed and strict in ("false", "no", "off", "accept-new"):
            note = (f"{_shown(config)}: StrictHostKeyChecking {strict} is not followed: clusterctl records a "
                    "host key only through `clusterctl trust`, which shows its fingerprint")
            with self._lock:
                if note not in self.notes:
                    self.notes.append(note)
        out = replace(host, **fields)  # type: ignore[arg-type]
        if out.proxy_jump:
            out = replace(out, jumps=self._jumps(out, out.proxy_jump, config, out))
        return out

    def _jumps(self, host: Host, spec: str, config: str | None, node: Host) -> tuple[Host, ...]:
        """The hops of a ProxyJump value, each resolved like a node: its user and port from the hop (else
        the config, else OpenSSH's defaults); its key file and known_hosts from the config, else the node's
        inventory entry (a jump host's key is trusted like any node's). The first hop's own jump hosts (from
        the config) come before it; later hops are reached through the earlier ones, as `ssh -J a,b` does."""
        try:
            parsed = hops(spec)
        except ValueError as e:
            raise InventoryError(self.source, None, f"{host.name}.proxy_jump", str(e),
                                 "write ProxyJump as OpenSSH does: [user@]host[:port], hops separated by commas") from None
        chain: list[Host] = []
        for i, (user, address, port) in enumerate(parsed):
            hop = Host(name=f"{address} (jump host)", address=address, port=port or 22,
                       identity_file=node.identity_file, known_hosts=node.known_hosts,
                       connect_timeout=node.connect_timeout, ssh_config=node.ssh_config)
            if user:
                hop = replace(hop, user=user)
            hop_given = {k for k, v in (("user", user), ("port", port)) if v}
            resolved = self._resolve(hop, hop_given, config) if config else hop
            if i == 0:  # its own jump hosts and proxy command (from the config) come first
                chain.extend(resolved.jumps)
            else:  # `-J a,b`: b is reached through a, whatever its own config says
                resolved = replace(resolved, proxy_command=None)
            chain.append(replace(resolved, jumps=(), proxy_jump=None))
        return tuple(chain)


def _config_file(host: Host, inventory: str) -> str | None:
    """The config to read: the host's `ssh_config` (a path, relative to the inventory's folder; or "none"),
    else OpenSSH's own files when one exists ("default"); None: read nothing."""
    if host.ssh_config == "none":
        return None
    if host.ssh_config:
        return str(Path(inventory).parent / os.path.expanduser(host.ssh_config))  # an absolute path stays
    return "default" if any(Path(f).expanduser().is_file() for f in DEFAULT_FILES) else None


def _shown(config: str) -> str:
    return {"default": " and ".join(DEFAULT_FILES), "none": "no config file"}.get(config, config)
