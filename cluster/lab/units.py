#!/usr/bin/python3 -I
"""A lab PC's `systemctl`: the units Debian's packages installed (munge, slurmd, slurmctld...) started and
stopped inside the PC, as systemd would, on a PC that runs no systemd.

The lab's PCs share this machine's /usr, so the real systemctl would talk to this machine's init. This
script (stdlib only, run by /usr/bin/python3 inside the PC, mounted over its systemctl by
cluster.lab.switch.power_bin) reads the unit files and runs their ExecStart apart from the caller's session.
Its state is the PC's own: the enabled set as systemd keeps it (symlinks in /etc/systemd/system/*.wants,
the PC's own folder), main pids in /run/clusterctl-units (the PC's own /run), each unit's output in
/var/log/clusterctl-units/<unit>.log. `poweroff`, `halt` and `shutdown` go to the PC's power switch (a node's:
cluster.lab.power); the gateway has none and refuses them. `lab-boot`: start the enabled units, as at boot.
"""
from __future__ import annotations

import fcntl
import os
import pwd
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

SWITCH = ""  # the PC's power switch script (a node's; the gateway has none): set when the shim is installed
UNIT_DIRS = (Path("/etc/systemd/system"), Path("/lib/systemd/system"))
STATE = Path("/run/clusterctl-units")
LOGS = Path("/var/log/clusterctl-units")
PLAIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
START_TIMEOUT = 30.0  # a forking unit's ExecStart must return within this
STOP_TIMEOUT = 10.0  # SIGTERM, then SIGKILL
POWER = ("poweroff", "halt", "shutdown")
OPTIONS = {"--now", "-q", "--quiet", "--no-pager", "--no-block", "--system", "--full", "-l", "--plain",
           "--no-ask-password", "--no-legend"}
Sections = dict[str, dict[str, list[str]]]


class UnitError(Exception):
    """What makes a command fail, with systemd's exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def parse_unit(text: str) -> Sections:
    """A unit file's sections: key -> every value in order (an empty assignment resets the list, as systemd's)."""
    sections: Sections = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
        elif "=" in line and current is not None:
            key, value = (s.strip() for s in line.split("=", 1))
            current[key] = current.get(key, []) + [value] if value else []
    return sections


class Unit:
    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        self.sections = parse_unit(path.read_text())

    def all(self, section: str, key: str) -> list[str]:
        return self.sections.get(section, {}).get(key, [])

    def get(self, key: str, default: str = "", section: str = "Service") -> str:
        values = self.all(section, key)
        return values[-1] if values else default

    def conditions_met(self) -> bool:
        """ConditionPathExists= (each, `!` negates): unmet, `start` does nothing and succeeds, as systemd's."""
        for cond in self.all("Unit", "ConditionPathExists"):
            negate = cond.startswith("!")
            if Path(cond.lstrip("!|")).exists() == negate:
                return False
        return True

    def environment(self) -> dict[str, str]:
        """The ExecStart environment: a plain one, Environment= and EnvironmentFile= (`-`: may be missing)."""
        env = {"PATH": PLAIN_PATH, "LANG": "C.UTF-8"}
        user = self.get("User")
        if user:
            pw = pwd.getpwnam(user)
            env.update(HOME=pw.pw_dir, USER=user, LOGNAME=user, SHELL=pw.pw_shell)
        for line in self.all("Service", "Environment"):
            env.update(w.partition("=")[::2] for w in shlex.split(line) if "=" in w)
        for entry in self.all("Service", "EnvironmentFile"):
            path = Path(entry.lstrip("-"))
            if not path.is_file():
                if entry.startswith("-"):
                    continue
                raise UnitError(f"{self.name}: EnvironmentFile {path} does not exist")
            env.update(read_env_file(path.read_text()))
        return env

    def command(self, env: dict[str, str]) -> list[str]:
        """ExecStart as argv: its prefixes dropped, `$VAR` split into words, `${VAR}` one word, as systemd's."""
        line = self.get("ExecStart")
        if not line:
            raise UnitError(f"{self.name} has no ExecStart")
        words: list[str] = []
        for word in shlex.split(line.lstrip("-@+!:")):
            whole = re.fullmatch(r"\$(\w+)", word)
            if whole:
                words += env.get(whole.group(1), "").split()
            else:
                words.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), word))
        return words

    def installed_in(self) -> list[str]:
        """The targets `enable` hooks the unit into ([Install] WantedBy= and RequiredBy=)."""
        return [f"{t}.wants" for v in self.all("Install", "WantedBy") for t in v.split()] + \
               [f"{t}.requires" for v in self.all("Install", "RequiredBy") for t in v.split()]


def read_env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines of an EnvironmentFile (comments and blank lines skipped, one level of quotes removed)."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line and line[0] not in "#;" and "=" in line:
            key, value = (s.strip() for s in line.split("=", 1))
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            env[key] = value
    return env


