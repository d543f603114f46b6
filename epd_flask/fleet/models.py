"""Which models the fleet serves: an instance's ``/v1/models`` answer read, the union the proxy
answers ``GET /v1/models`` with, and the model a request is routed by
(docs/behaviour.md#models).

Each instance serves the names its roster record lists (``models``), or else the ones its
``/v1/models`` last named (the prober reads it); vLLM lists a LoRA adapter as a card whose
``parent`` is its base model. Only decode-side instances (decode, prefill_decode) define what
the fleet can serve: a prefill alone answers nobody.
"""

from __future__ import annotations

import json
import time
from typing import Any

from epd_flask.control.roster import MAX_MODEL_NAME
from epd_flask.control.roster import MAX_MODELS as MAX_CARDS
from epd_flask.core.errors import ClientError, NoBackend, NotFound
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.registry import Registry

Card = dict[str, Any]


class ModelListError(ValueError):
    """A ``/v1/models`` answer we cannot read a model list from."""


class ModelNotFound(NotFound):
    """vLLM's refusal of a model it does not serve, in OpenAI's shape and code."""

    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


def parse_models(doc: Any) -> dict[str, Card]:
    """The cards of a ``/v1/models`` answer by id, as the instance wrote them."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ModelListError("the answer has no 'data' list")
    if len(data) > MAX_CARDS:
        raise ModelListError(f"the answer lists {len(data)} models, more than {MAX_CARDS}")
    cards: dict[str, Card] = {}
    for card in data:
        model_id = card.get("id") if isinstance(card, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise ModelListError("a model card has no string 'id'")
        # Refused whole, as any unreadable answer: a name skipped would make the proxy answer
        # 404 for a model the instance serves. Every worker keeps, logs and labels the names.
        if len(model_id) > MAX_MODEL_NAME:
            raise ModelListError(f"a model id is {len(model_id)} characters long, more than "
                                 f"{MAX_MODEL_NAME}")
        cards.setdefault(model_id, card)
    return cards


def bare_card(model: str) -> Card:
    """A card for a model known only from the roster, shaped as vLLM's ``ModelCard``."""
    return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": None, "permission": []}


class Catalog:
    """The fleet's models as this worker knows them, from the live fleet (whose decode role
    answers clients: it changes when a reload turns a split roster into a combined one)."""

    def __init__(self, live: LiveFleet) -> None:
        self.live = live
        #: The last listing, its JSON and what it was built from (the registry's version and
        #: the decode role): rebuilt only when either changed.
        self._listed: tuple[int, str] | None = None
        self._listing: dict[str, Any] | None = None
        self._listing_json: bytes | None = None

    @property
    def registry(self) -> Registry:
        return self.live.registry

    def decode_role(self) -> str:
        return self.live.view.decode_role

    def listing(self) -> dict[str, Any] | None:
        """``/v1/models``: each model served by a live decode-side instance once, adapters with
        their parent; None while no such instance's models are known yet.

        Cached until the registry changes (every change of an instance's liveness, models or
        membership bumps its version): the union of thousands of cards costs milliseconds per
        call, and a client polling ``/v1/models`` would pay them on every worker. The value
        is shared: callers must not change it."""
        listed = (self.registry.version, self.decode_role())
        if listed != self._listed:
            self._listing = self._union()
            self._listing_json = None
            self._listed = listed
        return self._listing

    def listing_json(self) -> bytes | None:
        """``listing`` encoded once per change."""
        listing = self.listing()
        if listing is not None and self._listing_json is None:
            self._listing_json = json.dumps(listing).encode()
        return self._listing_json

    def _union(self) -> dict[str, Any] | None:
        known = False
        out: dict[str, Card] = {}
        role = self.decode_role()
        for state in self.registry.states():
            if state.instance.role != role or not state.live:
                continue
            if state.served() is None:
                continue
            known = True
            cards = state.cards or {}
            for name in state.instance.models or cards:
                out.setdefault(name, cards.get(name) or bare_card(name))
        if not known:
            return None
        return {"object": "list", "data": list(out.values())}

    def resolve(self, requested: Any) -> str | None:
        """The model a completion is routed by, or the client error the proxy answers itself.

        None when there is nothing to filter by: no model named and no decode-side instance's
        models known yet (each is then a candidate, as before models were known).
        """
        if isinstance(requested, str) and requested:
            return self._check(requested)
        bases = self._live_bases()
        if bases is None:
            return None
        if len(bases) == 1:
            return next(iter(bases))
        names = ", ".join(f"`{m}`" for m in sorted(bases)) or "none reported"
        raise ClientError(f"'model' is required: this proxy serves several models ({names})",
                          param="model", code="model_required")

    def _check(self, model: str) -> str:
        role = self.decode_role()
        listed = evicted = False
        for state in self.registry.states():
            if state.instance.role != role:
                continue
            listed = True
            if not state.serves(model):
                continue
            if state.live:
                return model
            evicted = True
        if not listed:
            return model  # no decode side at all: routing answers 503 for the stage
        if evicted:
            settings = self.live.settings
            raise NoBackend(settings.no_backend_message
                            or f"model `{model}` is served only by evicted {role} instances",
                            stage=role, status=settings.no_backend_status)
        raise ModelNotFound(model)

    def _live_bases(self) -> set[str] | None:
        """The base models (adapters aside) live decode-side instances serve; None when none
        of them knows its models. vLLM serves its base model when ``model`` is absent, so an
        adapter never makes a one-model fleet ambiguous."""
        bases: set[str] | None = None
        role = self.decode_role()
        for state in self.registry.states():
            if state.instance.role != role or not state.live:
                continue
            names = state.served()
            if names is None:
                continue
            bases = bases or set()
            bases.update(n for n in names if state.parent(n) is None)
        return bases
