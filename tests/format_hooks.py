"""The format suite's hooks: checks that are one format's own and cannot be data.

A format's ``tests/formats/<name>/suite.yaml`` names its hooks (``hooks: [name, ...]``); the
suite (tests/test_formats.py) calls each with the format's :class:`tests.format_kit.FormatData`.
A hook is the last resort: a case, policy, cut, detection expectation or typed-marker input is
data; a hook is for what a rendering and a golden cannot say (a property of a tokenizer, a
comparison with another format's parse, a third-party golden file). Each hook says why it is
one.
"""
from __future__ import annotations

import pytest  # noqa: F401  (hooks use pytest.raises)

import chatgrammar as cg  # noqa: F401
from tests.format_kit import FormatData  # noqa: F401


def straddling_only(got, want, conv_ids, policy, name) -> None:
    """``examples_mask_check``: id mode differs from the mapped mask only at tokens straddling
    a reported boundary (a soft marker whose edge falls inside a merged BPE token: the
    documented rule trains the whole token, which text offsets cannot say)."""
    assert {i for i, (a, b) in enumerate(zip(got, want)) if a != b} <= \
        {b.offset for b in conv_ids.boundaries}, name


def soft_straddling_only(got, want, conv_ids, policy, name) -> None:
    """``examples_mask_check``: as :func:`straddling_only`, for soft-marker boundaries only,
    and only under a policy that drops a block (with every block trained, the mapped mask is
    exact: the straddling token trains either way)."""
    soft = {b.offset for b in conv_ids.boundaries if "soft marker" in b.message}
    if policy is None or (policy.thinking and policy.tool_calls):
        assert got == want, name
    else:
        assert {k for k, (a, b) in enumerate(zip(got, want)) if a != b} <= soft, name
