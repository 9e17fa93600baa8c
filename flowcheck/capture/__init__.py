"""Capture: how training state reaches a checkpoint node (push from trainers; mirror capture comes later)."""
