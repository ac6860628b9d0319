"""The cost model: a policy's predicted time on a machine, the search over policies, latency under load."""
