"""Host patterns (`--limit`, `clusterctl hosts`): the built-in subset against Ansible itself, and its refusals.

The comparison: for every inventory of the corpus (tests/fixtures/ansible/, read by ansible-core, and
clusterctl's own inventories written out as Ansible YAML) and a list of patterns (hand-written ones and
ones generated from each inventory's names by a seeded generator that nobody tuned the matcher on), the
host set of cluster.inventory.patterns is Ansible's (InventoryManager.list_hosts, which `ansible -i INV
PATTERN --list-hosts` prints; a few are checked with that command too), or clusterctl refuses with exit 2.
A refusal is only ever one of the documented two: outside the subset (PatternError), or a term that Ansible
would ignore because it matches nothing (InventoryError naming the file and --limit).
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster import errors
from cluster.errors import ClusterError, InventoryError
from cluster.inventory import ansible_core, loader, patterns
from cluster.inventory.model import Inventory
from cluster.inventory.patterns import PatternError
from tests.conftest import FIXTURES, ROOT, write

CORPUS = FIXTURES / "ansible"
needs_ansible = pytest.mark.skipif(not ansible_core.available(),
                                   reason="ansible-core is not installed (pip install clusterctl[ansible])")

# ---------------------------------------------------------------------------------------------- the subset


GOOD = """\
hosts:
  pc01: {address: 10.0.0.1}
  pc02: {address: 10.0.0.2}
  pc03: {address: 10.0.0.3}
  pc04: {address: 10.0.0.4}
  head: {address: 10.0.0.9}
groups:
  gpu: {hosts: [pc02, pc01]}
  cpu: {hosts: [pc03, pc04]}
  lab: {hosts: [pc01, pc02, pc03, pc04]}
