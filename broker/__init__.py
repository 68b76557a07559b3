"""The broker process (`danube-broker`, the `[broker]` extra).

* `core`, `sessions`, `cluster_view`, `reconcile`: the `Broker` and its parts;
* `rpc/`: the gRPC server, one servicer module per service, the status mapping;
* `cluster/`: membership, leadership, ownership and epochs, partitions, the load manager and
  rebalancing;
* `topics/`: one topic, its lifecycle and release, producers and their sequences, policies;
* `dispatch/`: subscriptions, consumers, Key_Shared, redelivery and dead letters;
* `storage/`: the WAL (`wal/`), the memory log, tiered reads, local retention, the disk state.

The broker never imports `assets/` (`tests/test_layers.py`).
"""
