"""Gateway: validation, routing, streaming, worker registry."""
