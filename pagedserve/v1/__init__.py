"""Generated gRPC/protobuf stubs of proto/pagedserve/v1 (built by scripts/gen_proto.py, git-ignored)."""
