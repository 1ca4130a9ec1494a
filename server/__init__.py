"""markbase HTTP layer: OpenAI-compatible API over the engine."""
