"""Prefill worker: computes prompts in batches and ships their KV pages."""
