"""The gRPC layer: the server (`server`), one servicer module per service of
`danube_pipeline/proto/danube.proto`, and the one place exceptions become statuses (`status`)."""
