#!/usr/bin/env python3
"""Regenerate Ansible's own answers for the inventory corpus (tests/fixtures/ansible/*/answer.json).

For every case folder (its case.yaml names the inventory `source`), ansible-core itself is asked,
independently of clusterctl's code:
- `ansible-inventory -i SOURCE --list`: groups, hosts and untemplated variables;
- a one-play `ansible-playbook` run, nothing contacted: `debug` of group_names, groups and the
  hosts' order, `lookup('vars', name)` of every inventory variable (templated as at run time), and a
  `raw` task over the ssh connection plugin with ssh_executable=/bin/echo, so the command line Ansible
  would run (address, Port, User, IdentityFile) is printed instead of run.
Run from the repository root with ansible-core installed: `.venv/bin/python scripts/ansible_answers.py`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "ansible"
MARK = "CLUSTERCTL_MARK"
PLAY = """\
- hosts: all
  gather_facts: false
  tasks:
    - name: facts
      debug:
        msg:
          group_names: "{{ group_names }}"
          groups: "{{ groups }}"
          order: "{{ hostvars | list }}"
    - name: var
      debug:
        msg: "{{ lookup('vars', item) }}"
      loop: "{{ clusterctl_names[inventory_hostname] }}"
      ignore_errors: true
    - name: ssh
      raw: %s
      ignore_errors: true
      vars:
        ansible_connection: ssh
""" % MARK
# A stdout callback that writes every task's result per host as JSON (ansible-core ships no json
# callback of its own; ansible.posix's is a separate collection).
CALLBACK = """\
import json, os
from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "cc_dump"

    def __init__(self):
        super().__init__()
        self.out = {}

    def _keep(self, result):
        task, host = result._task.get_name(), result._host.get_name()
        self.out.setdefault(task, {})[host] = json.loads(json.dumps(result._result, default=str))

    def v2_runner_on_ok(self, result):
        self._keep(result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._keep(result)

    def v2_runner_on_unreachable(self, result):
        self._keep(result)

    def v2_playbook_on_stats(self, stats):
        with open(os.environ["CC_DUMP"], "w") as f:
            json.dump(self.out, f)
"""


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def _portable(value: Any, case: Path) -> Any:
    """Paths of this checkout and this user's home written as $CASE and ~, so answers travel."""
    text = json.dumps(value)
    text = text.replace(str(case), "$CASE").replace(str(Path.home()), "~")
    return json.loads(text)


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def _ssh_line(stdout: str) -> dict[str, Any]:
    words = stdout.split()
    i = 0
    while words[i].startswith("-"):  # ssh's options: `-o X` pairs and flags; then the host
        i += 2 if words[i] in ("-o", "-i", "-p", "-l", "-F") else 1
    out: dict[str, Any] = {"address": words[i], "port": None, "user": None, "key": None}
    for w in words:
        for opt, field in (("Port=", "port"), ("User=", "user"), ("IdentityFile=", "key")):
            if w.startswith(opt):
                v = w[len(opt):].strip('"')
                out[field] = int(v) if field == "port" else v
    return out


def answer(case: Path) -> dict[str, Any]:
    spec = yaml.safe_load((case / "case.yaml").read_text())
    source = case / spec["source"]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)  # no ansible.cfg, group_vars or playbook folder of ours around
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        env.update({"ANSIBLE_CONFIG": str(cwd / "none.cfg"), "ANSIBLE_NOCOLOR": "1", "PYTHONHASHSEED": "0",
                    "ANSIBLE_LOCAL_TEMP": str(cwd / "tmp"), "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cwd / "cp")})
        r = _run([_bin("ansible-inventory"), "-i", str(source), "--list"], cwd, env)
        if r.returncode != 0:
            return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed"}
        listing = json.loads(r.stdout)
        hostvars = listing["_meta"]["hostvars"]
        hosts = sorted({h for g in listing.values() if isinstance(g, dict) for h in g.get("hosts", [])} | set(hostvars))
        names = {h: sorted(hostvars.get(h, {})) for h in hosts}
        (cwd / "play.yaml").write_text(PLAY)
        (cwd / "callback_plugins").mkdir()
        (cwd / "callback_plugins" / "cc_dump.py").write_text(CALLBACK)
        extra = {"clusterctl_names": names, "ansible_ssh_executable": "/bin/echo"}
        env2 = {**env, "ANSIBLE_STDOUT_CALLBACK": "cc_dump", "ANSIBLE_HOST_KEY_CHECKING": "0",
                "ANSIBLE_CALLBACK_PLUGINS": str(cwd / "callback_plugins"), "CC_DUMP": str(cwd / "dump.json")}
        r = _run([_bin("ansible-playbook"), "-i", str(source), "play.yaml", "-e", json.dumps(extra)], cwd, env2)
        try:
            tasks = json.loads((cwd / "dump.json").read_text())
        except (OSError, ValueError):
            return {"error": f"ansible-playbook: {(r.stderr + r.stdout).strip()[-300:]}"}
        per_host: dict[str, Any] = {}
        order: list[str] = []
        groups: dict[str, list[str]] = {}
        for h in hosts:
            facts = tasks["facts"][h]["msg"]
            order, groups = facts["order"], facts["groups"]
            values: dict[str, Any] = {}
            for item in tasks.get("var", {}).get(h, {}).get("results", []):
                values[item["item"]] = ({"__error__": item.get("msg", "failed")[:200]} if item.get("failed")
                                        else item["msg"])
            ssh = tasks["ssh"][h]
            per_host[h] = {"group_names": facts["group_names"], "vars": values,
                           "ssh": None if ssh.get("failed") or not ssh.get("stdout", "").split()
                           else _ssh_line(ssh["stdout"])}
        return _portable({"ansible": _run([_bin("ansible"), "--version"], cwd, env).stdout.split("\n")[0],
                          "list": listing, "order": order,
                          "groups": {g: m for g, m in groups.items() if g != "all"}, "hosts": per_host}, case)


def main() -> int:
    cases = sorted(p.parent for p in CORPUS.glob("*/case.yaml"))
    wanted = set(sys.argv[1:])
    for case in cases:
        if wanted and case.name not in wanted:
            continue
        doc = answer(case)
        (case / "answer.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"{case.name}: {'ERROR ' + doc['error'] if 'error' in doc else str(len(doc['hosts'])) + ' hosts'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
