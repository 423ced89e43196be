"""Generated Protobuf and gRPC stubs for package tandem.v1 (built from protos/ at install)."""