"""


def names(inv: Inventory, pattern: str) -> list[str]:
    return [h.name for h in inv.select(pattern)]


@pytest.fixture
def inv(tmp_path: Path) -> Inventory:
    return loader.load(write(tmp_path, GOOD), check_files=False)


@pytest.mark.parametrize("pattern, want", [
    ("gpu", ["pc01", "pc02"]),
    ("gpu:!pc01", ["pc02"]),
    ("gpu,cpu", ["pc01", "pc02", "pc03", "pc04"]),
    ("gpu:cpu", ["pc01", "pc02", "pc03", "pc04"]),
    (" gpu , pc03 ", ["pc01", "pc02", "pc03"]),
    ("lab:&cpu", ["pc03", "pc04"]),
    ("lab:!gpu:&pc0*", ["pc03", "pc04"]),
    ("!gpu:lab", ["pc03", "pc04"]),  # union first, then exclusions, whatever the order written
    ("!gpu", ["pc03", "pc04", "head"]),  # only exclusions: from all
    ("&lab", ["pc01", "pc02", "pc03", "pc04"]),
    ("all", ["pc01", "pc02", "pc03", "pc04", "head"]),
    ("*", ["pc01", "pc02", "pc03", "pc04", "head"]),
    ("ungrouped", ["head"]),
    ("pc0?", ["pc01", "pc02", "pc03", "pc04"]),
    ("pc0[!12]", ["pc03", "pc04"]),
    ("PC01,pc01", None),  # case-sensitive: PC01 matches nothing -> refused
    ("~pc0[12]", ["pc01", "pc02"]),
    ("~01", None),  # re.match: anchored at the start
    ("~.*c", ["pc01", "pc02", "pc03", "pc04"]),
    ("gpu[0]", ["pc02"]),  # the group's own order: [pc02, pc01]
    ("gpu[-1]", ["pc01"]),
    ("lab[1:2]", ["pc02", "pc03"]),  # inclusive
    ("lab[2:]", ["pc03", "pc04"]),
    ("lab[0:0]", ["pc01"]),
    ("lab[1:9]", ["pc02", "pc03", "pc04"]),  # past the end: what there is, as Ansible
    ("all[-1]", ["head"]),
    ("*[1]", ["pc02"]),
    ("gpu[0]:cpu[1]", ["pc02", "pc04"]),
    ("lab[0:2]:!gpu[1]", ["pc02", "pc03"]),
])
def test_the_subset_selects_as_ansible_does(inv: Inventory, pattern: str, want: list[str] | None) -> None:
    if want is None:
        with pytest.raises(InventoryError, match="--limit: .* matches no host or group"):
            inv.select(pattern)
    else:
        assert names(inv, pattern) == want  # always in inventory order


def test_no_limit_is_every_host_and_a_host_named_exactly_wins(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, GOOD.replace("  lab: {hosts: [pc01, pc02, pc03, pc04]}",
                                                   "  head: {hosts: [pc01]}")), check_files=False)
    assert names(inv, "") == list(inv.hosts)
    assert names(inv, "head") == ["head"]  # the host, not the group of that name (_evaluate_patterns)
    assert names(inv, "!head") == ["pc02", "pc03", "pc04", "head"]  # a prefixed term goes by groups first


@pytest.mark.parametrize("pattern, says, fix", [
    ("@hosts.txt", "limit file", "list the hosts"),
    ("gpu,pc03:pc04", "a ':' in a comma-separated pattern", "one separator"),
    ("pc01:22", "only digits", "','"),
    ("gpu::cpu", "empty part", "single ':'"),
    ("fe80:0:0:0:0:0:0:1", "IPv6", "name the host"),
    ("pc[1-3]", "[x-y] subscript", "[1:3]"),
    ("lab[-1:]", "subscript Ansible cannot read", "[i:j]"),
    ("lab[:2]", "subscript Ansible cannot read", "[i:j]"),
    ("lab[3:1]", "reversed range", "[1:3]"),
    ("lab[7]", "no host at [7]", "[0] to [3]"),
    ("gpu cpu", "whitespace", "','"),
    ("gpu, pc 03", "whitespace inside a term", "','"),
    ("!", "'!' with nothing after it", "!NAME"),
    ("gpu:&", "'&' with nothing after it", "&NAME"),
    ("!!gpu", "'!' after '!'", "one prefix"),
    ("&!gpu", "'!' after '&'", "one prefix"),
    ("~", "empty regular expression", "all"),
    ("~pc(", "not a regular expression", "~pc0[12]"),
    ("gpu[", "'[' without its ']'", "subscript"),
    ("gpu]", "']' without its '['", "subscript"),
    ("pc$", "'$' is in no host or group name", "~REGEX"),
    ("", "empty pattern", "leave it out"),
])
def test_what_the_subset_refuses_is_exit_2_with_the_term_and_the_fix(inv: Inventory, pattern: str, says: str,
                                                                     fix: str) -> None:
    if pattern == "":
        with pytest.raises(PatternError) as exc:
            patterns.match(pattern, list(inv.hosts), inv.groups, str(inv.path))
    else:
        with pytest.raises(PatternError) as exc:
            inv.select(pattern)
    e = exc.value
    assert e.exit_code == errors.EXIT_USAGE
    assert says in e.message and f"--limit {pattern!r}" in e.message, e.message
    assert e.fix and fix in e.fix, e.fix


def test_matching_nothing_keeps_the_error_naming_file_and_limit(inv: Inventory) -> None:
    for pattern, what in (("nope", "'nope' matches no host or group"), ("gpu:!pc09", "'!pc09' matches no host"),
                          ("gpu:&cpu", "'gpu:&cpu' selects no host"), ("localhost", "'localhost' matches no"),
                          ("lab[5:7]", "'lab[5:7]' matches no host")):
        with pytest.raises(InventoryError) as exc:
            inv.select(pattern)
        assert exc.value.file == str(inv.path) and exc.value.field == "--limit" and what in exc.value.message
        assert exc.value.exit_code == errors.EXIT_USAGE
    with pytest.raises(InventoryError) as exc:
        inv.select("pc0[12]")  # a subscript to Ansible, not a character class: said so, with the regex
    assert "subscript of 'pc0'" in exc.value.message and exc.value.fix and "~pc0[12]" in exc.value.fix


def test_subscripts_on_an_ansible_inventory_read_without_ansible_are_refused() -> None:
    inv = loader.load(CORPUS / "yaml_nested_children" / "hosts.yml", check_files=False, reader="builtin")
    assert names(inv, "gpu:!pc01") == ["pc02"]
    with pytest.raises(PatternError, match="subscript on an Ansible inventory") as exc:
        inv.select("room204[0]")
    assert exc.value.fix and "clusterctl[ansible]" in exc.value.fix


def test_a_group_named_like_an_implicit_one_is_refused(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, "hosts: {a: {address: 10.0.0.1}, b: {address: 10.0.0.2}}\n"
                                      "groups: {all: {hosts: [a]}}\n"), check_files=False)
    with pytest.raises(InventoryError, match="a group named 'all' is not Ansible's 'all'"):
        inv.select("a")


TEXT = st.text(alphabet="abpc0123*?[]!&~:,.-_@ ()^$\\{}|+\t", max_size=14) | st.text(max_size=8)


@settings(max_examples=400, deadline=None)
@given(pattern=TEXT)
def test_any_text_is_a_selection_or_exit_2_never_a_crash(pattern: str) -> None:
    hosts = ["pc01", "pc02", "pc03", "a.b", "c-d"]
    groups = {"gpu": ("pc01", "pc02"), "ab": ("a.b",), "ungrouped": ("pc03", "c-d")}
    try:
        got = patterns.match(pattern, hosts, groups, "inv.yaml")
    except ClusterError as e:
        assert e.exit_code == errors.EXIT_USAGE
    else:
        assert got and set(got) <= set(hosts)


# ---------------------------------------------------------------------------------------------- against Ansible

# Run in a child (Ansible's process-wide state stays out of pytest), independent of clusterctl's code: per
# pattern, what `ansible -i INV PATTERN --list-hosts` lists (InventoryManager.list_hosts), Ansible's error if
# it refused, and which of split_host_pattern's terms match no host of the inventory on their own.
REFERENCE = r"""
import json, sys
from ansible.utils.display import Display
Display.warning = lambda self, msg, *a, **k: None
from ansible.inventory.manager import InventoryManager, split_host_pattern
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader
init_plugin_loader()
inv = InventoryManager(loader=DataLoader(), sources=[sys.argv[1]])
known = set(inv.hosts)
out = {}
for p in json.loads(sys.stdin.read()):
    try:
        listed = [str(h) if isinstance(h, str) else str(h.name) for h in inv.list_hosts(p)]
        empty = []
        for t in split_host_pattern(p):
            body = t[1:] if t[:1] in ("!", "&") else t
            if not [h for h in inv.get_hosts(body) if h.name in known]:
                empty.append(t)
        out[p] = {"hosts": [h for h in listed if h in known], "empty_terms": empty}
    except Exception as e:
        out[p] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


