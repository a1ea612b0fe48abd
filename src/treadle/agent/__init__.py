"""The agent loop: token-in-token-out multi-turn trajectories (`chat`: the format)."""
