"""Offline batch jobs: `offload batch`, every result exactly once, resumable, optionally sharded over Ray."""
