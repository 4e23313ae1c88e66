"""reconcile can say what an effect in doubt returned: ``ds.Fired(result)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from tests.conftest import StoreTarget, _target


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The local store and one S3 server over the wire."""
    return _target(request.param, request, tmp_path)


class Payments:
    """A payments API that can be told to die mid-call (after it charged)."""

    def __init__(self) -> None:
        self.charges: dict[str, dict[str, Any]] = {}
        self.die = True
        self.asked: list[str | None] = []

    def charge(self, cents: int, *, idempotency_key: str) -> dict[str, Any]:
        self.charges[idempotency_key] = {"id": f"ch_{len(self.charges)}", "cents": cents}
        if self.die:
            raise ds.testing.SimulatedCrash("killed after the charge went through")
        return self.charges[idempotency_key]


def paying(store: ds.Store, api: Payments) -> ds.Workflow:
    """The charge's result is used as a live result would be: its id goes in the state."""

    def reconcile(state: dict[str, Any], ctx: ds.Context) -> Any:
        api.asked.append(ctx.effect_in_doubt)
        found = api.charges.get(ctx.idempotency_key)
        return ds.Fired(found) if found else False

    wf = ds.Workflow("pay", store=store)

    @wf.step(reconcile=reconcile)
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        receipt = ctx.effect("charge", api.charge, 500)
        state["receipt"] = receipt["id"]  # written for the live result

    return wf


def test_reconcile_gives_the_result_ctx_effect_returns(target: StoreTarget) -> None:
    """An effect killed after it fired: reconcile finds it and returns Fired(result);
    the step gets that result from ctx.effect and nothing fires twice."""
    api = Payments()
    store = target.open()
    with pytest.raises(ds.testing.SimulatedCrash):
        paying(store, api).run("o1", {})
    api.die = False
    final = paying(store, api).run("o1")
    assert final == {"receipt": "ch_0"}
    assert api.asked == ["charge"]
    assert len(api.charges) == 1


def test_a_reconciled_result_is_recorded_before_the_step_runs(target: StoreTarget) -> None:
    """The result reconcile gave is journaled: a crash after it and before the commit
    replays it, without asking reconcile again or charging."""
    api = Payments()
    store = target.open()
    with pytest.raises(ds.testing.SimulatedCrash):
        paying(store, api).run("o1", {})
    api.die = False
    crashing = ds.testing.CrashingStore(store, before_write=2)  # 1: the reconciled record
    with pytest.raises(ds.testing.SimulatedCrash):  # 2: the commit
        paying(crashing, api).run("o1")
    assert crashing.writes == 2
    assert paying(store, api).run("o1") == {"receipt": "ch_0"}
    assert api.asked == ["charge"]  # asked once: the second run replayed the record
    assert len(api.charges) == 1


def test_fired_from_a_steps_own_reconcile_is_refused(tmp_path: Path) -> None:
    """A non-idempotent step's reconcile answers True or False; Fired there is an error
    that names the step and writes nothing."""
    store = ds.LocalStore(tmp_path)
    wf = ds.Workflow("pay", store=store)
    fire = {"die": True}

    @wf.step(idempotent=False, reconcile=lambda state, ctx: ds.Fired("x"))
    def charge(state: dict[str, Any], ctx: ds.Context) -> None:
        if fire["die"]:
            raise ds.testing.SimulatedCrash("killed while charging")

    with pytest.raises(ds.testing.SimulatedCrash):
        wf.run("o1", {})
    before = store.get("pay/o1/checkpoint")
    fire["die"] = False
    with pytest.raises(ds.DefinitionError, match=r"step 'charge'.*Fired.*True.*False"):
        wf.run("o1")
    assert store.get("pay/o1/checkpoint") == before
