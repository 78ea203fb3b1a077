"""The fuzz tests' system under test (one for the directory's tests, restarted when a test
left a process dead, stopped once the run leaves tests/fuzz so it does not idle through the
rest of the suite) and, when `PDSERVE_FUZZ_CASES` is set (`make fuzz`), their figures as
one JSON line as the last line of the run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_support import Cluster, figures_json

HERE = Path(__file__).parent
_clusters: list[Cluster] = []


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    _clusters.append(c)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def fresh_cluster(cluster: Cluster) -> Cluster:
    """The cluster, every process alive (a test before may have killed one)."""
    cluster.restart_if_dead()
    return cluster


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or HERE not in Path(nextitem.path).parents:
        for c in _clusters:
            c.stop()  # a later fuzz test (reordered runs) starts it again


def pytest_unconfigure(config: pytest.Config) -> None:
    """After pytest's own summary: the last line of the run."""
    if os.environ.get("PDSERVE_FUZZ_CASES"):
        print(figures_json(), flush=True)