def unit_name(name: str) -> str:
    return name if "." in name else f"{name}.service"


def find(name: str) -> Unit | None:
    for d in UNIT_DIRS:
        if (d / name).is_file():
            return Unit(name, d / name)
    return None


def need(name: str) -> Unit:
    unit = find(name)
    if unit is None:
        raise UnitError(f"Unit {name} not found.", 5)
    return unit


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def state_of(name: str) -> tuple[str, int]:
    """(active|inactive|failed, main pid): a recorded pid that runs is active; one that ended, failed."""
    pidfile, failed = STATE / f"{name}.pid", STATE / f"{name}.failed"
    if pidfile.exists():
        pid = int(pidfile.read_text().strip() or 0)
        if pid == 0 or _alive(pid):  # 0: a oneshot unit with RemainAfterExit=yes
            return "active", pid
        return "failed", pid
    return ("failed" if failed.exists() else "inactive"), 0


def _record(name: str, pid: int | None) -> None:
    """The unit's main pid (None: it failed to start)."""
    (STATE / f"{name}.pid").unlink(missing_ok=True)
    (STATE / f"{name}.failed").unlink(missing_ok=True)
    if pid is None:
        (STATE / f"{name}.failed").touch()
    else:
        (STATE / f"{name}.pid").write_text(f"{pid}\n")


def boot_env(name: str, env: dict[str, str]) -> dict[str, str]:
    """slurmd at the PC's power-on: -b, it reports a boot (its node's boot time is this machine's otherwise)."""
    return {**env, "SLURMD_OPTIONS": f"{env.get('SLURMD_OPTIONS', '')} -b".strip()} if name == "slurmd.service" else env


