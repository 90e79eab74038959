"""The contract between kvhandoff's processes: typed, versioned handoff messages (messages.py); the
modes, roles and policies every process names the same way (modes.py); the reuse cost model both
sides price with (cost.py); the OpenAI API's shapes (api.py); the control token (auth.py); how
every process speaks HTTP (http.py); and what workers publish of what they hold, in vLLM's KV-event
format (kv_events.py). Nothing here imports the engine, the transfer layer or torch."""
