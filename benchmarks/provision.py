"""No-op re-provision of a 16-node simulated lab: clusterctl vs an equivalent Ansible playbook.

    .venv/bin/python benchmarks/provision.py [--nodes 16] [--repeats 5]

Both sides find every node already provisioned and only check it, with the same
checks: facts, the work directory, the venv (existing interpreter), the network
settings file, the two helper scripts, the environment stamp. ansible-core is
installed in the benchmark's own virtual environment (never the project's), forks =
number of nodes. The nodes share one environment with the frameworks (the inventory
explicitly asks for it: `python_env: existing`), because 16 fresh venvs would need
~130 GB here. Contacts only the lab it starts (own name and subnet); removes it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import lab_parser, median_time, print_timing_table  # noqa: E402
from cluster.provision import wheelhouse  # noqa: E402
from cluster.provision import apply, compat
from cluster.lab import lifecycle

ANSIBLE_PLAYBOOK = """\
- hosts: lab
  gather_facts: true
  tasks:
    - name: work directory
      ansible.builtin.file: {path: "{{ workdir }}", state: directory}
    - name: existing interpreter runs
      ansible.builtin.command: "{{ env_python }} -c 'import sys'"
      changed_when: false
    - name: network settings
      ansible.builtin.copy: {src: "{{ files }}/{{ inventory_hostname }}.env", dest: "{{ workdir }}/cluster.env"}
    - name: environment check script
      ansible.builtin.copy: {src: "{{ files }}/envcheck.py", dest: "{{ workdir }}/clusterctl/envcheck.py"}
    - name: all-reduce test script
      ansible.builtin.copy: {src: "{{ files }}/allreduce.py", dest: "{{ workdir }}/clusterctl/allreduce.py"}
    - name: environment stamp
      ansible.builtin.shell: "find {{ purelib }} -maxdepth 2 -printf '%P %s %T@\\\\n' | sort | sha256sum"
      changed_when: false
    - name: recorded state
      ansible.builtin.slurp: {src: "{{ workdir }}/clusterctl/state.json"}
"""


def sh(cmd: list[str], env: dict[str, str] | None = None, what: str = "") -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{what or cmd[0]} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p



def main() -> int:
    args = lab_parser(__doc__, "pbench", "10.73.0.0/24", repeats=5).parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="clusterctl-pbench-"))
    home = tmp / "home"
    env = {**os.environ, "CLUSTERCTL_HOME": str(home)}
    print("setting up: ansible-core in its own venv, one shared framework env, a lab", file=sys.stderr)
    sh([sys.executable, "-m", "venv", str(tmp / "ansible")])
    sh([str(tmp / "ansible/bin/pip"), "install", "-q", "ansible-core"], what="pip install ansible-core")
    ansible_version = sh([str(tmp / "ansible/bin/ansible"), "--version"]).stdout.splitlines()[0]

    build = compat.build_plan([compat.node_options("x", [])], torch_index=None).builds["x"]
    reqs = build.requirements() + list(apply.EXTRA_PACKAGES)
    wh = wheelhouse.build(reqs, "3.11")
    shared = tmp / "sharedenv"
    sh(["/usr/bin/python3", "-m", "venv", str(shared)])
    (tmp / "lock.txt").write_text(wh.lock_text)
    sh([str(shared / "bin/pip"), "install", "-q", "--no-index", "--find-links", str(wh.dir), "-r",
        str(tmp / "lock.txt")], what="shared env install")

    state = lifecycle.up(args.nodes, name=args.name, subnet=args.subnet, directory=tmp / "lab")
    try:
        inv = yaml.safe_load(Path(state.inventory).read_text())
        inv["defaults"]["python"] = str(shared / "bin/python")
        inv["defaults"]["vars"].update({"python_env": "existing"})
        inv_path = tmp / "inventory.yaml"
        inv_path.write_text(yaml.safe_dump(inv))
        first = sh([sys.executable, "-m", "cluster", "provision", str(inv_path), "--json"], env, "first provision")
        report = json.loads(first.stdout)
        purelib = report["nodes"][0]["fingerprint"]["purelib"]

        # Ansible: same nodes, same key and known_hosts, the files provision put there as the source
        d = Path(state.dir)
        files = tmp / "files"
        files.mkdir()
        for n in state.nodes:
            shutil.copyfile(Path(n.dir) / "srv/cluster.env", files / f"{n.name}.env")
        for f in ("envcheck.py", "allreduce.py"):
            shutil.copyfile(Path(state.nodes[0].dir) / "srv/clusterctl" / f, files / f)
        (tmp / "site.yml").write_text(ANSIBLE_PLAYBOOK)
        (tmp / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"lab": {
            "hosts": {n.name: {"ansible_host": n.address} for n in state.nodes},
            "vars": {"ansible_user": "root", "ansible_ssh_private_key_file": str(d / "id_ed25519"),
                     "ansible_ssh_common_args": f"-o UserKnownHostsFile={d / 'known_hosts'} -o StrictHostKeyChecking=yes",
                     "ansible_python_interpreter": "/usr/bin/python3", "workdir": "/srv/cluster",
                     "env_python": str(shared / "bin/python"), "files": str(files), "purelib": purelib}}}}}))
        (tmp / "ansible.cfg").write_text(f"[defaults]\nforks = {args.nodes}\nhost_key_checking = True\n"
                                         "stdout_callback = default\n")
        aenv = {**os.environ, "ANSIBLE_CONFIG": str(tmp / "ansible.cfg")}

        def clusterctl() -> None:
            r = sh([sys.executable, "-m", "cluster", "provision", str(inv_path), "--json"], env, "provision")
            doc = json.loads(r.stdout)
            assert doc["nothing_to_do"], "a no-op run must change nothing"

        def ansible() -> None:
            r = sh([str(tmp / "ansible/bin/ansible-playbook"), "-i", str(tmp / "hosts.yml"), str(tmp / "site.yml")],
                   aenv, "ansible-playbook")
            assert "changed=0" in r.stdout and "failed=0" in r.stdout, r.stdout[-2000:]

        results = {"ansible-playbook (baseline)": median_time(ansible, args.repeats),
                   "clusterctl provision": median_time(clusterctl, args.repeats)}
    finally:
        lifecycle.down(args.name, tmp / "lab")
        shutil.rmtree(tmp, ignore_errors=True)

    base = results["ansible-playbook (baseline)"][0]
    print(f"\nno-op re-provision of {args.nodes} simulated nodes, median of {args.repeats} runs "
          f"({os.cpu_count()} cores; {ansible_version}, forks {args.nodes})\n")
    print_timing_table(results, "speed-up", lambda med: base / med, digits=2)
    print(f"\ntarget: clusterctl at least 10x faster than Ansible: {base / results['clusterctl provision'][0]:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
