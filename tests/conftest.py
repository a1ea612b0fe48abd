"""Fixtures shared across the test folders."""

from vllm_server import vllm_server

__all__ = ["vllm_server"]
