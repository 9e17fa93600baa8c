"""Push capture: trainers send their state to the node (``wire``: the frame format, ``auth``: signed pushes,
``receiver``: the node side that applies each complete step to the memory tier)."""
