"""Memory-tiered offload engine: the Python API and the model runtime."""
