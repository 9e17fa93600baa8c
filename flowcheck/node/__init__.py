"""The checkpoint node: push receiver, memory tier, policy and control API in one process."""
