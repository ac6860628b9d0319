"""Spill files: streamed layers converted once to the compute dtype, written with checksums, read back."""
