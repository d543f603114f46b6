"""Which instances serve which model (docs/behaviour.md#models): the roster's ``models``, the
``/v1/models`` answer read, the per-model filter every stage is picked through, the union and
the model a request is routed by. No network."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from epd_flask.control import reload, settings
from epd_flask.control.roster import (
    MAX_MODEL_NAME,
    MAX_MODELS,
    Instance,
    Roster,
    RosterError,
    Settings,
    parse,
    parse_instance,
)
from epd_flask.control.statedir import STATE_DIR_ENV, StateDir
from epd_flask.core.errors import ClientError, NoBackend
from epd_flask.fleet.bootstrap import BootstrapDiscovery, Engines
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.models import Catalog, ModelListError, ModelNotFound, parse_models
from epd_flask.fleet.policies import RouteRequest
from epd_flask.fleet.registry import Registry
from epd_flask.fleet.routing import Router

P1 = Instance(role="prefill", url="http://p1:8100", bootstrap_url="http://p1:8998")
P2 = Instance(role="prefill", url="http://p2:8100", bootstrap_url="http://p2:8998")
D1 = Instance(role="decode", url="http://d1:8200")
D2 = Instance(role="decode", url="http://d2:8200")


def card(model: str, parent: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 1, "owned_by": "vllm",
            "root": f"/m/{model}", "parent": parent, "max_model_len": 64 if not parent else None,
            "permission": [], **extra}


def answer(*cards: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return parse_models({"object": "list", "data": list(cards)})


def fleet(**lists: dict[str, dict[str, Any]]) -> Registry:
    """Two prefills and two decodes; ``d1=answer(...)`` records what that one listed."""
    registry = Registry([P1, P2, D1, D2])
    for name, cards in lists.items():
        registry.record_models({"p1": P1, "p2": P2, "d1": D1, "d2": D2}[name].url, cards)
    return registry


def live_over(registry: Registry, connector: str = "nixl") -> LiveFleet:
    """The live fleet of those four, keeping ``registry``'s health and models."""
    return LiveFleet(Roster(settings=Settings(connector=connector),
                            instances=tuple(registry.instances())), registry=registry)


def pick(router: Router, role: str, model: str | None = None) -> str:
    return router.pick(role, RouteRequest(model=model), lambda role, d: None).url


# -- the roster ---------------------------------------------------------------------------


def test_roster_models_are_names_listed_once() -> None:
    doc = {"instances": [{"role": "decode", "url": "http://d:1", "models": [" a ", "b"]}]}
    assert parse(doc).instances[0].models == ("a", "b")
    for bad in ([], ["a", "a"], [""], "a-string-is-not-a-list", [1]):
        with pytest.raises(RosterError, match="models"):
            parse({"instances": [{"role": "decode", "url": "http://d:1", "models": bad}]})


def test_roster_models_are_capped_in_count_and_length() -> None:
    def decode(models: list[str]) -> dict[str, Any]:
        return {"instances": [{"role": "decode", "url": "http://d:1", "models": models}]}

    names = [f"model-{i}" for i in range(MAX_MODELS)]
    assert len(parse(decode(names)).instances[0].models) == MAX_MODELS
    with pytest.raises(RosterError, match=f"lists {MAX_MODELS + 1} model names, more than "
                                          f"{MAX_MODELS} "):
        parse(decode([*names, "one-more"]))
    with pytest.raises(RosterError, match="lists 'model-7' more than once"):
        parse(decode([*names[:-2], "model-9", "model-7"]))
    assert parse(decode(["x" * MAX_MODEL_NAME])).instances[0].models == ("x" * MAX_MODEL_NAME,)
    with pytest.raises(RosterError, match=f"a model name of {MAX_MODEL_NAME + 1} characters"):
        parse(decode(["llama", "x" * (MAX_MODEL_NAME + 1)]))
    with pytest.raises(RosterError, match=f"{MAX_MODEL_NAME + 1} characters"):
        parse_instance({"role": "decode", "url": "http://d:1",
                        "models": ["x" * (MAX_MODEL_NAME + 1)]})