def start(name: str, boot: bool = False) -> None:
    """Start a unit as systemd would. `boot`: the PC's power-on (lab-boot); a lab PC shares this machine's
    kernel and so its boot time, and slurmd is told it booted (-b), as a real PC's new boot time tells it."""
    unit = need(name)
    if state_of(name)[0] == "active" or not unit.conditions_met():
        return
    env = boot_env(name, unit.environment()) if boot else unit.environment()
    argv = unit.command(env)
    user, group = unit.get("User") or None, unit.get("Group") or None
    uid = pwd.getpwnam(user).pw_uid if user else 0
    gid = pwd.getpwnam(user).pw_gid if user else 0
    for rd in unit.get("RuntimeDirectory").split():
        path = Path("/run") / rd
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, uid, gid if group is None else _gid(group))
        path.chmod(int(unit.get("RuntimeDirectoryMode", "0755"), 8))
    LOGS.mkdir(mode=0o755, exist_ok=True)
    kind = unit.get("Type", "simple")
    with open(LOGS / f"{name}.log", "ab") as log:
        log.write(f"-- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}: {shlex.join(argv)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                    cwd=unit.get("WorkingDirectory", "/"), start_new_session=True, user=user,
                                    group=group or (gid if user else None),
                                    extra_groups=os.getgrouplist(user, gid) if user else None)
        except OSError as e:
            _record(name, None)
            raise UnitError(f"Failed to start {name}: {argv[0]}: {e.strerror}") from None
    if kind not in ("forking", "oneshot"):
        _record(name, proc.pid)
        return
    try:
        rc = proc.wait(timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = -1
    if rc != 0:
        _record(name, None)
        raise UnitError(f"Job for {name} failed because the control process exited with error code.\n"
                        f"See {LOGS / (name + '.log')} for details.")
    if kind == "oneshot":
        if unit.get("RemainAfterExit") in ("yes", "true", "1", "on"):
            _record(name, 0)
        return
    _record(name, _pid_from(unit))


def _gid(group: str) -> int:
    import grp

    return grp.getgrnam(group).gr_gid


def _pid_from(unit: Unit) -> int | None:
    """A forking unit's main pid, from its PIDFile (written by the daemon once it runs)."""
    pidfile = unit.get("PIDFile")
    deadline = time.monotonic() + 5.0
    while pidfile and time.monotonic() < deadline:
        try:
            pid = int(Path(pidfile).read_text().strip())
            if _alive(pid):
                return pid
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


def stop(name: str) -> None:
    """SIGTERM to the main pid, then SIGKILL after STOP_TIMEOUT (bounded)."""
    need(name)
    pid = state_of(name)[1]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not pid or not _alive(pid):
            break
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
    (STATE / f"{name}.pid").unlink(missing_ok=True)
    (STATE / f"{name}.failed").unlink(missing_ok=True)


def links(name: str) -> list[Path]:
    """The unit's enablement symlinks in the PC's own /etc/systemd/system."""
    return [p for p in UNIT_DIRS[0].glob(f"*.*/{name}") if p.is_symlink()]


def enable(name: str) -> None:
    unit = need(name)
    targets = unit.installed_in()
    if not targets:
        print(f"The unit files have no installation config (WantedBy=, RequiredBy=) for {name}.", file=sys.stderr)
    for t in targets:
        link = UNIT_DIRS[0] / t / name
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(unit.path)
            print(f"Created symlink {link} \u2192 {unit.path}.", file=sys.stderr)


def disable(name: str) -> None:
    need(name)
    for link in links(name):
        link.unlink()
        print(f"Removed \"{link}\".", file=sys.stderr)


def enablement(name: str) -> str:
    unit = find(name)
    if unit is None:
        raise UnitError(f"Failed to get unit file state for {name}: No such file or directory", 1)
    if links(name):
        return "enabled"
    return "disabled" if unit.installed_in() else "static"


def boot_order() -> list[str]:
    """The enabled units, each after those it names in After= (munge before slurmd and slurmctld)."""
    enabled = sorted({p.name for p in UNIT_DIRS[0].glob("*.wants/*") if p.is_symlink()})
    after: dict[str, set[str]] = {}
    for n in enabled:
        unit = find(n)
        after[n] = {a for v in (unit.all("Unit", "After") if unit else []) for a in v.split()}
    order: list[str] = []
    while len(order) < len(enabled):
        ready = [n for n in enabled if n not in order and not (after[n] & (set(enabled) - set(order)))]
        order.append(ready[0] if ready else next(n for n in enabled if n not in order))  # a cycle: as listed
    return order


def status(name: str) -> int:
    unit = find(name)
    if unit is None:
        print(f"Unit {name} could not be found.", file=sys.stderr)
        return 4
    active, pid = state_of(name)
    print(f"\u25cf {name} - {unit.get('Description', name, 'Unit')}")
    print(f"     Loaded: loaded ({unit.path}; {enablement(name)})")
    print(f"     Active: {active}{f' (running)   Main PID: {pid}' if active == 'active' and pid else ''}")
    log = LOGS / f"{name}.log"
    if log.exists():
        print("\n" + "\n".join(log.read_text(errors="replace").splitlines()[-10:]))
    return 0 if active == "active" else 3


def power(verb: str) -> int:
    if not SWITCH:
        print(f"{verb}: this PC has no power switch of the lab's (the lab's gateway stays on)", file=sys.stderr)
        return 1
    os.execv("/bin/sh", ["sh", SWITCH])
    return 1  # not reached


def main(argv: list[str]) -> int:
    prog = Path(argv[0]).name
    if prog in (*POWER, "reboot"):
        return power(prog)
    opts = {a for a in argv[1:] if a.startswith("-")}
    words = [a for a in argv[1:] if not a.startswith("-")]
    if opts - OPTIONS:
        print(f"systemctl: unrecognized option {sorted(opts - OPTIONS)[0]!r}", file=sys.stderr)
        return 1
    if not words:
        print("systemctl: a command is needed (a lab PC lists no units)", file=sys.stderr)
        return 1
    verb, names = words[0], [unit_name(n) for n in words[1:]]
    quiet, now = bool(opts & {"-q", "--quiet"}), "--now" in opts
    if verb in POWER:
        return power(verb)
    if verb in ("daemon-reload", "reset-failed"):
        return 0
    if verb == "is-active":
        states = [state_of(n)[0] if find(n) else "inactive" for n in names]
        if not quiet:
            print("\n".join(states))
        return 0 if names and all(s == "active" for s in states) else 3
    if verb == "is-enabled":
        found = [enablement(n) for n in names]
        if not quiet:
            print("\n".join(found))
        return 0 if names and all(s in ("enabled", "static") for s in found) else 1
    if verb == "status":
        return max((status(n) for n in names), default=0)
    actions = {"start": (start,), "stop": (stop,), "restart": (stop, start), "enable": (enable, *((start,) if now else ())),
               "disable": (disable, *((stop,) if now else ())), "lab-boot": (lambda n: start(n, boot=True),)}
    if verb not in actions:
        print(f"Unknown command verb {verb}.", file=sys.stderr)
        return 1
    if os.geteuid() != 0:
        print(f"Failed to {verb} {' '.join(names)}: Access denied (use sudo)", file=sys.stderr)
        return 4
    if not names and verb != "lab-boot":
        print(f"Too few arguments: {verb} needs a unit.", file=sys.stderr)
        return 1
    STATE.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(STATE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two calls at once in one PC must not both start a unit
        code = 0
        for name in (boot_order() if verb == "lab-boot" else names):
            try:
                for action in actions[verb]:
                    action(name)
            except UnitError as e:
                print(e, file=sys.stderr)
                code = max(code, e.code)
        return code


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except UnitError as e:
        print(e, file=sys.stderr)
        sys.exit(e.code)