def ansible_answers(source: Path, pats: list[str]) -> dict[str, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-c", REFERENCE, str(source)], input=json.dumps(pats), capture_output=True,
                       text=True, timeout=300, env={"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin",
                                                    "HOME": str(Path.home())})
    assert r.returncode == 0, r.stderr
    answers: dict[str, dict[str, Any]] = json.loads(r.stdout.splitlines()[-1])
    return answers


def own_as_ansible(inv: Inventory, tmp_path: Path) -> Path:
    """A clusterctl inventory written as the Ansible YAML inventory of the same hosts and groups."""
    doc = {"all": {"hosts": {h: {"ansible_host": inv.hosts[h].address} for h in inv.hosts},
                   "children": {g: {"hosts": {m: None for m in members}} for g, members in inv.groups.items()}}}
    p = tmp_path / f"{inv.path.stem}-as-ansible.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


HAND_WRITTEN = ["all", "*", "ungrouped", "gpu", "gpu:!pc01", "gpu,cpu", "lab:&cpu", "!gpu", "&gpu", "pc0*",
                "pc0?", "~pc0[12]", "~.*0", "pc0[!1]", "gpu[0]", "gpu[-1]", "lab[1:2]", "lab[1:]", "lab[0:0]",
                "all[0]", "*[1]", "al*", "ung*", "*.lab.example", "~^web", "web*:&~.*2", "!pc01:!pc02",
                "room204:!gpu", "pascal[1]", "cpu:gpu:!pc03", "lab[0:9]", "nope", "gpu:!nope", "localhost",
                "10.99.*", "box-?.lab", "node[13579]", "addresses[-1]", "odd[1:3]", "pcs:&odd", "*:!*"]


