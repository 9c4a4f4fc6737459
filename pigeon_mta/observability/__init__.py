"""How a node is watched: the /metrics, /healthz and /readyz endpoint and what feeds it."""
