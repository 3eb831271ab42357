"""Saved conversations (SQLite) and their import/export formats. Imports only core."""
