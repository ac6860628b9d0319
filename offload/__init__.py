"""Memory-tiered offload engine. offload/ holds the layers around tiers/, scheduler/ and kernels/: common/ at the
bottom, model/ (the runtime) and planner/ above them, and the face on top: api.py, cli.py, demo.py.
The map is docs/ARCHITECTURE.md."""
