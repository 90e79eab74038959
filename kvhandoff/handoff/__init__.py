"""KV handoff between prefill and decode workers (docs/HANDOFF.md): one file per protocol (pull, push,
layerwise, reuse), the wire contract (messages), the modes, and what they share (runtime)."""
