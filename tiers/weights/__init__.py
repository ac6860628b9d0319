"""Weights: checkpoints read by extent, placed per layer, and streamed through rings to the device."""
