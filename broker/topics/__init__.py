"""Topics served by this broker: one topic (`topic`), its lifecycle, release and upkeep, producers
and their sequence numbers, rate limits, schema policies and the admin verbs on topics."""
