"""Topic replication (``docs/etcd-layout.md`` §1.9, §5.9; Kafka's ISR replication, KIP-101 and
KIP-279): the owner's followers, in-sync replica set and high watermark (``owner.py``), the
follower's fetcher (``follower.py``), this broker's fetchers and the hand-over to an owner
(``manager.py``), what the owner answers its followers (``serving.py``), and replication at a
takeover (``takeover.py``)."""
