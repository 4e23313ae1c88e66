"""What the web page says of a run someone tampered with, and of a step that ran again.

Each run here is real, on a LocalStore, and each tampering is what someone
who can write the bucket (but has no signing key) could do: a signed head
rewritten without its signature or with fields edited under the old one,
an unsigned head copied over a signed run, a history chunk's bytes edited in
place. The page must refuse or mark each one, never show it as the run's
genuine record; and a step the history records as run again (after a
failure, after a person's resolution) is marked so on its row.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the ui extra is not installed")
pytest.importorskip("uvicorn", reason="the ui extra is not installed")

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps._record import history
from durable_steps.serializers import SIGNING_KEY_ENV
from durable_steps.ui import _detail, _history, _listing

from .test_ui_http import Server, fetch

pytestmark = pytest.mark.ui
SECRET = "s" * 32
KEY = ckpt.checkpoint_key("signed", "r")


@pytest.fixture
def page() -> Iterator[Any]:
    """``page(store, path)``: the HTTP status and body of ``path`` served over ``store``."""
    made: list[Server] = []

    def get(store: ds.Store, path: str) -> tuple[int, str]:
        if not made:
            made.append(Server(store, read_only=True))
        code, _, body = fetch(made[0].url + path)
        return code, body

    yield get
    for server in made:
        server.stop()


def workflow(store: ds.Store, **options: Any) -> ds.Workflow:
    wf = ds.Workflow("signed", store=store, **options)

    @wf.step()
    def draft(state: dict[str, Any]) -> None:
        state["draft"] = "hello"

    @wf.step()
    def send(state: dict[str, Any]) -> None:
        state["sent"] = True

    return wf


def signed_run(tmp_path: Path) -> ds.LocalStore:
    store = ds.LocalStore(tmp_path / "s")
    assert workflow(store, signing_key=SECRET).run("r", {"secret": "real"})["sent"]
    return store


def put_over(store: ds.Store, data: bytes) -> None:
    found = store.get(KEY)
    assert found is not None
    store.put(KEY, data, match=found[1])


def forged_failure(store: ds.Store) -> ckpt.Checkpoint:
    """The signed run's head, made to say it failed at ``send`` (no signature yet)."""
    found = store.get(KEY)
    assert found is not None
    header, _ = ckpt.decode(found[0], where="test")
    error = {"step": "send", "iteration": 0, "type": "X", "message": "forged", "attempts": 1}
    return header.replace(status="failed", next_step=1, error={**error, "at": 1.0})


def test_a_signed_head_stripped_of_its_signature_is_refused_with_or_without_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: Any
) -> None:
    """Rewritten without its ``sig``: the workflow refuses it, and so does the page --
    without the key too (no key is needed to see that the signature is missing)."""
    store = signed_run(tmp_path)
    found = store.get(KEY)
    assert found is not None
    _, payload = ckpt.decode(found[0], where="test")
    put_over(store, ckpt.encode(forged_failure(store), payload))
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    with pytest.raises(ds.CorruptCheckpoint, match="carries no signature"):
        _detail.run_page(store, "signed", "r")
    code, body = page(store, "/runs/signed/r")
    assert code == 409
    assert "carries no signature" in body
    assert "forged" not in body.replace("forged_", "")  # the forged error is not shown
    # the runs list reads raw headers: it shows the run as corrupt, not as failed
    (row,) = _listing.list_runs(store).rows
    assert (row.run_id, row.status) == ("r", "corrupt")
    assert _listing.list_runs(store).counts.get("failed") is None
    assert [r.status for r in _listing.list_runs(store, query="signed/r").rows] == ["corrupt"]
    # A "sig" that is no tag, or not the line's last field, is no signature either.
    stripped = ckpt.encode(forged_failure(store), payload)
    line, rest = stripped.split(b"\n", 1)
    for bad in (line[:-1] + b',"sig":"forged"}', b'{"sig":"' + b"a" * 64 + b'",' + line[1:]):
        put_over(store, bad + b"\n" + rest)
        assert [r.status for r in _listing.list_runs(store).rows] == ["corrupt"], bad
    put_over(store, stripped)
    monkeypatch.setenv(SIGNING_KEY_ENV, SECRET)
    with pytest.raises(ds.CorruptCheckpoint, match="not signed"):
        _detail.run_page(store, "signed", "r")
    with pytest.raises(ds.CorruptCheckpoint, match="not signed"):
        workflow(store, signing_key=SECRET).run("r")


