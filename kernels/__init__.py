"""Triton kernels for paged KV, each beside a pure-torch reference (see kernels/ops.py)."""
