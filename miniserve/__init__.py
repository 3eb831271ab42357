"""MiniServeLM: a small, readable local LLM inference engine with a browser chat."""

__version__ = "0.1.0"
