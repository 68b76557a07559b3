"""Prometheus metrics of one broker process, served at ``--metrics-listen host:port`` (``/metrics``).

Off by default. When on, :class:`~broker.metrics.families.BrokerMetrics` holds one
``CollectorRegistry`` for the process and is *installed* (:func:`install`): the instrumented
modules reach it through :func:`active` and bind their labelled children once per topic
(:meth:`~broker.metrics.families.BrokerMetrics.topic`, cached), so the produce path does a
few counter increments per record batch and nothing per record. Values that exist anyway (the
WAL's size, a subscription's backlog, leadership) are read when Prometheus scrapes, by
:class:`~broker.metrics.collector.BrokerCollector`. While no broker has metrics on,
:func:`active` returns a no-op object and every instrumentation call does nothing.

Every series carries ``broker`` (the broker id). Per-topic series carry ``namespace`` and
``topic`` (``/ns/topic``), subscription series ``subscription`` too. With
``metrics_per_topic: false`` (``--no-metrics-per-topic``, as Pulsar's
``exposeTopicLevelMetrics=false``) the ``topic`` and ``subscription`` labels are gone and the
series are per namespace: 10,000 topics in one namespace are one series per metric.

Names follow Danube's (``danube-broker/src/broker_metrics.rs``) where it has them; the others
are ``danube_...`` names in the same style. Units are in the names.

======================================================== ========= =================================
metric                                                   type      labels (besides ``broker``): meaning
======================================================== ========= =================================
``danube_topic_messages_in_total``                       counter   ns, topic: messages appended
``danube_topic_bytes_in_total``                          counter   ns, topic: record-batch bytes
                                                                   appended
``danube_topic_message_size_bytes``                      histogram ns, topic: message sizes in
                                                                   record-batch bytes (framing
                                                                   included), each message of a
                                                                   batch at the batch's mean: the
                                                                   broker does not walk the records
``danube_topic_active_producers``                        gauge     ns, topic: open producers
                                                                   (scrape)
``danube_topic_active_consumers``                        gauge     ns, topic: attached consumers
                                                                   (scrape)
``danube_topic_active_subscriptions``                    gauge     ns, topic: loaded subscriptions
                                                                   (scrape)
``danube_topic_publish_throttled_seconds_total``         counter   ns, topic: time batches waited
                                                                   for ``max_publish_rate`` (scrape)
``danube_producer_send_total``                           counter   ns, topic, result (ok/error):
                                                                   record batches sent, counted at
                                                                   their answer
``danube_producer_send_latency_ms``                      histogram ns, topic: receipt at the topic
                                                                   (after a rate-limit wait) to
                                                                   durable ack, per batch
``danube_consumer_messages_out_total``                   counter   ns, topic, subscription: messages
                                                                   sent
``danube_consumer_bytes_out_total``                      counter   ns, topic, subscription: batch
                                                                   bytes sent
``danube_subscription_lag_messages``                     gauge     ns, topic, subscription: next
                                                                   offset minus the first
                                                                   unacknowledged (scrape)
``danube_subscription_unacked_messages``                 gauge     ns, topic, subscription: handed
                                                                   out and not acknowledged (scrape)
``danube_subscription_nack_total``                       counter   ns, topic, subscription: messages
                                                                   nacked
``danube_subscription_redelivery_total``                 counter   ns, topic, subscription: messages
                                                                   handed out again
``danube_subscription_ack_timeout_total``                counter   ns, topic, subscription: messages
                                                                   taken back after the ack timeout
``danube_subscription_dlq_total``                        counter   ns, topic, subscription: messages
                                                                   published to the dead-letter
                                                                   topic
``danube_subscription_dispatch_throttled_seconds_total`` counter   ns, topic, subscription: time
                                                                   dispatch waited for its rate
                                                                   (scrape)
``danube_wal_append_total``                              counter   record batches written to WALs
``danube_wal_append_bytes_total``                        counter   bytes written to WALs, each batch
                                                                   behind its 8-byte leader epoch
``danube_wal_flush_latency_ms``                          histogram one ``fdatasync`` of a group
                                                                   commit, or one ``syncfs`` of a
                                                                   commit round
``danube_wal_group_commit_messages``                     histogram messages made durable per
                                                                   ``fdatasync``
``danube_wal_file_rotate_total``                         counter   segments sealed
``danube_wal_delete_total``                              counter   sealed segments deleted (local
                                                                   retention)
``danube_wal_delete_bytes_total``                        counter   bytes those freed
``danube_wal_disk_bytes``                                gauge     bytes of the served topics' WALs
                                                                   (scrape)
``danube_wal_disk_free_bytes``                           gauge     free bytes of the WAL file system
                                                                   (scrape)
``danube_wal_disk_used_bytes``                           gauge     used bytes of that file system,
                                                                   all files
``danube_wal_storage_full``                              gauge     1 while the WAL disk refuses
                                                                   appends
``danube_quarantined_segments``                          gauge     ns, topic: quarantined segments
                                                                   (scrape)
``danube_broker_topics_owned``                           gauge     topics served here (scrape)
``danube_leader_election_state``                         gauge     1 on the cluster leader, else 0
                                                                   (scrape)
``danube_broker_state``                                  gauge     state (active/draining): 1 for
                                                                   the current
``danube_broker_rpc_total``                              counter   service, method, result (a gRPC
                                                                   code)
``danube_broker_rpc_duration_ms``                        histogram service, method: call start to
                                                                   its end
``danube_rebalancing_moves_total``                       counter   result (moved/failed/skipped),
                                                                   leader only
``danube_cluster_imbalance_cv``                          gauge     the last round's CV (leader only,
                                                                   scrape)
``danube_unavailable_ranges``                            gauge     ns, topic: unavailable ranges
                                                                   (scrape)
``danube_unavailable_offsets``                           gauge     ns, topic: offsets in them
                                                                   (scrape)
``danube_topic_under_replicated``                        gauge     ns, topic: 1 while the ISR is smaller
                                                                   than the replication factor (scrape)
``danube_topic_under_min_isr``                           gauge     ns, topic: 1 while the ISR is below
                                                                   min_insync_replicas (scrape)
``danube_topic_isr_shrinks_total``                       counter   ns, topic: followers removed from
                                                                   the ISR (scrape)
``danube_topic_isr_expands_total``                       counter   ns, topic: followers added to the
                                                                   ISR (scrape)
``danube_topic_follower_lag_messages``                   gauge     ns, topic: the most any follower is
                                                                   behind, in offsets (scrape)
``danube_schema_validation_total``                       counter   ns, topic: batches validated
``danube_schema_validation_failures_total``              counter   ns, topic: batches refused by the
                                                                   schema
``danube_tiered_cache_hits_total``                       counter   cold reads answered from the
                                                                   cache
``danube_tiered_cache_misses_total``                     counter   cold reads that found their
                                                                   object not fetched yet (and
                                                                   waited for the fetch)
``danube_tiered_fetched_bytes_total``                    counter   bytes read from object storage
                                                                   (segment headers included)
``danube_auth_authentication_total``                     counter   result (allow/deny)
``danube_auth_authorization_total``                      counter   result (allow/deny)
======================================================== ========= =================================

``danube_rebalancing_moves_total``, the cache counters and the rate-limit wait times are counts
the broker keeps anyway, read at scrape time (they count from the broker's start, or from the
topic's load for the per-topic ones). The event counters of a topic this broker no longer
serves stay exported (at their last value) until the broker restarts; the scrape-time gauges
cover the topics served now.

**Exposure.** The endpoint is plain HTTP without authentication and its labels name every
topic and subscription served. A non-loopback ``metrics_listen`` follows the rule of the gRPC
listen address: refused at start-up unless ``--insecure`` is given (then a warning is logged),
even when the gRPC port has TLS and authentication (the metrics endpoint has neither).
"""

from broker.metrics.families import BrokerMetrics, NoMetrics, active, install, uninstall

__all__ = ["BrokerMetrics", "NoMetrics", "active", "install", "uninstall"]