def edit_header(data: bytes, **fields: Any) -> bytes:
    """Edit fields of a head under its old signature (size and crc fixed up)."""
    line, payload = data.split(b"\n", 1)
    record = json.loads(line)
    record.update(fields, size=len(payload), crc32=zlib.crc32(payload))
    return json.dumps(record, separators=(",", ":")).encode() + b"\n" + payload


def test_a_signed_head_the_page_cannot_check_is_marked_not_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: Any
) -> None:
    """Edited under its old signature: without the key the page shows it marked "not
    verified" (every field only what the head claims); with the key it refuses it."""
    store = signed_run(tmp_path)
    found = store.get(KEY)
    assert found is not None
    put_over(store, edit_header(found[0], status="running", next_step=1))
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    code, body = page(store, "/runs/signed/r")
    assert code == 200
    assert 'id="signature-badge">not verified<' in body
    assert "what its head claims" in body
    shown = _detail.run_page(store, "signed", "r")
    assert shown.signature is not None
    assert shown.signature.kind == "unverified"
    assert ("signature", f"signed, not verified (${SIGNING_KEY_ENV} is not set)") in shown.fields
    monkeypatch.setenv(SIGNING_KEY_ENV, SECRET)
    with pytest.raises(ds.CorruptCheckpoint, match="does not verify"):
        _detail.run_page(store, "signed", "r")
    put_over(store, edit_header(found[0], serializer="json"))  # the suffix cut, the sig kept
    with pytest.raises(ds.CorruptCheckpoint, match="does not verify"):
        _detail.run_page(store, "signed", "r")


def test_an_unsigned_head_over_a_signed_run_is_marked_while_the_page_has_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: Any
) -> None:
    """Someone's own unsigned run copied over a signed one: the workflow refuses it; the
    page, which cannot know whether the workflow signs, shows it marked "not signed"
    and says what that means. The genuine signed run is shown as verified."""
    store = signed_run(tmp_path)
    monkeypatch.setenv(SIGNING_KEY_ENV, SECRET)
    genuine = store.get(KEY)
    assert genuine is not None
    theirs = ds.MemoryStore()
    workflow(theirs).run("r", {"secret": "forged"})
    found = theirs.get(KEY)
    assert found is not None
    put_over(store, found[0])
    with pytest.raises(ds.CorruptCheckpoint, match="not signed"):
        workflow(store, signing_key=SECRET).run("r")
    code, body = page(store, "/runs/signed/r")
    assert code == 200
    assert 'id="signature-badge">not signed<' in body
    assert 'id="signature-warning"' in body
    shown = _detail.run_page(store, "signed", "r")
    assert shown.signature is not None
    assert shown.signature.kind == "unsigned"
    assert "If workflow 'signed' signs" in shown.signature.warning
    monkeypatch.delenv(SIGNING_KEY_ENV)  # without a key, an unsigned run is just that
    plain = _detail.run_page(store, "signed", "r")
    assert plain.signature is not None
    assert (plain.signature.kind, plain.signature.warning) == ("unsigned", "")
    monkeypatch.setenv(SIGNING_KEY_ENV, SECRET)
    put_over(store, genuine[0])  # the signed head back: verified, nothing to warn of
    shown = _detail.run_page(store, "signed", "r")
    assert ("signature", f"verified with ${SIGNING_KEY_ENV}") in shown.fields
    assert shown.signature is not None
    assert not shown.signature.warning


