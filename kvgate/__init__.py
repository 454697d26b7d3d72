"""kvgate: a KV/prefix-aware OpenAI-compatible gateway for vLLM and SGLang fleets."""

__version__ = "0.1.0"
