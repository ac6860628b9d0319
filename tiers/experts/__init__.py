"""Mixture-of-experts weights cached per (layer, expert): on the device, and in device slots on CUDA."""
