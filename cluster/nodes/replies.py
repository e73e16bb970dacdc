"""Reading what a command on a node printed: the agent's JSON reply and the tail of an error.

Every helper that runs a clusterctl script on a node (node agent, environment check, all-reduce test,
collect's manifest) prints one JSON object on its last output line; the reason a command failed is
usually at the end of its output. One place reads both, so every caller reads them the same way.
"""
from __future__ import annotations

import json
from typing import Any


def agent_reply(stdout: str | None) -> dict[str, Any] | None:
    """The JSON object on the last output line, or None (no output, not JSON, not an object)."""
    try:
        doc = json.loads((stdout or "").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return doc if isinstance(doc, dict) else None


def error_tail(text: str | None, chars: int = 300) -> str:
    """The end of a command's output, where the reason usually is."""
    return (text or "").strip()[-chars:]
