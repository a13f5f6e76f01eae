"""The in-process cluster (tests/unit/inproc.py) as a fixture, one per test."""
from __future__ import annotations

import pytest

from tests.unit.inproc import InprocCluster


@pytest.fixture
def cluster():
    c = InprocCluster()
    yield c
    c.close()
