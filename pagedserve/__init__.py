"""pagedserve: a disaggregated LLM serving cluster built on PagedAttention.

The `pagedserve` namespace puts the design card's top-level folders under one name
(`pagedserve.common` is `common/`, `pagedserve.router` is `router/`, ..., see
pyproject.toml; in the source tree `pagedserve/common` etc. are symlinks to them). This folder itself owns what sits above every role: the
`pagedserve` command (`cli.py`), the launcher (`launch.py`: Ray, the router, the
workers) and `worker.py` (a worker process: runtime + both roles' servicers, the
Ray actor classes). The generated gRPC stubs are `v1/`.

May import anything below it; nothing below imports it.
"""

__version__ = "0.1.0"
