"""Groups for pytest-xdist's ``--dist loadgroup``: the tests of one group run on one
worker, one at a time, so a session engine (Slurm, Ray, Chromium, Patroni) starts once
a run, not once per worker that happens to get one of its tests.

xdist's scheduler reads a test's group from an ``@group`` suffix of its node id, which
xdist 3.8's worker writes to ``item._nodeid``. pytest 9.2 keeps a node's id in
``item._id`` (a ``NodeId``), so that suffix never shows and every group is silently
spread over the workers: each then started its own Ray cluster, four at once on two
cores, and Ray's 30 s raylet registration timed out. ``write_group_suffixes`` writes
the suffix where this pytest reads it, last of the collection hooks (an id already
carrying it is left alone, so an xdist that does it right makes this a no-op);
``worker_of`` lets a test check it."""

from __future__ import annotations

import os

import pytest
from _pytest.nodeid import NodeId


def groups_of(item: pytest.Item) -> list[str]:
    """The xdist groups ``item`` is marked with, sorted (xdist joins them with ``_``)."""
    return sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                   for mark in item.iter_markers("xdist_group")})


def write_group_suffixes(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker running ``--dist loadgroup``, give each grouped item's node id
    its ``@group`` suffix (as xdist means to)."""
    if not config.getoption("loadgroup", False):
        return
    for item in items:
        names = groups_of(item)
        ident = getattr(item, "_id", None)
        if not names or ident is None:  # no group, or a pytest whose ids xdist writes itself
            continue
        suffix = "@" + "_".join(names)
        if item.nodeid.endswith(suffix):
            continue
        # Parsed from the suffixed text, as the controller parses a report's id: the ids
        # then compare equal on both sides (``--lf`` finds a grouped test it recorded).
        item._id = NodeId.parse(f"{item.nodeid}{suffix}")


def worker_of() -> str:
    """The xdist worker running this test (``gw0``...), or ``main`` without xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


class GroupSuffixes:
    """``write_group_suffixes`` as the last collection hook (tests/conftest.py registers it)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        write_group_suffixes(config, items)
