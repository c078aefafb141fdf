"""pagedserve: a disaggregated LLM serving cluster built on PagedAttention."""

__version__ = "0.1.0"
