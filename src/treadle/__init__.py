"""treadle: a rollout service for agentic reinforcement learning of LLMs."""

__version__ = "0.1.0"
