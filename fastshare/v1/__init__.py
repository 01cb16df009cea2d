"""Generated protobuf/gRPC modules (from proto/fastshare/v1, built at install time)."""
