"""Danube's etcd metadata: key paths (:mod:`.keys`), JSON values (:mod:`.values`), the
:class:`~danube_pipeline.metadata.store.MetadataStore` for writes and the per-process
:class:`~danube_pipeline.metadata.store.LocalCache` for reads (seed ``000``, "MetadataStore and
LocalCache Pattern")."""
