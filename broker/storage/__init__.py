"""Where a topic's messages live on the broker: the write-ahead log (`wal/`), the memory log of
NonReliable topics, offsets below the WAL read back from segment objects (`remote`), local
retention, and the disk's storage-full state (`disk`)."""
