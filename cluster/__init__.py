"""clusterctl: turn a room of recycled PCs into a distributed deep-learning cluster."""
from __future__ import annotations

__version__ = "0.1.0"
