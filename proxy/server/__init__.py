"""What the agent serves over HTTP: /healthz and /livez (health.py), /metrics
(metrics.py), /debug/dump (dump.py), both servers (http.py), and the health-check node
ports of externalTrafficPolicy Local services (nodeports.py)."""
