"""The page's "yes" is pinned to the run it showed, on the read the action uses.

A signal is bound to the nonce ``_signals.send`` reads, and a fork copies the
head ``_fork.fork`` reads: the confirmation's nonce is checked on those very
reads. Here a store deletes the run and creates another under its id between
the command's first read and the action's own (issue 36's review, B4).
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps.cli._main import main
from durable_steps.ui import _actions
from tests.storetools import Wrapped

KEY = "hold/r1/checkpoint"


def hold(store: ds.Store) -> ds.Workflow:
    wf = ds.Workflow("hold", store=store)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["decision"] = ctx.wait_for("go")

    return wf


def start(store: ds.Store, who: str) -> str:
    """Run r1 until it waits; its nonce."""
    with pytest.raises(ds.RunSuspended):
        hold(store).run("r1", {"who": who})
    found = store.get(KEY)
    assert found is not None
    return ckpt.decode(found[0], where=KEY)[0].run_nonce


class Racy(Wrapped):
    """Replaces run r1 by a new one on the second read of its head once armed."""

    def __init__(self, inner: ds.Store, root: str) -> None:
        super().__init__(inner)
        self.root, self.reads, self.armed, self.swapped = root, 0, False, False

    def get(self, key: str) -> tuple[bytes, str] | None:
        if self.armed and key == KEY:
            self.reads += 1
            if self.reads == 2:
                self.armed, self.swapped = False, True
                assert main(["--store", self.root, "rm", "hold/r1"]) == 0
                start(self.inner, "the new run")
        return self.inner.get(key)


@pytest.mark.parametrize("action", ["signal", "fork"])
def test_a_run_replaced_between_the_pin_and_the_action_is_refused(action: str) -> None:
    root = tempfile.mkdtemp()
    inner = ds.LocalStore(root)
    shown = start(inner, "the run the page showed")
    store = Racy(inner, root)
    form = {"action": action, "workflow": "hold", "run_id": "r1", "nonce": shown}
    if action == "signal":
        form.update(signal="go", payload='"refund 500"')
    else:
        form["new_run"] = "r2"
    request = _actions.parse(form)
    store.armed = True
    outcome = _actions.perform(request, store)
    assert store.swapped
    assert not outcome.ok, outcome.message
    assert "changed since you confirmed" in outcome.message
    assert inner.get("hold/r1/signals/go") is None  # the new run got nothing
    assert inner.get("hold/r2/checkpoint") is None  # and was not forked
