"""Adapters for environments users already have: NeMo Gym resources servers and
gymnasium-style text environments."""