def test_a_step_run_again_after_failures_or_a_resolution_is_marked(
    tmp_path: Path, page: Any
) -> None:
    """Two failed runs of a retried step, then its commit: each later row says it ran
    again and how many attempts the history records in all; a clean step says nothing.
    A step in doubt that a person resolved as not fired, then re-fired, says so."""
    store = ds.LocalStore(tmp_path / "s")
    tries = [0]
    wf = ds.Workflow("w", store=store)

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=(ValueError,)))
    def flaky(state: dict[str, Any]) -> None:
        tries[0] += 1
        if tries[0] <= 5:
            raise ValueError("not yet")

    @wf.step()
    def clean(state: dict[str, Any]) -> None:
        state["done"] = True

    for _ in range(2):
        with pytest.raises(ds.StepFailed):
            wf.run("r", {})
    wf.run("r")
    _, body = page(store, "/runs/w/r")
    assert '<span class="rerun">ran again after 2 failures' in body
    rows = [e for e in _detail.run_page(store, "w", "r").timeline.entries if e.step]  # type: ignore[union-attr]
    assert [(e.kind, e.step, e.attempts) for e in rows] == [
        ("failure", "flaky", 2),
        ("failure", "flaky", 2),
        ("step", "flaky", 2),
        ("step", "clean", 1),
    ]
    assert rows[0].rerun == ""
    assert (
        rows[1].rerun
        == "ran again after a failure: run 2 of this step in pass 0, 4 attempts in all"
    )
    assert (
        rows[2].rerun
        == "ran again after 2 failures: run 3 of this step in pass 0, 6 attempts in all"
    )
    assert rows[3].rerun == ""
    header = ckpt.decode(store.get(ckpt.checkpoint_key("w", "r"))[0], where="t")[0]  # type: ignore[index]
    kept = _history.read(store, header)
    assert kept is not None
    assert kept.entries(2, 3)[0].rerun == rows[2].rerun  # a page that starts at the commit

    fired: list[str] = []
    pay = ds.Workflow("pay", store=ds.testing.CrashingStore(store, after_write=2))
    pay.step(name="charge", idempotent=False, in_doubt="raise")(lambda s: None)
    with pytest.raises(ds.testing.SimulatedCrash):  # died after its intent: it may have fired
        pay.run("p", {})
    pay = ds.Workflow("pay", store=store)
    pay.step(name="charge", idempotent=False, in_doubt="raise")(
        lambda s, ctx: fired.append(ctx.idempotency_key)
    )
    with pytest.raises(ds.StepInDoubt):
        pay.run("p")
    pay.resolve("p", fired=False)
    pay.run("p")
    assert len(fired) == 1
    rows = [e for e in _detail.run_page(store, "pay", "p").timeline.entries if e.step]  # type: ignore[union-attr]
    assert [(e.kind, e.rerun) for e in rows] == [
        ("resolution", ""),
        ("step", "ran again after a person resolved it (did not fire)"),
    ]


def test_a_tampered_history_chunk_is_told_from_a_missing_one(tmp_path: Path, page: Any) -> None:
    """A chunk whose bytes no longer hash to its name is shown as tampered, apart from a
    chunk that is gone (not kept) -- also when the page had read it before it was
    changed (the cache is by version) -- and the page still opens."""
    store = ds.LocalStore(tmp_path / "s")
    wf = ds.Workflow("h", store=store, until=lambda s: s["n"] >= 100)

    @wf.step()
    def count(state: dict[str, Any]) -> None:
        state["n"] += 1

    wf.run("r", {"n": 0})
    chunks = sorted(i.key for i in store.list(history.history_prefix("h", "r")))
    assert len(chunks) >= 2
    first = _detail.run_page(store, "h", "r").timeline  # read (and cached) before the edit
    assert first is not None
    assert first.missing == 0
    data, version = store.get(chunks[1])  # type: ignore[misc]
    store.put(chunks[1], data[:-1] + bytes([data[-1] ^ 1]), match=version)
    code, body = page(store, "/runs/h/r")
    assert code == 200
    assert 'id="history-damaged"' in body
    assert "does not match its digest" in body
    tampered = _detail.run_page(store, "h", "r").timeline
    assert tampered is not None
    assert tampered.damaged
    assert tampered.broken is not None
    assert tampered.broken[0] == "tampered"
    assert chunks[1] in tampered.broken[1]
    assert tampered.missing > 0
    store.delete(chunks[1])
    gone = _detail.run_page(store, "h", "r").timeline
    assert gone is not None
    assert not gone.damaged
    assert gone.broken is not None
    assert gone.broken[0] == "missing"
    assert gone.missing == tampered.missing
    _, body = page(store, "/runs/h/r")
    assert 'id="history-damaged"' not in body
    assert "not in the history the run kept" in body
