"""A pytest hook keeping one failed test one failed test."""

from __future__ import annotations

import traceback

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    """The report of a test, as pytest makes it, even when Python 3.11's parser trips
    while pytest reads the failing test's source for the traceback (``SystemError: AST
    constructor recursion depth mismatch``, CPython gh-106905): the failure is then
    reported with a plain traceback, so one failed test stays one failed test instead
    of ending the whole run with INTERNALERROR. Not a wrapper: every other hook (xfail,
    the layers' guards) still sees the report."""
    try:
        return pytest.TestReport.from_item_and_call(item, call)
    except SystemError as exc:
        if "recursion depth mismatch" not in str(exc) or call.excinfo is None:
            raise
        text = "".join(traceback.format_exception(call.excinfo.value))
        sections = [(f"Captured {key} {when}", content) for when, key, content in item._report_sections]
        return pytest.TestReport(item.nodeid, item.location, dict.fromkeys(item.keywords, 1), "failed", text,
                                 call.when, sections, call.duration, call.start, call.stop,
                                 user_properties=item.user_properties)
