"""Each tenant's archive is its folder ``tenants/<name>`` of ``outbox_archive_path``
(``tenancy.tenant_folder``): a tenant's cleanup writes there, the default store's under the kinds'
folders, and the default store's audit lists only its own files. The audit of a tenant on Spark:
tests/audit/test_audit_tenants.py."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from celery import Celery

from celery_outbox import Outbox, using_tenant
from celery_outbox.core.tenancy import tenant_folder
from celery_outbox.errors import UnknownTenant
from celery_outbox.store import utcnow


@pytest.mark.parametrize("root, folder", [
    ("/srv/outbox archive", "/srv/outbox archive/tenants/acme"),
    ("/srv/archive/", "/srv/archive/tenants/acme"),
    ("relative/archive", "relative/archive/tenants/acme"),
    ("file:///srv/archive", "file:///srv/archive/tenants/acme"),
    ("s3://bucket", "s3://bucket/tenants/acme"),
    ("s3://bucket/outbox?region=eu-west-1&endpoint_override=minio:9000",
     "s3://bucket/outbox/tenants/acme?region=eu-west-1&endpoint_override=minio:9000"),
    ("/srv/odd?name", "/srv/odd?name/tenants/acme"),  # a local path keeps its '?'
])
def test_a_tenants_folder_is_tenants_slash_its_name_inside_the_default_stores(root, folder):
    assert tenant_folder(root, "acme") == folder


@pytest.mark.parametrize("name", ["..", "../globex", "a/b", ""])
def test_a_name_that_is_no_tenant_name_gets_no_folder(name):
    with pytest.raises(UnknownTenant):
        tenant_folder("/srv/archive", name)


def expire_inbox_row(outbox: Outbox, tenant: str | None, message_id: str) -> None:
    """One handled inbox row in ``tenant``'s store whose keep-until has passed."""
    with using_tenant(tenant):
        store = outbox.ready().store
        now = utcnow()
        with store.begin() as conn:
            store.insert_incoming(conn, dict(message_id=message_id, destination="", status="handled",
                                             received_at=now, handled_at=now, keep_until=now - timedelta(seconds=1)))


def test_each_tenants_cleanup_archives_into_its_folder_and_the_default_audit_lists_only_its_own(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from celery_outbox.audit.checks import check_archive
    from celery_outbox.audit.location import Location
    from celery_outbox.vocabulary import ArchiveKind

    archive = tmp_path / "archive"
    app = Celery(f"tenant_archives_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'default.db'}", outbox_archive_path=str(archive),
                    outbox_tenants={name: f"sqlite:///{tmp_path / name}.db" for name in ("acme", "globex")})
    outbox = Outbox(app)
    for tenant in (None, "acme", "globex"):
        expire_inbox_row(outbox, tenant, f"{tenant or 'default'}-1")
        with using_tenant(tenant):
            assert outbox.cleanup().archived == 1

    def ids(root) -> dict[str, list[str]]:
        files = check_archive(Location.of(str(root)))
        return {kind: sorted(m for path in paths for m in pq.read_table(path).column("message_id").to_pylist())
                for kind, paths in files.items() if paths}

    assert ids(archive) == {ArchiveKind.INCOMING: ["default-1"]}, "the default store's audit reads no tenant's file"
    for tenant in ("acme", "globex"):
        assert ids(tenant_folder(str(archive), tenant)) == {ArchiveKind.INCOMING: [f"{tenant}-1"]}
    assert sorted(p.name for p in archive.iterdir()) == ["incoming", "tenants"]


def test_an_archiver_given_receives_every_stores_rows(tmp_path):
    """``outbox.archiver = X`` replaces the archive of every store: X is told whose by ``current_tenant()``."""
    from celery_outbox import current_tenant

    app = Celery(f"tenant_archives_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'default.db'}",
                    outbox_tenants={"acme": f"sqlite:///{tmp_path / 'acme.db'}"})
    outbox = Outbox(app)
    received: list[tuple[str | None, str]] = []

    class Recorder:
        def archive(self, kind, rows):
            received.extend((current_tenant(), row.message_id) for row in rows)

    outbox.archiver = Recorder()
    for tenant in (None, "acme"):
        expire_inbox_row(outbox, tenant, f"{tenant or 'default'}-1")
        with using_tenant(tenant):
            outbox.cleanup()
    assert received == [(None, "default-1"), ("acme", "acme-1")]
