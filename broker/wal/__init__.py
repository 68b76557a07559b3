"""The broker's write-ahead log, split the way Kafka splits its log: :mod:`.segment` (one
file and its offset index), :mod:`.recovery` (bringing a directory back at open),
:mod:`.pending` (appends waiting for a group commit) and :mod:`.log` (append, seal, read)."""

from broker.wal.log import WriteAheadLog
from broker.wal.pending import PendingMessage
from broker.wal.segment import SealedSegment, active_name, sealed_name

__all__ = ["PendingMessage", "SealedSegment", "WriteAheadLog", "active_name", "sealed_name"]
