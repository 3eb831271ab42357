"""The OpenAI-compatible HTTP API. Imports models and below."""