def generated(inv: Inventory, n: int, seed: int, subscripts: bool = True) -> list[str]:
    """Patterns from the inventory's own names, by a grammar of the subset and a little outside it."""
    rng = random.Random(seed)
    table = patterns.group_table(list(inv.hosts), inv.groups)
    words = list(inv.hosts) + [g for g, members in table.items() if members]  # an empty group: a refusal each time
    share = 0.2 if subscripts else 0.05  # subscripts are refused on Ansible inventories read without Ansible

    def term() -> str:
        w = rng.choice(words)
        kind = rng.random()
        if kind < 0.40:
            t = w
        elif kind < 0.60:
            cut = rng.randrange(0, len(w) + 1)
            t = w[:cut] + rng.choice(["*", "?", "*" + w[-1:]])
        elif kind < 0.75:
            t = "~" + rng.choice([w[:2], w[:3] + ".*", ".*" + w[-1:], w[:1] + "[0-9a-z]"])
        elif kind < 0.75 + share:
            i, j = rng.randrange(-2, 4), rng.randrange(0, 5)
            t = w + rng.choice([f"[{i}]", f"[{abs(i)}:{j}]", f"[{abs(i)}:]"])
        else:
            t = w[:-1] + rng.choice(["0", "9", "x"]) if len(w) > 1 else w
        return rng.choice(["", "", "", "", "", "!", "&"]) + t

    out = []
    for _ in range(n):
        sep = rng.choice([",", ":"])
        out.append(sep.join(term() for _ in range(rng.choice([1, 1, 2, 2, 3, 4]))))
    return out


def _case_sources() -> list[tuple[str, Path, bool]]:
    """(name, Ansible source, own?) for every inventory compared."""
    found = []
    for d in sorted(CORPUS.glob("*/case.yaml")):
        spec = yaml.safe_load(d.read_text())
        if not spec.get("refuse"):
            found.append((d.parent.name, d.parent / spec["source"], False))
    found += [("own:mixed", FIXTURES / "launch" / "mixed.yaml", True), ("own:local", ROOT / "inventory" / "local.yaml",
                                                                        True)]
    return found


OWN_SYNTHETIC = [GOOD, """\
hosts:
  n1: {address: 10.0.0.1}
  n2: {address: 10.0.0.2}
  n3: {address: 10.0.0.3}
  n4: {address: 10.0.0.4}
  w1.lab: {address: 10.0.0.5}
groups:
  odd: {hosts: [n3, n1]}
  even: {hosts: [n4, n2]}
  all_n: {hosts: [n4, n3, n2, n1]}
  web: {hosts: [w1.lab, n1]}
  empty: {hosts: []}
"""]


def compare(inv: Inventory, source: Path, pats: list[str], subscripts: bool) -> dict[str, int]:
    """Every pattern: clusterctl's set is Ansible's, or clusterctl refuses (as documented); the tally."""
    answers = ansible_answers(source, pats)
    tally = {"same": 0, "refused": 0, "no match": 0}
    for p in pats:
        want = answers[p]
        try:
            got = patterns.match(p, list(inv.hosts), inv.groups, str(inv.path), subscripts=subscripts)
        except PatternError:
            tally["refused"] += 1
            continue
        except InventoryError as e:
            # a term Ansible ignores (it matches nothing), a pattern that selects nothing, or Ansible's own refusal
            assert "error" in want or not want["hosts"] or want["empty_terms"], (p, want, e.message)
            tally["no match"] += 1
            continue
        assert "error" not in want, (p, want, got)
        assert set(got) == set(want["hosts"]), (p, got, want)
        assert not want["empty_terms"], (p, want)  # clusterctl would have refused a term matching nothing
        tally["same"] += 1
    return tally


@needs_ansible
@pytest.mark.parametrize("name, source, own", _case_sources(), ids=[c[0] for c in _case_sources()])
def test_the_subset_equals_ansible_on_the_corpus(name: str, source: Path, own: bool, tmp_path: Path) -> None:
    if own:
        inv = loader.load(source, check_files=False)
        source = own_as_ansible(inv, tmp_path)
    else:
        inv = loader.load(source, check_files=False, reader="ansible")  # Ansible's hosts and groups
    made = generated(inv, 150, seed=len(name), subscripts=own)
    compare(inv, source, HAND_WRITTEN, subscripts=own)
    tally = compare(inv, source, made, subscripts=own)
    assert tally["same"] >= len(made) // 4, tally  # a matcher that refuses everything would pass otherwise


@needs_ansible
@pytest.mark.parametrize("text", OWN_SYNTHETIC, ids=["good", "reordered-groups"])
def test_the_subset_equals_ansible_with_subscripts_on_own_inventories(text: str, tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, text), check_files=False)
    made = generated(inv, 300, seed=7)
    source = own_as_ansible(inv, tmp_path)
    compare(inv, source, HAND_WRITTEN, subscripts=True)
    tally = compare(inv, source, made, subscripts=True)
    assert tally["same"] >= len(made) // 4, tally


