"""Operating an agent: gRPC health, telemetry, Prometheus metrics and the web dashboard."""
