"""metav1.Time, resourceVersion and API error bodies, the one home every module reads them from."""
from __future__ import annotations

import datetime as dt

import pytest

from ddpjob_operator.base.objmeta import error_body, format_time, parse_time, resource_version

UTC = dt.timezone.utc


@pytest.mark.parametrize("given, written", [
    (1_800_000_005.0, "2027-01-15T08:00:05Z"),                                       # Unix seconds
    (1_800_000_005.9, "2027-01-15T08:00:05Z"),                                       # whole seconds
    (dt.datetime(2026, 11, 22, 16, 0, 0, 123456, tzinfo=UTC), "2026-11-22T16:00:00Z"),
    (dt.datetime(2026, 11, 22, 17, 0, 0, tzinfo=dt.timezone(dt.timedelta(hours=1))), "2026-11-22T16:00:00Z"),
    (dt.datetime(2026, 11, 22, 16, 0, 0), "2026-11-22T16:00:00Z"),                   # naive is UTC
    (None, None),
])
def test_format_time_writes_what_kubernetes_writes(given, written):
    assert format_time(given) == written


@pytest.mark.parametrize("text, parsed", [
    ("2026-11-22T16:00:00Z", dt.datetime(2026, 11, 22, 16, tzinfo=UTC)),
    ("2026-11-22T17:00:00+01:00", dt.datetime(2026, 11, 22, 16, tzinfo=UTC)),
    ("2026-11-22T16:00:00.5Z", dt.datetime(2026, 11, 22, 16, 0, 0, 500000, tzinfo=UTC)),   # MicroTime
    ("2026-11-22T16:00:00", dt.datetime(2026, 11, 22, 16, tzinfo=UTC)),   # naive: UTC, comparable
    ("yesterday", None), ("", None), (None, None),
])
def test_parse_time_reads_any_rfc3339_and_refuses_quietly(text, parsed):
    assert parse_time(text) == parsed


def test_a_written_time_reads_back():
    t = dt.datetime(2026, 11, 22, 16, 0, 0, tzinfo=UTC)
    assert parse_time(format_time(t)) == t


@pytest.mark.parametrize("obj, rv", [({"metadata": {"resourceVersion": "42"}}, "42"), ({"metadata": {}}, ""),
                                     ({}, ""), (None, "")])
def test_resource_version(obj, rv):
    assert resource_version(obj) == rv


@pytest.mark.parametrize("body, data", [
    ('{"kind": "Status", "message": "no"}', {"kind": "Status", "message": "no"}),
    (b'{"kind": "Status", "reason": "Invalid"}', {"kind": "Status", "reason": "Invalid"}),
    ({"message": "as given"}, {"message": "as given"}),
    (b"404 page not found\xff", {"message": "404 page not found\ufffd"}),  # a plain page, not JSON
    ("[1, 2]", {}), (None, {}),
])
def test_an_api_error_body_is_read_as_a_dict(body, data):
    assert error_body(body) == data