@needs_ansible
def test_the_builtin_reader_gives_the_subset_the_same_groups_as_ansible() -> None:
    """On the built-in path the matcher sees the built-in reader's groups: the same sets as Ansible's."""
    for name, source, own in _case_sources():
        if own:
            continue
        try:
            builtin = loader.load(source, check_files=False, reader="builtin")
        except InventoryError:
            continue  # refused by the built-in reader: the subset never sees it
        pats = [p for p in HAND_WRITTEN if "[" not in p.replace("~pc0[12]", "")]
        compare(builtin, source, pats, subscripts=False)


@needs_ansible
def test_the_reference_is_what_the_ansible_command_lists(tmp_path: Path) -> None:
    ansible = shutil.which("ansible", path=str(Path(sys.executable).parent)) or shutil.which("ansible")
    if ansible is None:
        pytest.skip("no `ansible` command beside ansible-core")
    source = CORPUS / "yaml_nested_children" / "hosts.yml"
    pats = ["gpu:!pc01", "room204:&cpu", "~pc0[13]", "all[-1]"]
    answers = ansible_answers(source, pats)
    for p in pats:
        r = subprocess.run([ansible, "-i", str(source), p, "--list-hosts"], capture_output=True, text=True,
                           timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "ANSIBLE_NOCOLOR": "1"})
        listed = [line.strip() for line in r.stdout.splitlines()[1:] if line.strip()]
        assert r.returncode == 0 and set(listed) == set(answers[p]["hosts"]), (p, r.stdout, r.stderr)


@needs_ansible
def test_the_ansible_path_uses_ansibles_own_matcher() -> None:
    source = CORPUS / "yaml_nested_children" / "hosts.yml"
    inv = loader.load(source, check_files=False, reader="ansible")
    assert inv.ansible_core and inv.matcher.startswith("ansible-core ")
    pats = ["gpu:!pc01", "room204[0:1]", "~pc0[13]", "room204:&cpu"]
    answers = ansible_answers(source, pats)
    for p in pats:
        assert set(names(inv, p)) == set(answers[p]["hosts"]), p
    for p, says in (("nope", "'nope' matches no host or group"), ("gpu:&cpu", "selects no host"),
                    ("room204[9]", "Ansible refused the pattern"), ("localhost", "'localhost' matches no host")):
        with pytest.raises(InventoryError, match=says) as exc:
            inv.select(p)
        assert exc.value.field == "--limit" and exc.value.exit_code == errors.EXIT_USAGE
    # cached like the inventory's answer: the same selection again without a child process
    assert ansible_core.match([source], "gpu:!pc01") == ["pc02"]


# ---------------------------------------------------------------------------------------------- `clusterctl hosts`


def test_hosts_lists_what_a_pattern_selects_without_contact(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    from cluster.cli import main

    key = tmp_path / "id_lab"
    key.write_text("not read: only its path is shown\n")
    key.chmod(0o600)
    p = write(tmp_path, GOOD.replace("pc03: {address: 10.0.0.3}",
                                     f"pc03: {{address: 10.0.0.3, port: 2222, user: lab, identity_file: {key}}}"))
    assert main(["hosts", "lab:!gpu", "-i", str(p), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pattern"] == "lab:!gpu" and doc["matcher"].startswith("clusterctl")
    assert [(h["name"], h["address"], h["port"], h["user"], h["identity_file"]) for h in doc["hosts"]] == [
        ("pc03", "10.0.0.3", 2222, "lab", str(key)), ("pc04", "10.0.0.4", 22, doc["hosts"][1]["user"], None)]
    assert main(["hosts", "-i", str(p), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["hosts"]) == 5  # default: all
    assert main(["hosts", "gpu", "-i", str(p)]) == 0
    shown = capsys.readouterr()
    assert "2 of 5 hosts match 'gpu'" in shown.out and "10.0.0.2" in shown.out and "nothing was contacted" in shown.err
    assert main(["hosts", "gpu:pc[1-2]", "-i", str(p)]) == 2
    assert "[x-y] subscript" in capsys.readouterr().err
    assert main(["hosts", "nope", "-i", str(p)]) == 2
    assert "PATTERN: 'nope' matches no host or group" in capsys.readouterr().err
