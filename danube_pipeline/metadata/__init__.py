"""Danube's etcd metadata (``docs/etcd-layout.md``): key paths (:mod:`.keys`), JSON values
(:mod:`.values`), the :class:`~danube_pipeline.metadata.store.MetadataStore` that takes every
write, the per-process :class:`~danube_pipeline.metadata.cache.LocalCache` that serves reads,
and the :class:`~danube_pipeline.metadata.lease.Lease` that registrations live under."""
