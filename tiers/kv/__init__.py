"""The paged KV cache: block bookkeeping and prefix keys, the device tensors, and the host and disk tiers below."""
