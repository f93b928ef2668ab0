"""`t5forge serve`: the HTTP server (server.py: loading and lifecycle, app.py: the endpoints, engine.py:
dynamic batching on one worker thread)."""
