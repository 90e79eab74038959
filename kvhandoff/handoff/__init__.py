"""KV handoff between prefill and decode workers: layouts, leases, connectors (see docs/HANDOFF.md)."""
