"""The bottom layer: limits and defaults (config, presets.yaml), the errors a user sees, cache
paths, what this machine's CPU offers. Imports nothing else of miniserve."""
