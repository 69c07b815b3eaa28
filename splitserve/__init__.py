"""splitserve command-line entry point."""
