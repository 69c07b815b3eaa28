"""Model definitions: our own forward passes over the paged KV cache."""
