"""Spark's Hadoop FileSystem, reached through the driver's JVM, for what is not a DataFrame.

No transaction. It reaches any filesystem Spark can write (``file:``, ``hdfs://``, ``s3a://``,
``gs://``, ``abfs://``...) with the session's own configuration and credentials, for the archive's
folders, the summary and the report.
"""

from __future__ import annotations

__all__ = ["children", "delete", "exists", "parquet_files", "read_text", "write_text"]


def _filesystem(spark, uri: str):
    """(Hadoop FileSystem, Hadoop Path) of ``uri`` in the session's Hadoop configuration."""
    path = spark.sparkContext._jvm.org.apache.hadoop.fs.Path(uri)
    return path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), path


def exists(spark, uri: str) -> bool:
    """Whether a file or folder is at ``uri``."""
    filesystem, path = _filesystem(spark, uri)
    return bool(filesystem.exists(path))


def write_text(spark, uri: str, text: str) -> None:
    """Write ``text`` (UTF-8) as the whole file at ``uri``, replacing any; missing folders are made."""
    filesystem, path = _filesystem(spark, uri)
    stream = filesystem.create(path, True)
    try:
        stream.write(bytearray(text.encode()))
    finally:
        stream.close()


def read_text(spark, uri: str) -> str | None:
    """The whole file at ``uri`` as UTF-8 text; None when there is none."""
    filesystem, path = _filesystem(spark, uri)
    if not filesystem.exists(path):
        return None
    jvm = spark.sparkContext._jvm
    stream = filesystem.open(path)
    try:
        return str(jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
    finally:
        stream.close()


def parquet_files(spark, uri: str) -> list[str]:
    """The URIs of the ``.parquet`` files under the folder ``uri``, at any depth (none when it is
    missing)."""
    filesystem, path = _filesystem(spark, uri)
    if not filesystem.exists(path):
        return []
    found, files = [], filesystem.listFiles(path, True)
    while files.hasNext():
        name = files.next().getPath().toString()
        if name.endswith(".parquet"):
            found.append(name)
    return sorted(found)


def children(spark, uri: str) -> list[str]:
    """The names of the files and folders in the folder ``uri`` (none when it is missing)."""
    filesystem, path = _filesystem(spark, uri)
    if not filesystem.exists(path):
        return []
    return sorted(str(status.getPath().getName()) for status in filesystem.listStatus(path))


def delete(spark, uri: str) -> None:
    """Delete the file or folder at ``uri`` with all it holds; nothing there is no error."""
    filesystem, path = _filesystem(spark, uri)
    filesystem.delete(path, True)
