"""Memory-tiered offload engine, one import namespace: offload/ holds common/ at the bottom, model/ (the runtime)
and planner/ above the lower layers, core.py, and the face on top (api.py, cli.py, server/, batch jobs, demo.py);
the top-level folders kernels/, tiers/ and scheduler/ install as offload.kernels, offload.tiers and
offload.scheduler. The map is docs/ARCHITECTURE.md."""
