"""A simulated vLLM 0.32 OpenAI server in any disaggregation role (encode, prefill, decode,
prefill_decode), for trying and testing the proxy without a GPU. Stands apart from the rest of
epd_flask: it imports only the standard library and gevent.
"""

from .config import SimConfig
from .server import SimServer
from .state import SimState

__all__ = ["SimConfig", "SimServer", "SimState"]
