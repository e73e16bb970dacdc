"""GPU model -> CUDA compute capability, for drivers whose nvidia-smi cannot report it.

R470 and older reject `--query-gpu=compute_cap` (../shared/COMPAT-FACTS.md), so
the capability is looked up from the name. Source: NVIDIA's CUDA GPUs table
(developer.nvidia.com/cuda-gpus); consumer and workstation cards a recycled lab
is likely to hold. Longer patterns come first so "1080 Ti" wins over "1080".
"""
from __future__ import annotations

import re

_TABLE: tuple[tuple[str, str], ...] = (
    # Kepler
    (r"GTX (?:TITAN|780|770|760|690|680|670|660|650)", "3.0"),
    (r"Tesla K80", "3.7"),
    (r"Tesla K40|Tesla K20", "3.5"),
    # Maxwell
    (r"GTX 750", "5.0"),
    (r"GTX 9[5-8]0|GTX TITAN X|Quadro M\d+", "5.2"),
    # Pascal
    (r"Tesla P100|Quadro GP100", "6.0"),
    (r"GTX 10[5-8]0|TITAN X(?:p| \(Pascal\))|Quadro P\d+|Tesla P4|Tesla P40", "6.1"),
    # Volta
    (r"Tesla V100|TITAN V|Quadro GV100", "7.0"),
    # Turing
    (r"GTX 16[56]0|RTX 20[6-8]0|TITAN RTX|Quadro RTX|Tesla T4", "7.5"),
    # Ampere
    (r"A100|A30\b", "8.0"),
    (r"RTX 30[5-9]0|RTX A\d000|A40\b|A10\b", "8.6"),
    # Ada
    (r"RTX 40[5-9]0|RTX \d000 Ada|L4\b|L40", "8.9"),
    # Hopper
    (r"H100|H200|GH200", "9.0"),
)


def compute_capability_for(name: str) -> str | None:
    """'NVIDIA GeForce GTX 1050 Ti' -> '6.1'; None when the model is not in the table."""
    for pattern, cc in _TABLE:
        if re.search(pattern, name, re.I):
            return cc
    return None
