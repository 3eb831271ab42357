"""Several models by name (registry) and models served elsewhere (remote): both give the same
engine surface. Imports engine and below."""
