"""`triforce serve`: the OpenAI-compatible HTTP server."""
