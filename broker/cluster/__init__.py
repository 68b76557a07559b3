"""The broker in its cluster: registration and leader candidacy (`membership`), what only the
leader does (`leader`, `rebalance`), owner epochs and offset blocks (`ownership`), partitioned
topics (`partitions`), and the load manager as pure code (`load_manager/`). Keys in
`docs/etcd-layout.md` §1."""
