"""Guarantee 10: with a signing key the whole stored run is authenticated and bound to it.

Each attack edits a real signed checkpoint the way someone who can write the
bucket (but has no key) could: a header field with ``size``/``crc32``
recomputed, a payload moved from another run, a whole object copied under
another run's key, an unsigned object. Every one must be refused before any
step runs, and the charge it aims at must not fire again.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt

KEY_A = ckpt.checkpoint_key("pay", "a")
KEY_B = ckpt.checkpoint_key("pay", "b")
SECRET = "k" * 32


def workflow(store: ds.Store, charges: list[str], serializer: str = "pickle") -> ds.Workflow:
    wf = ds.Workflow("pay", store=store, serializer=serializer, signing_key=SECRET)

    @wf.step()
    def plan(state: dict[str, Any]) -> None:
        state["amount"] = 500

    @wf.step(idempotent=False)
    def charge(state: dict[str, Any], ctx: ds.Context) -> None:
        charges.append(ctx.idempotency_key)
        state["charged"] = True

    return wf


def edit_header(data: bytes, **fields: Any) -> bytes:
    """What an attacker without the key can do: edit fields, fix size and crc, keep 'sig'."""
    line, payload = data.split(b"\n", 1)
    record = json.loads(line)
    record.update(fields)
    record.update(size=len(payload), crc32=zlib.crc32(payload))
    return json.dumps(record, separators=(",", ":")).encode() + b"\n" + payload


def put_over(store: ds.Store, key: str, change: Callable[[bytes], bytes]) -> None:
    found = store.get(key)
    assert found is not None
    store.put(key, change(found[0]), match=found[1])


@pytest.fixture(params=["pickle", "json"])
def serializer(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize(
    "fields",
    [
        {"status": "running", "next_step": 0, "run_nonce": "0" * 32},  # reset a completed run
        {"status": "running", "next_step": 1},  # back to the charge
        {"run_nonce": "f" * 32},  # new keys for the same run
        {"committed": 0, "history": []},  # rewrite the record of what ran
    ],
)
def test_an_edited_header_is_refused_unread(
    serializer: str, fields: dict[str, Any], tmp_path: Any
) -> None:
    """Status, cursor, nonce or intent edited (size and crc recomputed): refused, nothing fires."""
    store = ds.LocalStore(tmp_path / "s")
    charges: list[str] = []
    wf = workflow(store, charges, serializer)
    wf.run("a", {})
    assert len(charges) == 1
    put_over(store, KEY_A, lambda data: edit_header(data, **fields))
    with pytest.raises(ds.CorruptCheckpoint, match="signature does not verify"):
        wf.run("a")
    assert len(charges) == 1


def test_a_payload_moved_from_another_run_is_refused(serializer: str) -> None:
    """Run b's (validly signed) state put under run a's header is refused."""
    store = ds.MemoryStore()
    charges: list[str] = []
    wf = workflow(store, charges, serializer)
    wf.run("a", {"who": "alice"})
    wf.run("b", {"who": "mallory"})
    b_payload = store.get(KEY_B)[0].split(b"\n", 1)[1]  # type: ignore[index]

    def swap(data: bytes) -> bytes:
        line = data.split(b"\n", 1)[0]
        return edit_header(line + b"\n" + b_payload)

    put_over(store, KEY_A, swap)
    with pytest.raises(ds.CorruptCheckpoint, match="signature does not verify"):
        wf.run("a")


def test_a_whole_object_copied_to_another_run_is_refused(serializer: str) -> None:
    """A signed checkpoint copied whole under another run's key names the wrong run."""
    store = ds.MemoryStore()
    charges: list[str] = []
    wf = workflow(store, charges, serializer)
    wf.run("a", {})
    store.put(KEY_B, store.get(KEY_A)[0])  # type: ignore[index]
    with pytest.raises(ds.CorruptCheckpoint, match="belongs to run pay/a"):
        wf.run("b")
    assert len(charges) == 1


def test_an_unsigned_checkpoint_is_refused_when_a_key_is_set(serializer: str) -> None:
    """A checkpoint without a signature (written without the key, or forged) is refused."""
    store = ds.MemoryStore()
    unsigned = ds.Workflow("pay", store=store, serializer=serializer)
    unsigned.step(name="plan")(lambda s: None)
    unsigned.step(name="charge", idempotent=False)(lambda s: None)
    crashing = ds.Workflow(
        "pay", store=ds.testing.CrashingStore(store, before_write=2), serializer=serializer
    )
    crashing.step(name="plan")(lambda s: None)
    crashing.step(name="charge", idempotent=False)(lambda s: None)
    with pytest.raises(ds.testing.SimulatedCrash):
        crashing.run("a", {})
    charges: list[str] = []
    with pytest.raises(ds.CorruptCheckpoint, match="is not signed, but a signing key is set"):
        workflow(store, charges, serializer).run("a")
    assert charges == []


def test_the_signature_is_the_header_lines_last_field() -> None:
    """The tag covers the header written without it: cutting it off gives the signed bytes."""
    store = ds.MemoryStore()
    workflow(store, []).run("a", {})
    line = store.get(KEY_A)[0].split(b"\n", 1)[0]  # type: ignore[index]
    record = json.loads(line)
    assert list(record)[-1] == "sig"
    assert len(record["sig"]) == 64


def test_resolve_re_signs_and_readers_without_the_key_still_see_the_header() -> None:
    """wf.resolve verifies and re-signs; a reader without the key decodes the header."""
    store = ds.MemoryStore()
    charges: list[str] = []
    wf = ds.Workflow("pay", store=store, serializer="pickle", signing_key=SECRET)
    wf.step(name="charge", idempotent=False, in_doubt="raise")(
        lambda s, ctx: charges.append(ctx.idempotency_key)
    )
    crashing = ds.Workflow(
        "pay",
        store=ds.testing.CrashingStore(store, after_write=2),
        serializer="pickle",
        signing_key=SECRET,
    )
    crashing.step(name="charge", idempotent=False, in_doubt="raise")(lambda s: None)
    with pytest.raises(ds.testing.SimulatedCrash):
        crashing.run("a", {})
    with pytest.raises(ds.StepInDoubt):
        wf.run("a")
    wf.resolve("a", fired=True)
    header, _ = ckpt.decode(store.get(KEY_A)[0], where="test")  # type: ignore[index]
    assert header.intent is not None
    assert header.intent["resolution"] == "fired"
    assert wf.run("a") == {}
    assert charges == []


def test_resolve_without_the_key_is_refused() -> None:
    """Resolving a signed run needs the key: an unsigned header would be refused later."""
    from durable_steps._protocol import resolving

    store = ds.MemoryStore()
    workflow(store, []).run("a", {})
    with pytest.raises(ds.DurableStepsError, match="is signed"):
        resolving.resolve(store, "pay", "a", fired=True)


def test_show_with_the_key_refuses_an_edited_header(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With $DURABLE_STEPS_SIGNING_KEY set, `show` refuses a tampered signed run instead
    of displaying its forged fields; without the key it still shows the header."""
    from durable_steps import cli

    store = ds.LocalStore(tmp_path / "s")
    workflow(store, []).run("a", {})
    put_over(store, KEY_A, lambda data: edit_header(data, status="running", next_step=1))
    url = str(tmp_path / "s")
    assert cli.main(["--store", url, "show", "pay/a"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("DURABLE_STEPS_SIGNING_KEY", SECRET)
    assert cli.main(["--store", url, "show", "pay/a"]) == 1
    assert "signature does not verify" in capsys.readouterr().err
