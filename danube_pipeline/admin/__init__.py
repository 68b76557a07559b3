"""`danube-admin`, the operator's command line (base install): the root group in `cli`, one module
per command group (`brokers`, `namespaces`, `topics`, `subscriptions`)."""
