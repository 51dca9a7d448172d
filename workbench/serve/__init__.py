"""`hcw serve`: the OpenAI HTTP API over one engine (app.py), the requests' bodies and reports
(protocol.py), text crossing from the engine's thread (stream.py), Prometheus metrics
(metrics.py), what is served (served.py), and the start-up (run.py)."""
