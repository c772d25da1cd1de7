"""dspark-vllm: the vLLM adapter (not implemented yet)."""

__version__ = "0.1.0"