HUGE_MODEL_LISTS = """
import sys
from epd_flask.control.roster import RosterError, load, parse

names = [f"m{i}" for i in range(200_000)]
for check in (lambda: load(sys.argv[1]),  # 40,000 names, under EPD_ROSTER_MAX_BYTES
              lambda: parse({"instances": [{"role": "decode", "url": "http://d:1",
                                            "models": names}]})):
    try:
        check()
    except RosterError as exc:
        print(exc)
"""


def test_huge_model_lists_are_refused_by_their_length(tmp_path: Path) -> None:
    """Checked name by name against each other these take minutes (40,000 names: 15 s, the
    master's reload and every worker's boot meanwhile; 200,000: hours); refused by their
    count, they take milliseconds. Run in a bounded interpreter, so a quadratic check fails
    by its timeout instead of holding the suite."""
    path = tmp_path / "roster.yaml"
    path.write_text("instances:\n  - role: decode\n    url: http://d:1\n    models: ["
                    + ",".join(f"m{i:x}" for i in range(40_000)) + "]\n")
    assert 200_000 < path.stat().st_size < settings.default("EPD_ROSTER_MAX_BYTES")
    done = subprocess.run([sys.executable, "-c", HUGE_MODEL_LISTS, str(path)],
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{path}: instances[0] (http://d:1) field 'models': Value error, lists 40000 model "
        f"names, more than {MAX_MODELS} (the most one instance may serve)",
        f"<roster>: instances[0] (http://d:1) field 'models': Value error, lists 200000 model "
        f"names, more than {MAX_MODELS} (the most one instance may serve)"]


def test_a_prefill_model_no_decode_serves_is_a_roster_error_naming_both() -> None:
    doc = {"instances": [
        {"role": "prefill", "url": "http://p:1", "models": ["llama", "qwen"]},
        {"role": "decode", "url": "http://d:1", "models": ["llama"]},
    ]}
    with pytest.raises(RosterError) as info:
        parse(doc, "roster.yaml")
    message = str(info.value)
    assert "roster.yaml" in message and "http://p:1" in message and "'qwen'" in message
    doc["instances"][1]["models"] = ["llama", "qwen"]
    assert parse(doc).instances[0].models == ("llama", "qwen")
    # A decode whose models are discovered may serve it: nothing to judge at load time.
    doc["instances"].append({"role": "decode", "url": "http://d:2"})
    doc["instances"][1]["models"] = ["llama"]
    parse(doc)


# -- /v1/models answers --------------------------------------------------------------------


def test_parse_keeps_cards_as_the_instance_wrote_them() -> None:
    cards = answer(card("base"), card("lora", parent="base", extra_field=1))
    assert list(cards) == ["base", "lora"]
    assert cards["lora"]["parent"] == "base" and cards["lora"]["extra_field"] == 1


@pytest.mark.parametrize("doc", [None, [], {"data": {}}, {"data": [{"object": "model"}]},
                                 {"data": [{"id": ""}]}, {"data": ["x"]},
                                 {"data": [{"id": str(i)} for i in range(1025)]}])
def test_unusable_model_lists_are_refused(doc) -> None:
    with pytest.raises(ModelListError):
        parse_models(doc)


def test_an_unreadable_answer_keeps_the_last_known_list() -> None:
    registry = fleet(d1=answer(card("alpha")))
    registry.record_models(D1.url, None, "/v1/models answered 500")
    state = registry.get(D1.url)
    assert state.served() == {"alpha"} and state.models_error == "/v1/models answered 500"
    registry.record_models(D1.url, answer(card("alpha"), card("lora", "alpha")))
    assert state.served() == {"alpha", "lora"} and state.models_error is None


def test_roster_models_win_over_the_answer() -> None:
    registry = Registry([Instance(role="decode", url="http://d:1", models=("alpha",))])
    registry.record_models("http://d:1", answer(card("alpha"), card("other")))
    assert registry.get("http://d:1").served() == {"alpha"}


def test_discovered_models_survive_a_reload_through_the_snapshot() -> None:
    old = fleet(d1=answer(card("alpha"), card("lora", "alpha")))
    new = Registry([P1, P2, D1, D2])
    new.restore(old.export())
    assert new.get(D1.url).served() == {"alpha", "lora"}
    assert new.get(D2.url).served() is None


# -- routing by model ----------------------------------------------------------------------


def test_every_stage_is_picked_among_instances_serving_the_model() -> None:
    registry = fleet(d1=answer(card("alpha")), d2=answer(card("beta")),
                     p1=answer(card("alpha")), p2=answer(card("beta")))
    router = Router(live_over(registry), seed=0)
    assert {pick(router, "decode", "beta") for _ in range(4)} == {D2.url}
    assert {pick(router, "prefill", "alpha") for _ in range(4)} == {P1.url}
    assert {pick(router, "decode") for _ in range(4)} == {D1.url, D2.url}
    with pytest.raises(NoBackend, match="serving model `gamma`"):
        pick(router, "decode", "gamma")
    each = router.pick_each("prefill", [b"a", b"b", b"c"], RouteRequest(model="beta"),
                            lambda role, d: None)
    assert [p.url for p in each] == [P2.url] * 3


def test_an_instance_not_read_yet_is_a_candidate_for_any_model() -> None:
    registry = fleet(d1=answer(card("alpha")))
    assert [i.url for i in registry.live("decode", "beta")] == [D2.url]
    assert [i.url for i in registry.live("decode", "alpha")] == [D1.url, D2.url]


def test_prefill_must_run_the_model_on_the_decodes_base() -> None:
    registry = fleet(d1=answer(card("alpha"), card("lora", "alpha")),
                     p1=answer(card("beta"), card("lora", "beta")),
                     p2=answer(card("alpha"), card("lora", "alpha")))
    base = registry.base_of(D1.url, "lora")
    assert base == "alpha"
    assert [i.url for i in registry.live("prefill", "lora", base)] == [P2.url]
    assert [i.url for i in registry.live("prefill", "lora")] == [P1.url, P2.url]


def test_mooncake_pairs_are_filtered_by_model() -> None:
    registry = fleet(p1=answer(card("alpha")), p2=answer(card("beta")))
    live = live_over(registry, connector="mooncake")
    found = BootstrapDiscovery(live, transport=None)  # type: ignore[arg-type]
    found._engines[P1.url] = Engines(P1.bootstrap_url or "", ("a0", "a1"))
    found._engines[P2.url] = Engines(P2.bootstrap_url or "", ("b0",))
    assert {(p.instance.url, p.dp_rank) for p in found.placements("beta")} == {(P2.url, 0)}
    router = Router(live, sources={"prefill": found}, seed=0)
    alpha = RouteRequest(model="alpha")
    assert {router.pick("prefill", alpha, lambda role, d: None).engine_id
            for _ in range(4)} == {"a0", "a1"}
    with pytest.raises(NoBackend, match="gamma"):
        router.pick("prefill", RouteRequest(model="gamma"), lambda role, d: None)


# -- the catalog ---------------------------------------------------------------------------


def catalog(registry: Registry) -> Catalog:
    return Catalog(live_over(registry))


def test_resolve_answers_404_503_or_the_model() -> None:
    registry = fleet(d1=answer(card("alpha")), d2=answer(card("beta")))
    cat = catalog(registry)
    assert cat.resolve("alpha") == "alpha"
    with pytest.raises(ModelNotFound) as info:
        cat.resolve("gamma")
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert info.value.payload()["error"]["param"] == "model"
    for _ in range(3):
        registry.record_failure(D2.url, "down")
    with pytest.raises(NoBackend, match="evicted"):
        cat.resolve("beta")
    # Prefills never make a model servable.
    registry.record_models(P1.url, answer(card("delta")))
    with pytest.raises(ModelNotFound):
        cat.resolve("delta")


def test_a_missing_model_is_the_only_base_model_or_400() -> None:
    assert catalog(fleet()).resolve(None) is None  # nothing known: no filter, as before
    one = fleet(d1=answer(card("alpha"), card("lora", "alpha")), d2=answer(card("alpha")))
    assert catalog(one).resolve(None) == "alpha"
    assert catalog(one).resolve("") == "alpha"
    two = fleet(d1=answer(card("alpha")), d2=answer(card("beta")))
    with pytest.raises(ClientError) as info:
        catalog(two).resolve(None)
    assert info.value.status == 400 and info.value.code == "model_required"
    assert "`alpha`, `beta`" in info.value.message


def test_listing_is_built_once_until_the_registry_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The union (and its JSON) is made once per registry change, not per call, and every
    change that alters it shows at the next call."""
    registry = fleet(d1=answer(card("alpha")), d2=answer(card("beta")))
    cat = catalog(registry)
    walks: list[int] = []
    states = registry.states
    monkeypatch.setattr(registry, "states", lambda: walks.append(1) or states())
    first = cat.listing()
    for _ in range(5):
        assert cat.listing() is first
    assert len(walks) == 1
    body = cat.listing_json()
    assert cat.listing_json() is body and json.loads(body or b"") == first
    assert len(walks) == 1
    registry.record_models(D2.url, answer(card("beta"), card("gamma")))
    assert [c["id"] for c in cat.listing()["data"]] == ["alpha", "beta", "gamma"]
    assert json.loads(cat.listing_json() or b"") == cat.listing()
    for _ in range(3):
        registry.record_failure(D1.url, "down")
    assert [c["id"] for c in cat.listing()["data"]] == ["beta", "gamma"]
    registry.record_success(D1.url)
    assert [c["id"] for c in cat.listing()["data"]] == ["alpha", "beta", "gamma"]


def test_listing_is_the_union_of_live_decode_side_instances() -> None:
    assert catalog(fleet()).listing() is None
    registry = fleet(d1=answer(card("alpha"), card("lora", "alpha")),
                     d2=answer(card("alpha", created=2), card("beta")),
                     p1=answer(card("prefill-only")))
    doc = catalog(registry).listing()
    assert doc is not None and doc["object"] == "list"
    assert [c["id"] for c in doc["data"]] == ["alpha", "lora", "beta"]
    assert doc["data"][1]["parent"] == "alpha"
    for _ in range(3):
        registry.record_failure(D2.url, "down")
    assert [c["id"] for c in catalog(registry).listing()["data"]] == ["alpha", "lora"]


# -- start and reload refuse the roster error ----------------------------------------------

ORPHAN_MODEL = """instances:
  - {role: prefill, url: "http://p:1", models: [llama, qwen]}
  - {role: decode, url: "http://d:1", models: [llama]}
"""


def test_the_master_refuses_a_prefill_model_no_decode_serves(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    class Arbiter:
        log = logging.getLogger("test.master")

    path = tmp_path / "roster.yaml"
    path.write_text(ORPHAN_MODEL)
    monkeypatch.setenv("EPD_ROSTER", str(path))
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "state"))
    with pytest.raises(RuntimeError, match=r"cannot start.*http://p:1.*'qwen'"):
        reload.start(Arbiter())
    path.write_text(ORPHAN_MODEL.replace("models: [llama]}", "models: [llama, qwen]}"))
    reloader = reload.start(Arbiter())
    try:
        path.write_text(ORPHAN_MODEL)
        with caplog.at_level(logging.ERROR, logger="test.master"):
            reloader.refresh()
        assert "REJECTED" in caplog.text and "'qwen'" in caplog.text
        state = StateDir.from_env()
        assert state is not None and state.published().generation == 1
    finally:
        reloader.cleanup()
