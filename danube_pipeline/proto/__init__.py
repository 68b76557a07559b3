"""Generated gRPC wire types for the broker API (``danube.proto``, package ``danube.v1``).

Regenerate with ``make proto``. User-facing types live elsewhere (``danube_pipeline.client``,
``danube_pipeline.format.records``); these generated classes never leave the wire layer.
"""
