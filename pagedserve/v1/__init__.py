"""Generated gRPC/protobuf stubs of proto/pagedserve/v1 (scripts/gen_proto.py; never edit).

Build outputs, not committed: `make proto` writes them into the source tree (an
editable install), and a wheel build generates them into the wheel (setup.py).
"""
