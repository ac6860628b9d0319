"""`offload convert`: checkpoints rewritten into the formats the engine runs (weight quantization, MXFP4)."""
