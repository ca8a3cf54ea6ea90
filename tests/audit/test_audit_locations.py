"""Paths and URIs for the archive and the audit's outputs: read once (``Location``), written where they
name, never into a local folder named after a URI's scheme. No Spark here."""

from __future__ import annotations

import os
from datetime import timedelta

import pyarrow.parquet as pq
import pytest

from celery_outbox.audit.archive import ParquetArchiver
from celery_outbox.audit.location import Location
from celery_outbox.errors import ConfigurationError
from celery_outbox.store import utcnow

from ..apps.factory import make_shop
from .conftest import T0, sent


@pytest.mark.parametrize("text, local", [
    ("file:///data/my archive", "/data/my archive"),
    ("file:/data/my archive/", "/data/my archive"),
    ("file://localhost/data/a%20b", "/data/a%20b"),  # as Hadoop reads it: no percent-decoding
    ("/data/my archive", "/data/my archive"),
])
def test_a_local_path_or_file_uri_is_a_local_location(text, local):
    location = Location.of(text)
    assert (location.local, location.uri, str(location)) == (local, f"file:{local}", local)
    assert location.child("aggregates", "lost").local == f"{local}/aggregates/lost"


def test_a_relative_path_is_taken_from_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Location.of("audit out").local == str(tmp_path / "audit out")


def test_a_uri_of_another_filesystem_is_kept_as_given():
    location = Location.of("s3a://bucket/audit/")
    assert (location.local, location.uri, str(location)) == (None, "s3a://bucket/audit", "s3a://bucket/audit")
    assert str(location.child("report.html")) == "s3a://bucket/audit/report.html"


@pytest.mark.parametrize("text", ["file://elsewhere/data", "file:data"])
def test_a_file_uri_of_another_host_or_a_relative_one_is_refused(text):
    with pytest.raises(ValueError, match=text):
        Location.of(text)


@pytest.mark.parametrize("as_uri", [True, False], ids=["file-uri", "path"])
def test_the_archiver_writes_where_a_path_with_spaces_or_its_file_uri_says(tmp_path, monkeypatch, as_uri):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "outbox data" / "archive"
    ParquetArchiver(f"file://{folder}" if as_uri else str(folder)).archive("sent", [sent(1, T0), sent(2, T0)])
    (part,) = (folder / "sent" / f"date={T0.date().isoformat()}").iterdir()
    assert sorted(pq.read_table(part).column("message_id").to_pylist()) == ["m1", "m2"]
    assert os.listdir(tmp_path) == ["outbox data"], "nothing written beside it"


def test_a_uri_pyarrow_cannot_write_is_a_configuration_error_not_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match="outbox_archive_path nosuch://bucket/archive"):
        ParquetArchiver("nosuch://bucket/archive")
    assert os.listdir(tmp_path) == []


def test_cleanup_archives_to_an_outbox_archive_path_given_as_a_file_uri_with_spaces(sqlite_url, table_prefix,
                                                                                     tmp_path):
    folder = tmp_path / "outbox data" / "archive"
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_archive_path=f"file://{folder}")
    shop.outbox.ready()
    store = shop.outbox.store
    now = utcnow()
    with store.begin() as conn:
        store.insert_incoming(conn, dict(message_id="old", destination="", status="handled", received_at=now,
                                         handled_at=now, keep_until=now - timedelta(seconds=1)))
    assert shop.outbox.cleanup().archived == 1
    (part,) = (folder / "incoming" / f"date={now.date().isoformat()}").iterdir()
    assert pq.read_table(part).column("message_id").to_pylist() == ["old"]


def test_a_location_shown_to_people_masks_a_password_in_its_uri():
    """The printed lines and ``summary.json`` show where the archive is, never its credentials."""
    assert str(Location.of("s3a://AKIAKEY:s3cr3t@bucket/outbox")) == "s3a://AKIAKEY:***@bucket/outbox"
    assert str(Location.of("s3a://bucket/outbox")) == "s3a://bucket/outbox"
    assert Location.of("s3a://AKIAKEY:s3cr3t@bucket/outbox").uri == "s3a://AKIAKEY:s3cr3t@bucket/outbox", \
        "Spark still gets the URI as given"
