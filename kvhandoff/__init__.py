"""kvhandoff: disaggregated LLM serving with KV-cache handoff between prefill and decode workers."""
__version__ = "0.1.0"
