"""Capture: how training state reaches a checkpoint node — pushed by trainers (``wire``, ``push``, ``auth``) or rebuilt from mirrored allreduce traffic (``mirror/``)."""
