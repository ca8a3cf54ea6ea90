"""Spark's Hadoop FileSystem, reached through the driver's JVM: the audit's way into any filesystem
Spark can write (``file:``, ``hdfs://``, ``s3a://``, ``gs://``, ``abfs://``...), with the session's
own configuration and credentials, for what is not a DataFrame: the archive's folders, the summary
and the report.
"""

from __future__ import annotations

__all__ = ["exists", "write_text"]


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
