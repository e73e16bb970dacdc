"""Ansible inventories read by Ansible itself (ansible-core, the optional extra `clusterctl[ansible]`).

Any source Ansible reads (INI, YAML, TOML, a directory of them, group_vars/ and host_vars/ beside
them) is parsed, layered and templated by ansible-core, so clusterctl gets the answer the lab's own
`ansible` command would use at run time, never a re-implementation that drifts.

Why Ansible's inventory API in a child process, and not `ansible-inventory --list`:
- `ansible-inventory --list` prints variables untemplated (`ansible_user: "{{ lab_user }}"` stays
  literal) and leaves the choice between `ansible_host` and `ansible_ssh_host` (and the other legacy
  aliases) to the connection plugin. The child does what Ansible's task executor does before it
  connects: a Templar over the host's variables, then the connection plugin's own option resolution
  (`host`, `remote_user`, `port`, `private_key_file`), which also honours ansible.cfg and ANSIBLE_*.
- A child process, not an import: the wait is bounded (an inventory script or plugin may hang),
  Ansible's process-wide state (config, plugin loaders, its display on stdout) stays out of
  clusterctl, and the child runs with PYTHONHASHSEED=0 so every answer is reproducible.
- Licence: ansible-core is GPLv3. clusterctl (Apache-2.0) does not vendor, copy or link it: it is an
  optional extra the user installs, run at run time as its own interpreter process.

The resolved result is cached under paths.home()/cache/ansible/, keyed by every source file's path,
mtime and size (group_vars/ and host_vars/ included), the Ansible config file, the ANSIBLE_*
environment, the working directory and the ansible-core version; any change re-reads the inventory.
Sources parsed by a dynamic plugin or an inventory script are never cached.

`match` asks the same child (`--match PATTERN`) for the hosts a `--limit` pattern selects, by Ansible's
own matcher (InventoryManager.subset + get_hosts), cached beside the answer under the same key plus the
pattern; cluster.inventory.patterns is the subset used where Ansible did not read the inventory.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

from cluster import paths
from cluster.inventory import ansible_yaml
from cluster.inventory.ansible_answer import Answer, AnsweredHost, Conn
from cluster.errors import InventoryError

FORMAT_VERSION = 1  # bump when the child's answer changes shape: old cache entries are then ignored
TIMEOUT_S = 120.0
INSTALL_FIX = "install clusterctl[ansible] to read this inventory with Ansible's own rules"
STATIC_PLUGINS = ("yaml", "ini", "toml")  # sources these parse are files: safe to cache by mtime
# Ansible warnings that mean part of the inventory was not read: refused, never a partial inventory.
_FATAL_WARNINGS = ("Unable to parse", "Failed to parse", "Skipping", "not a valid group")


def available() -> bool:
    """Whether ansible-core can be imported by this interpreter (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("ansible.inventory.manager") is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- the head's side


def source_files(source: Path) -> list[Path]:
    """Every file and folder whose change can change what Ansible reads from `source`."""
    found: list[Path] = []
    roots = [source] if source.is_dir() else [source, source.parent / "group_vars", source.parent / "host_vars"]
    for root in roots:
        if not root.exists():
            continue
        found.append(root)
        if root.is_dir():
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                found += [Path(dirpath) / d for d in dirnames] + [Path(dirpath) / f for f in sorted(filenames)]
    return found


def cache_key(sources: Iterable[Path]) -> str:
    """Changes whenever any input of Ansible's answer changes (files, config, environment)."""
    h = hashlib.sha256()
    parts: list[Any] = [FORMAT_VERSION, sys.executable, str(Path.cwd())]
    for source in sources:
        parts.append(str(source.absolute()))
        for f in source_files(source):
            try:
                st = f.stat()
            except OSError:
                continue
            parts.append([str(f.absolute()), st.st_mtime_ns, st.st_size, f.is_dir()])
    cfg = ansible_yaml.ansible_cfg()
    if cfg is not None:
        st = cfg.stat()
        parts.append(["config", str(cfg.absolute()), st.st_mtime_ns, st.st_size])
    parts.append(sorted((k, v) for k, v in os.environ.items() if k.startswith("ANSIBLE_")))
    try:
        from importlib.metadata import version

        parts.append(version("ansible-core"))
    except Exception:  # noqa: BLE001 - not installed as a distribution: the key just has no version
        parts.append(None)
    h.update(json.dumps(parts, default=str).encode())
    return h.hexdigest()


def _cache_dir() -> Path:
    return paths.home() / "cache" / "ansible"


def resolve(sources: list[Path], timeout: float = TIMEOUT_S, use_cache: bool = True) -> Answer:
    """Ansible's resolved answer for `sources` (see the module doc), from the cache when still valid."""
    shown = ", ".join(str(s) for s in sources)
    key = cache_key(sources)
    cached = _cache_dir() / f"{key}.json"
    if use_cache:
        try:
            doc: Answer = json.loads(cached.read_text())
            if doc.get("format") == FORMAT_VERSION:
                doc["cached"] = True
                return doc
        except (OSError, ValueError):
            pass
    doc = _child(sources, [], timeout)  # the same shape as the cached one
    fatal = [w for w in doc["warnings"] if any(m in w for m in _FATAL_WARNINGS)]
    if fatal:
        raise InventoryError(shown, None, None, "Ansible did not read all of the inventory: " + "; ".join(fatal),
                             "fix the inventory until `ansible-inventory --list` shows no warning")
    doc["format"] = FORMAT_VERSION
    doc["cached"] = False
    if use_cache and all(p in STATIC_PLUGINS for p in doc["plugins"].values()):
        _store(cached, doc)
    return doc


def _store(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _child(sources: list[Path], mode: list[str], timeout: float) -> Any:
    """The child's JSON answer (`mode` before the sources: [] reads the inventory, ["--match", P] matches P)."""
    shown = ", ".join(str(s) for s in sources)
    env = {**os.environ, "PYTHONHASHSEED": "0", "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    # the child imports this module by name, wherever the command runs from
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "cluster.inventory.ansible_core", *mode, *(str(s) for s in sources)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=os.getcwd(), stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise InventoryError(shown, None, None, f"Ansible did not finish reading the inventory in {timeout:g} s",
                             "a dynamic inventory script or plugin may hang; try `ansible-inventory --list -i "
                             f"{shown}`") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise InventoryError(shown, None, None, f"Ansible could not read the inventory: {tail}",
                             f"run `ansible-inventory --list -i {shown}` to see Ansible's full message")
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise InventoryError(shown, None, None, "Ansible's answer could not be read (not JSON)",
                             f"run `ansible-inventory --list -i {shown}` to check the inventory") from None


def match(sources: list[Path], pattern: str, option: str = "--limit", timeout: float = TIMEOUT_S,
          use_cache: bool = True) -> list[str]:
    """The hosts Ansible's own matcher selects with `pattern` (as `ansible-playbook --limit PATTERN` does:
    InventoryManager.subset, then get_hosts), in Ansible's order; cached as the inventory's answer is.

    Kept as strict as the built-in subset (cluster.inventory.patterns): a term that matches no host of the
    inventory (Ansible warns and ignores it; its implicit localhost is no node) and a pattern that selects
    nothing are errors naming the file and `option`; Ansible's own errors (a subscript out of range, a
    regex that does not compile, a missing @FILE) are exit 2 with its message.
    """
    shown = ", ".join(str(s) for s in sources)
    if "\0" in pattern:  # no process argument can carry it
        raise InventoryError(shown, None, option, f"{pattern!r}: a NUL character in the pattern", "remove it")
    key = hashlib.sha256(json.dumps([cache_key(sources), "match", pattern]).encode()).hexdigest()
    cached = _cache_dir() / f"match-{key}.json"
    doc: dict[str, Any] | None = None
    if use_cache:
        try:
            doc = json.loads(cached.read_text())
        except (OSError, ValueError):
            doc = None
    if doc is None or doc.get("format") != FORMAT_VERSION:
        doc = _child(sources, ["--match", pattern], timeout)
        doc["format"] = FORMAT_VERSION
        if use_cache and doc.get("error") is None and all(p in STATIC_PLUGINS for p in doc["plugins"].values()):
            _store(cached, doc)
    fix = f"Ansible's host patterns: `ansible -i {shown} '{pattern}' --list-hosts` shows what Ansible selects"
    if doc.get("error"):
        raise InventoryError(shown, None, option, f"Ansible refused the pattern {pattern!r}: {doc['error']}", fix)
    for term in doc["unmatched"]:
        raise InventoryError(shown, None, option, f"'{term}' matches no host or group", fix)
    if not doc["hosts"]:
        raise InventoryError(shown, None, option, f"'{pattern}' selects no host", fix)
    return [str(h) for h in doc["hosts"]]


# --------------------------------------------------------------------------- the child (imports Ansible)


def _jsonable(value: Any) -> Any:
    """Ansible's tagged values as plain JSON types (str/int/float/bool/None/list/dict)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return {"__unsupported__": type(value).__name__}


def _origin(value: Any) -> list[Any] | None:
    """Where Ansible read `value` (file, line), when its data tags say so (internal API: best effort)."""
    try:
        from ansible._internal._datatag._tags import Origin

        o = Origin.get_tag(value)
        return [o.path, o.line_num] if o is not None and o.path else None
    except Exception:  # noqa: BLE001 - diagnostics only; another ansible-core simply gives none
        return None


def _share_compiled_templates() -> None:
    """Compile each distinct template string once for all hosts, not once per host.

    A lab's group vars put the same `{{ ... }}` on every host; Ansible compiles a template for each
    use (~5 ms each), which is most of the cost of a 200-host inventory. A compiled template is a
    function of the variables it is rendered with, so sharing it across hosts changes no answer.
    Internal API of ansible-core 2.19: where it differs, templates are simply compiled as usual.
    """
    try:
        from ansible._internal._templating._engine import TemplateEngine
    except ImportError:
        return
    original = getattr(TemplateEngine, "_compile_template", None)
    if original is None:
        return
    compiled: dict[Any, Any] = {}

    def compile_once(self: Any, template: str, options: Any) -> Any:
        try:
            key = (id(self.environment), str(template), options)
            hash(key)
        except Exception:  # noqa: BLE001 - unhashable options: compile as Ansible would
            return original(self, template, options)
        if key not in compiled:
            compiled[key] = original(self, template, options)
        return compiled[key]

    TemplateEngine._compile_template = compile_once


def _capture_display(warnings: list[str], plugins: dict[str, str]) -> None:
    """Ansible's warnings collected (any that means a partial read is refused) and each source's plugin."""
    from ansible.utils.display import Display

    def warning(self: Any, msg: str, *args: Any, **kwargs: Any) -> None:
        warnings.append(str(msg))

    def error_as_warning(self: Any, msg: str | None, exception: BaseException, *args: Any, **kwargs: Any) -> None:
        warnings.append(f"{msg or ''} {exception}".strip())

    def vvv(self: Any, msg: str, host: str | None = None) -> None:
        prefix = "Parsed "
        if msg.startswith(prefix) and " inventory source with " in msg:
            src, _, plugin = msg[len(prefix):].rpartition(" inventory source with ")
            plugins[src] = plugin.removesuffix(" plugin")

    Display.warning = warning
    Display.error_as_warning = error_as_warning
    Display.vvv = vvv


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _templated_vars(templar: Any, inventory_vars: dict[str, Any], internal: Any
                    ) -> tuple[dict[str, Any], dict[str, str], dict[str, list[Any] | None]]:
    """A host's inventory variables templated one by one: values, errors (per variable) and origins."""
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    origins: dict[str, list[Any] | None] = {}
    for k, raw in inventory_vars.items():
        if k in internal:
            continue
        origins[str(k)] = _origin(raw) or _origin(k)
        try:
            values[str(k)] = _jsonable(templar.template(raw))
        except Exception as e:  # noqa: BLE001 - any template failure is reported for that var
            errors[str(k)] = _error_text(e)
    return values, errors, origins


class _Connections:
    """The fields clusterctl uses, decided by the connection plugin itself (paramiko's own aliases
    for paramiko, ssh's otherwise), from the same templated variables the task executor gives it."""

    def __init__(self) -> None:
        self.plugins: dict[str, Any] = {}  # set_options recomputes every option: one instance serves all hosts

    def fields(self, templar: Any, values: dict[str, Any], errors: dict[str, str],
               runtime_vars: dict[str, Any]) -> Conn:
        from ansible import constants as C
        from ansible.playbook.play_context import PlayContext
        from ansible.plugins.loader import connection_loader

        connection = values.get("ansible_connection") if "ansible_connection" not in errors else None
        if connection is None:
            connection = C.DEFAULT_TRANSPORT
        connection = "ssh" if connection == "smart" else str(connection)
        plugin_name = "paramiko" if connection in ("paramiko", "paramiko_ssh") else "ssh"
        if plugin_name not in self.plugins:
            self.plugins[plugin_name] = connection_loader.get(plugin_name, PlayContext())
        plugin = self.plugins[plugin_name]
        var_options: dict[str, Any] = {"_extras": {}}
        for var in C.config.get_plugin_vars("connection", plugin._load_name):
            if var in values:  # templated above: the same value, not compiled twice
                var_options[var] = values[var]
            elif var in runtime_vars and var not in errors:
                try:
                    var_options[var] = templar.template(runtime_vars[var])
                except Exception as e:  # noqa: BLE001
                    errors.setdefault(var, _error_text(e))
        plugin.set_options(var_options=var_options)
        conn: Conn = {"connection": connection}
        for field, option in (("address", "remote_addr" if plugin_name == "paramiko" else "host"),
                              ("user", "remote_user"), ("port", "port"), ("key", "private_key_file")):
            try:
                conn[field] = _jsonable(plugin.get_option(option))
            except KeyError:
                conn[field] = None
        return conn


def child_main(sources: list[str]) -> Answer:
    """Runs in the child: Ansible reads, layers and templates; the answer is plain JSON."""
    from ansible import constants as C
    from ansible import release
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import init_plugin_loader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    warnings: list[str] = []
    plugins: dict[str, str] = {}
    _capture_display(warnings, plugins)
    _share_compiled_templates()
    init_plugin_loader()
    loader = DataLoader()
    inv = InventoryManager(loader=loader, sources=sources)
    vm = VariableManager(loader=loader, inventory=inv)
    hosts_out: list[AnsweredHost] = []
    templar = Templar(loader=loader)
    connections = _Connections()
    for name, host in inv.hosts.items():
        inventory_vars = vm.get_vars(host=host, include_hostvars=False, stage="all")
        runtime_vars = vm.get_vars(host=host, include_hostvars=True)
        templar.available_variables = runtime_vars
        values, errors, origins = _templated_vars(templar, inventory_vars, C.INTERNAL_STATIC_VARS)
        conn = connections.fields(templar, values, errors, runtime_vars)
        hosts_out.append({
            "name": str(name),
            "groups": sorted(str(g.name) for g in host.get_groups() if g.name != "all"),
            "conn": conn,
            "vars": values,
            "errors": errors,
            "origins": origins,
        })
    order = [h["name"] for h in hosts_out]
    groups = {
        str(g): sorted((str(h.name) for h in grp.get_hosts()), key=order.index)
        for g, grp in inv.groups.items() if g != "all"
    }
    return {
        "ansible": release.__version__,
        "config_file": C.CONFIG_FILE,
        "default_transport": C.DEFAULT_TRANSPORT,
        "plugins": plugins,
        "warnings": warnings,
        "hosts": hosts_out,
        "groups": groups,
    }


def child_match(pattern: str, sources: list[str]) -> dict[str, Any]:
    """Runs in the child: the hosts Ansible selects with `pattern` as a --limit, and the terms that match
    no host of the inventory (each term asked alone, its `!`/`&` taken off)."""
    from ansible import release
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import init_plugin_loader

    warnings: list[str] = []
    plugins: dict[str, str] = {}
    _capture_display(warnings, plugins)
    init_plugin_loader()
    inv = InventoryManager(loader=DataLoader(), sources=sources)
    known = set(inv.hosts)
    hosts: list[str] = []
    unmatched: list[str] = []
    error = None
    try:
        inv.subset(pattern)
        hosts = [str(h.name) for h in inv.get_hosts("all") if h.name in known]
        for term in getattr(inv, "_subset", None) or []:  # the terms, @FILE's lines included
            body = term[1:] if term[:1] in ("!", "&") else term
            if term and not any(h.name in known for h in inv.get_hosts(body, ignore_limits=True)):
                unmatched.append(str(term))
    except Exception as e:  # noqa: BLE001 - Ansible's refusal (or its crash on a pattern like `!`): the user's
        error = _error_text(e)
    return {"ansible": release.__version__, "hosts": hosts, "unmatched": unmatched, "error": error,
            "warnings": warnings, "plugins": plugins}


def _main(argv: list[str]) -> int:
    # Ansible's display may print on stdout: keep stdout for the answer alone.
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    doc: Any = child_match(argv[1], argv[2:]) if argv[:1] == ["--match"] else child_main(argv)
    answer.write(json.dumps(doc))
    answer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))  # the child process run by load(): its own exit code
