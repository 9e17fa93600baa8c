"""Capture: how training state reaches a checkpoint node — pushed by trainers (``push/``: wire format, signed
pushes, the node's receiver) or rebuilt from mirrored allreduce traffic (``mirror/``)."""
