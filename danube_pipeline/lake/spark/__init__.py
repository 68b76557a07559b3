"""Spark on the shared Iceberg catalog.

Spark's Iceberg ``JdbcCatalog`` reads and commits to the same SQL catalog database as
pyiceberg's ``SqlCatalog``; ``docs/architecture.md`` explains the SQLite settings both
sides need. The modules, by job:

* :mod:`~danube_pipeline.lake.spark.session`: the jars, the master, the JDBC catalog
  configuration and the session built from them (:func:`~danube_pipeline.lake.spark.session.build_spark_session`).
* :mod:`~danube_pipeline.lake.spark.procedures`: the topic table's name in Spark and the
  maintenance run on it: compaction (``rewrite_data_files``), row deletes, snapshot expiry and
  orphan-file removal (the Spark side of :mod:`danube_pipeline.lake.retention`).
* :mod:`~danube_pipeline.lake.spark.checksums`: order-free row checksums, which
  :mod:`danube_pipeline.lake.rewrite` verifies its rewrites with.
"""
