"""The Parquet archive cleanup hands its rows to (``celery_outbox.audit.archive``): an archive
without a working pyarrow says which fault it has; a kind it does not keep is refused."""

from __future__ import annotations

from datetime import datetime
from types import SimpleNamespace

import pytest


@pytest.mark.parametrize("error, said", [
    (ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow"), "which is not installed"),
    (ImportError("numpy.core.multiarray failed to import"),
     "which is installed but cannot be imported: numpy.core.multiarray failed to import"),
])
def test_an_archive_without_a_working_pyarrow_says_which(monkeypatch, tmp_path, error, said):
    import builtins

    from celery_outbox.audit.archive import ParquetArchiver
    from celery_outbox.errors import ConfigurationError

    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    with pytest.raises(ConfigurationError, match=f"outbox_archive_path needs pyarrow, {said}"):
        ParquetArchiver(str(tmp_path / "archive"))


def test_the_archive_refuses_a_kind_it_does_not_keep_naming_the_kinds(tmp_path):
    """A kind outside ``ArchiveKind`` is an error that names the kinds; nothing is written."""
    from celery_outbox.audit.archive import ParquetArchiver

    archiver = ParquetArchiver(str(tmp_path / "archive"))
    with pytest.raises(ValueError, match="^unknown archive kind 'outgoing'; expected one of 'incoming', "
                                         "'dead_letters', 'sent'$"):
        archiver.archive("outgoing", [SimpleNamespace(message_id="m1")])
    assert not (tmp_path / "archive").exists()
    archiver.archive("sent", [SimpleNamespace(message_id="m1", destination="", task_name="t", created_at=None,
                                              sent_at=datetime(2026, 11, 22, 12, 0))])
    assert [p.name for p in (tmp_path / "archive").iterdir()] == ["sent"], "a kind given as its string is kept"
