"""The broker's write-ahead log, split the way Kafka splits its log: :mod:`.segment` (one
file and its offset index), :mod:`.recovery` (bringing a directory back at open),
:mod:`.local_log` (the segments: roll, read, delete), :mod:`.pending` (batches waiting for a
group commit), :mod:`.group_commit` (the writer: one ``pwritev`` and one ``fdatasync`` per
commit), :mod:`.log` (the facade: append, seal, read), and for replication :mod:`.epochs`
(the leader-epoch cache) and :mod:`.replica_log` (the facade's replication side: epochs,
replica appends, high watermark, truncation)."""

from broker.storage.wal.log import WriteAheadLog
from broker.storage.wal.segment import SealedSegment, active_name, sealed_name

__all__ = ["SealedSegment", "WriteAheadLog", "active_name", "sealed_name"]
