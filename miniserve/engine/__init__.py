"""Turning ids into tokens: sampling stages, grammar masks, the hand-written loop (decode), the
continuous-batching scheduler, detokenizing streams, chat templates, the engine that owns a
runner and its thread, and one chat turn. Imports runners, store and core."""
