"""What a failed run tells the user beyond its log: the fix, where the log says it plainly."""
from __future__ import annotations

from cluster.runs import records


def test_a_failure_whose_log_names_a_missing_module_says_how_to_add_it() -> None:
    """The failure lines as a real lab run recorded them (a program importing tabulate, not installed)."""
    log = ["Traceback (most recent call last):",
           ' File "/srv/cluster/runs/nt-20261207-144156-6b42/program/needs_tabulate.py", line 4, in <module>',
           "   from tabulate import tabulate", "ModuleNotFoundError: No module named 'tabulate'", "...", "[0]:",
           "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 22611) "]
    fix = records.Failure("node1", "exit code 1", log).fix()
    assert fix is not None and fix.startswith("tabulate is not in the nodes' environment")
    assert "requirements.txt" in fix and "--requirements FILE" in fix
    dotted = records.Failure("node1", "exit code 1", ["[rank1]: ModuleNotFoundError: No module named 'sklearn.svm'"])
    assert (dotted.fix() or "").startswith("sklearn is not")
    assert records.Failure("node1", "exit code 1", ["RuntimeError: boom"]).fix() is None


def test_cuda_asked_of_a_node_without_a_gpu_is_said_so() -> None:
    """torch's own words (torch/cuda/__init__.py _lazy_init) on a PC without a driver; said only where launch
    found no GPU on that node."""
    log = ["[rank0]:   File \"/srv/cluster/venv/lib/python3.11/site-packages/torch/cuda/__init__.py\", line 412, in "
           "_lazy_init", "[rank0]:     torch._C._cuda_init()",
           "[rank0]: RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU "
           "and installed a driver from http://www.nvidia.com/Download/index.aspx"]
    f = records.Failure("node2", "exit code 1", log)
    assert (f.fix(gpus=0) or "").startswith("node2 has no NVIDIA GPU")
    assert f.fix(gpus=1) is None and f.fix() is None
