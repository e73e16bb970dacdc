from __future__ import annotations

import os

import pytest

from cluster.lab import lifecycle
from cluster.errors import LabError


def test_lab_refuses_without_root_with_the_reason_and_the_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LabError) as e:
        lifecycle.preflight()
    assert "needs root" in e.value.message and "inventory/local.yaml" in (e.value.fix or "")
    assert e.value.exit_code == 4
