"""OpenAI-compatible serving: the HTTP layer and the backends that answer it."""
