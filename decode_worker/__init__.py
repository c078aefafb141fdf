"""The decode role: its gRPC servicer (`servicer.py`) and Ray actor (`actor.py`).

May import: `pagedserve.common` (api, core, runtime), kvtransfer, the generated
stubs. Never `prefill_worker` or the router (import-linter contract "roles").
"""
