"""epd-flask: an OpenAI-compatible proxy for disaggregated vLLM serving."""

__version__ = "0.1.0"
