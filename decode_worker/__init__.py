"""Decode worker: reserves KV blocks, receives pages, runs continuous batching."""
