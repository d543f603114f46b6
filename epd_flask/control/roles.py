"""The stages an instance serves in, named once (docs/behaviour.md#roster).

The roster's schema, the ``routing:`` setting, the model catalog and the status page all read
these. Imports nothing: the gunicorn master loads it.
"""

from __future__ import annotations

ENCODE, PREFILL, DECODE, PREFILL_DECODE = "encode", "prefill", "decode", "prefill_decode"
#: Every role, in the order a request meets them (also the order summaries list them in).
ROLES: tuple[str, ...] = (ENCODE, PREFILL, DECODE, PREFILL_DECODE)
#: A split fleet's two stages; one fleet never mixes them with ``PREFILL_DECODE``.
SPLIT: tuple[str, ...] = (PREFILL, DECODE)
