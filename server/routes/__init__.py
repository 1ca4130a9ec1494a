"""One module per OpenAI endpoint (plus health and metrics)."""
