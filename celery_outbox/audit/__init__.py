"""The delivery audit: the Parquet archive cleanup writes, and the Spark job that reads it.

``archive`` needs pyarrow and ``job`` needs PySpark and Java: ``pip install
'celery-outbox[spark]'``. Nothing here is imported unless an archive path is set or
the audit is run.
"""
