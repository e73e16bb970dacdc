"""`ssh -G`'s answers kept between commands (cluster.inventory.sshconfig_cache), asked of the real OpenSSH:
used again while the files OpenSSH read are unchanged, asked again when any of them (an Include, a file a
glob finds, the system's config) changes, never trusted from a damaged file, never kept for a `Match exec`."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.inventory import sshconfig, sshconfig_cache
from cluster.inventory.model import Host

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's ssh (openssh-client)")


def aged(path: Path, age_s: float = 3600) -> Path:
    """`path` as a file last changed `age_s` ago: a config edited just now is not kept (RACY_S)."""
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def write(path: Path, text: str, age_s: float = 3600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return aged(path, age_s)


def tamper(cache: Path, **answer: object) -> dict[str, Any]:
    """The cache file's document with host pc1's answer changed (OpenSSH's defaults left as they are)."""
    doc: dict[str, Any] = json.loads(cache.read_text())
    for entry in doc["entries"].values():
        if entry["answer"]["hostname"] == ["pc1"]:
            entry["answer"].update(answer)
    return doc


def resolve(tmp_path: Path, name: str, config: Path | None) -> tuple[Host, sshconfig.Resolver]:
    """One command's resolution of host `name` (a new Resolver, as a new clusterctl process has)."""
    r = sshconfig.Resolver(str(tmp_path / "inv.yaml"))
    return r.resolve(Host(name=name, address=name, ssh_config=str(config) if config else None), ()), r


def test_an_unchanged_config_is_answered_from_the_cache(tmp_path: Path) -> None:
    cfg = write(tmp_path / "ssh_config", "Host pc*\n  Port 2201\n  User bob\n")
    first, r = resolve(tmp_path, "pc1", cfg)
    assert (first.port, first.user, r.asked) == (2201, "bob", 2)  # the host's question and OpenSSH's defaults
    again, r = resolve(tmp_path, "pc1", cfg)
    assert again == first and r.asked == 0
    cache = sshconfig_cache.cache_file()
    assert cache.parent == Path(os.environ["CLUSTERCTL_HOME"]) / "cache" and cache.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("changed", ["config", "include"])
def test_a_changed_config_or_included_file_is_asked_again(tmp_path: Path, changed: str) -> None:
    inc = write(tmp_path / "more.conf", "Host pc1\n  Port 2201\n")
    cfg = write(tmp_path / "ssh_config", f"Include {inc}\nHost pc1\n  User bob\n")
    assert resolve(tmp_path, "pc1", cfg)[0].port == 2201
    target, line = (cfg, "  User ann\n") if changed == "config" else (inc, "  Port 2202\n")
    text = target.read_text().rsplit("\n", 2)[0] + "\n" + line
    write(target, text, age_s=1800)  # the same size: only its mtime tells it apart
    host, r = resolve(tmp_path, "pc1", cfg)
    assert (host.user, host.port) == (("ann", 2201) if changed == "config" else ("bob", 2202))
    assert r.asked == 1  # OpenSSH's defaults (no file) are still the cache's


def test_a_file_added_where_an_include_glob_looks_is_read(tmp_path: Path) -> None:
    write(tmp_path / "conf.d" / "a.conf", "Host pc1\n  Port 2201\n")
    cfg = write(tmp_path / "ssh_config", f"Include {tmp_path}/conf.d/*.conf\n")
    assert resolve(tmp_path, "pc2", cfg)[0].port == 22
    write(tmp_path / "conf.d" / "b.conf", "Host pc2\n  Port 2202\n")
    host, r = resolve(tmp_path, "pc2", cfg)
    assert host.port == 2202 and r.asked == 1


def test_relative_includes_are_where_openssh_looks(tmp_path: Path) -> None:
    """A relative Include is in ~/.ssh for a user's config (or -F), in the system config's folder for it."""
    home, etc = tmp_path / "home", tmp_path / "etc"
    user = write(home / ".ssh" / "config", "Include conf.d/*\n")
    system = write(etc / "ssh_config", "Include sys.d/*\n")
    before = sshconfig_cache.inputs(str(user), home=str(home), system=str(system))
    default = sshconfig_cache.inputs("default", home=str(home), system=str(system))
    assert before[0] is not None and default[0] is not None
    write(tmp_path / "conf.d" / "x", "Port 1\n")  # beside the file, where OpenSSH does not look
    assert sshconfig_cache.inputs(str(user), home=str(home), system=str(system)) == before
    write(home / ".ssh" / "conf.d" / "x", "Port 1\n")
    assert sshconfig_cache.inputs(str(user), home=str(home), system=str(system)) != before
    after_user = sshconfig_cache.inputs("default", home=str(home), system=str(system))
    write(etc / "sys.d" / "y", "Port 2\n")
    assert default != after_user != sshconfig_cache.inputs("default", home=str(home), system=str(system))


def test_a_changed_system_config_is_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No -F: OpenSSH reads ~/.ssh/config and the system's file (here one the test owns, in its place)."""
    system = write(tmp_path / "ssh_config", "Host *\n  SendEnv LANG\n")
    monkeypatch.setattr(sshconfig, "DEFAULT_FILES", (sshconfig.DEFAULT_FILES[0], str(system)))
    assert resolve(tmp_path, "pc1", None)[1].asked == 2
    assert resolve(tmp_path, "pc1", None)[1].asked == 0
    write(system, system.read_text() + "# edited\n")
    assert resolve(tmp_path, "pc1", None)[1].asked == 1


@pytest.mark.parametrize("damage", ["not json", "another format", "an entry of another shape", "writable by others"])
def test_a_damaged_cache_is_ignored_and_rewritten(tmp_path: Path, damage: str) -> None:
    cfg = write(tmp_path / "ssh_config", "Host pc1\n  Port 2201\n")
    resolve(tmp_path, "pc1", cfg)
    cache = sshconfig_cache.cache_file()
    # well formed but false: it must not be believed where the file is damaged
    doc = tamper(cache, port=["9999"], proxycommand="nc evil 22" if damage == "an entry of another shape" else ["none"])
    text = {"not json": json.dumps(doc)[:-40], "another format": json.dumps({**doc, "format": 0})}
    cache.write_text(text.get(damage, json.dumps(doc)))
    if damage == "writable by others":
        cache.chmod(0o666)
    host, r = resolve(tmp_path, "pc1", cfg)
    assert (host.port, host.proxy_command) == (2201, None)
    assert r.asked == (1 if damage == "an entry of another shape" else 2)  # that entry only, or the whole file
    assert resolve(tmp_path, "pc1", cfg)[1].asked == 0  # written whole again, and ours


def test_the_file_is_trusted_only_as_ours(tmp_path: Path) -> None:
    """The same false entry, in a file of ours that is writable by no one else, is what the cache says: the
    test above refuses it for its damage, not by chance."""
    cfg = write(tmp_path / "ssh_config", "Host pc1\n  Port 2201\n")
    resolve(tmp_path, "pc1", cfg)
    cache = sshconfig_cache.cache_file()
    cache.write_text(json.dumps(tamper(cache, port=["9999"])))
    assert resolve(tmp_path, "pc1", cfg)[0].port == 9999


@pytest.mark.parametrize("line", ['Match exec "true"', 'Match host pc1 !exec "false"', "IdentityFile ${HOME}/k"])
def test_an_answer_that_depends_on_more_than_the_files_is_never_kept(tmp_path: Path, line: str) -> None:
    cfg = write(tmp_path / "ssh_config", f"Host pc1\n  Port 2201\n{line}\n  User bob\n")
    for asked in (2, 1):  # the config's question every time; OpenSSH's defaults (no file) are kept
        host, r = resolve(tmp_path, "pc1", cfg)
        assert (host.port, host.user, r.asked) == (2201, "bob", asked)
    assert str(cfg) in r.not_kept and ("Match exec" in r.not_kept[str(cfg)] or "environment" in r.not_kept[str(cfg)])


def test_a_config_changed_just_now_is_not_kept_yet(tmp_path: Path) -> None:
    """Its next edit could fall in the same mtime tick and keep its size: asked again until it is older."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host pc1\n  Port 2201\n")
    assert resolve(tmp_path, "pc1", cfg)[1].asked == 2
    assert resolve(tmp_path, "pc1", cfg)[1].asked == 1
    aged(cfg)
    resolve(tmp_path, "pc1", cfg)
    assert resolve(tmp_path, "pc1", cfg)[1].asked == 0


def test_the_file_keeps_the_newest_entries_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sshconfig_cache, "MAX_ENTRIES", 3)
    for i in range(5):
        sshconfig_cache.store({f"k{i}": {"inputs": "d", "answer": {"port": [str(i)]}}})
    assert list(sshconfig_cache.load()) == ["k2", "k3", "k4"]


def test_resolve_all_asks_a_shared_question_once(tmp_path: Path) -> None:
    """16 hosts at once, 8 threads: OpenSSH's defaults are asked once, not once per thread that needs them."""
    cfg = write(tmp_path / "ssh_config", "Host *\n  User bob\n")
    r = sshconfig.Resolver(str(tmp_path / "inv.yaml"))
    names = [f"pc{i}" for i in range(16)]
    hosts = r.resolve_all(lambda n: r.resolve(Host(name=n, address=n, ssh_config=str(cfg)), ()), names)
    assert r.asked == 17 and all(h.user == "bob" for h in hosts.values())
    r2 = sshconfig.Resolver(str(tmp_path / "inv.yaml"))
    r2.resolve_all(lambda n: r2.resolve(Host(name=n, address=n, ssh_config=str(cfg)), ()), names)
    assert r2.asked == 0
