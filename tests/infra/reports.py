"""A pytest hook keeping one failed test one failed test."""

from __future__ import annotations

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """A failure is reported even when Python 3.11's parser trips while pytest reads the
    failing test's source for the traceback (``SystemError: AST constructor recursion depth
    mismatch``, CPython gh-106905): the report is made again with a plain traceback, so one
    failed test stays one failed test instead of ending the whole run with INTERNALERROR."""
    try:
        return (yield)
    except SystemError as exc:
        if "recursion depth mismatch" not in str(exc):
            raise
        style = item.config.option.tbstyle
        item.config.option.tbstyle = "native"
        try:
            return pytest.TestReport.from_item_and_call(item, call)
        finally:
            item.config.option.tbstyle = style
