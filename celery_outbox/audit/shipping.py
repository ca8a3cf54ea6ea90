"""The audit's code for a cluster's executors: a zip of the installed celery_outbox package.

No transaction. When the audit starts Spark itself on a master that is not local,
``ship_package`` zips the package the driver imports and adds it to the session
(``SparkContext.addPyFile``): each executor runs the driver's code whatever its own environment
holds. Under spark-submit, ``python -m celery_outbox.audit.shipping FOLDER`` builds the zip for
``--py-files`` and prints its path (docs/audit.md, On a cluster).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import zipfile

__all__ = ["ZIP_NAME", "is_local", "package_zip", "ship_package"]

ZIP_NAME = "celery_outbox.zip"


def is_local(master: str) -> bool:
    """Whether ``master`` runs the job inside the driver (``local``, ``local[N]``, ``local[*]``)."""
    return master == "local" or master.startswith("local[")


def package_zip(folder: str) -> str:
    """Zip the installed celery_outbox package (its files, no bytecode caches) into ``folder`` and
    return the zip's path; inside, the package is at the top, as an import from the zip needs."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # celery_outbox/, above audit/
    path = os.path.join(folder, ZIP_NAME)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for root, dirs, files in os.walk(package):
            dirs[:] = sorted(name for name in dirs if name != "__pycache__")
            for name in sorted(files):
                if not name.endswith((".pyc", ".pyo")):
                    file_path = os.path.join(root, name)
                    archive.write(file_path, os.path.relpath(file_path, os.path.dirname(package)))
    return path


def ship_package(spark) -> str:
    """Add the package's zip, built once for this session in a temporary folder removed when this
    process exits, to ``spark``'s executors; returns the zip's path."""
    folder = tempfile.mkdtemp(prefix="celery-outbox-audit-")
    atexit.register(shutil.rmtree, folder, True)
    path = package_zip(folder)
    spark.sparkContext.addPyFile(path)
    return path


if __name__ == "__main__":  # python -m celery_outbox.audit.shipping FOLDER: the zip for spark-submit --py-files
    print(package_zip(sys.argv[1] if len(sys.argv) > 1 else "."))
