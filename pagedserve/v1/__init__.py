"""Generated gRPC/protobuf stubs of proto/pagedserve/v1 (scripts/gen_proto.py; never edit).

Committed, so that a wheel or a checkout imports them without grpcio-tools;
tests/test_proto.py fails when they differ from a fresh generation (`make proto`).
"""
