"""Records that round-trip: JSON states a resume sees unchanged, and headers decoded strictly.

Guarantee 9 (same state, crashed or not) for the JSON serializer: a value JSON
would give back changed is refused at commit, naming its path. Guarantee 8
(bad input, nothing lost) for the header: every damaged, truncated, deep,
incomplete or implausible record is CorruptCheckpoint, never another exception.
"""

from __future__ import annotations

import collections
import copy
import enum
import json
import math
import socket
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import durable_steps as ds
from durable_steps import cli
from durable_steps._record import checkpoint as ckpt
from durable_steps.serializers import MAX_DEPTH, JSONSerializer, check_json
from tests.budget import examples
from tests.storetools import Wrapped, committed

DEEP = 100_000


def deep_list(levels: int) -> Any:
    """``[[[...]]]`` with ``levels`` lists, built without recursion."""
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


def same(a: Any, b: Any) -> bool:
    """Equal *and* of the same types all the way down (1 == 1.0 == True is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def header_record(**changes: Any) -> dict[str, Any]:
    """A real header record (as ``encode`` writes it) for an empty JSON state."""
    header = ckpt.Checkpoint(
        workflow="w", run_id="r", steps=("a", "b"), serializer="json", format=1
    )
    line = ckpt.encode(header, b"{}").partition(b"\n")[0]
    return {**json.loads(line), **changes}


def stored(record: dict[str, Any], payload: bytes = b"{}") -> bytes:
    """Header line + payload, with size and CRC-32 made to match ``payload``."""
    record = {**record, "size": len(payload), "crc32": zlib.crc32(payload)}
    return json.dumps(record).encode() + b"\n" + payload


def decode_problem(data: bytes) -> str:
    """The CorruptCheckpoint message ``decode`` gives for ``data`` (fails if it decodes)."""
    with pytest.raises(ds.CorruptCheckpoint) as raised:
        ckpt.decode(data, where="t")
    return raised.value.message


class Color(enum.IntEnum):
    RED = 1


class Label(str, enum.Enum):
    DONE = "done"


# --- 1. JSON states round-trip or are refused ---------------------------------------


@pytest.mark.parametrize(
    ("value", "path", "hint"),
    [
        ({"pair": (1, 2)}, "state['pair']", "use a list"),
        ({"seen": {1, 2}}, "state['seen']", "use a list"),
        ({"by_id": {1: "a"}}, "state['by_id']", "use str keys"),
        ({"by_id": {1: "a", "1": "b"}}, "state['by_id']", "use str keys"),
        ({"m": {2.5: "x"}}, "state['m']", "use str keys"),
        ({"m": {True: "x"}}, "state['m']", "use str keys"),
        ({"m": {None: "x"}}, "state['m']", "use str keys"),
        ({"score": math.nan}, "state['score']", "not standard JSON"),
        ({"scores": [1.0, math.inf]}, "state['scores'][1]", "not standard JSON"),
        ({"low": -math.inf}, "state['low']", "not standard JSON"),
        ({"color": Color.RED}, "state['color']", "plain int"),
        ({"label": Label.DONE}, "state['label']", "plain str"),
        ({"o": collections.OrderedDict(a=1)}, "state['o']", "plain dict"),
        ({"d": collections.defaultdict(list)}, "state['d']", "plain dict"),
        ({"msgs": [{"role": "user", "parts": ("a",)}]}, "state['msgs'][0]['parts']", "list"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v[:12],
)
def test_json_refuses_what_a_resume_would_see_changed(value: Any, path: str, hint: str) -> None:
    """A value JSON gives back changed is a SerializationError naming its path; nothing is lost."""
    store = ds.MemoryStore()
    wf = ds.Workflow("roundtrip", store=store)
    wf.step(name="ok")(lambda s: s.update(n=1))
    wf.step(name="bad")(lambda s: s.update(value))
    with pytest.raises(ds.SerializationError) as raised:
        wf.run("r1", {})
    err = raised.value
    assert (err.path, err.run, err.step) == (path, "roundtrip/r1", "bad")
    assert path in err.message
    assert hint in err.message
    assert 'serializer="pickle"' in err.message
    header, state = committed(store, ckpt.checkpoint_key("roundtrip", "r1"))
    assert (header.next_step, state) == (1, {"n": 1})  # the last good checkpoint


def test_state_after_commit_is_the_state_a_resume_sees() -> None:
    """The next step sees the same state, types included, live or resumed after a crash."""
    seen: list[Any] = []

    def put(state: dict[str, Any]) -> None:
        state.update(by_id={"1": "a"}, pair=[1, 2], x=1.0, n=1, b=True, none=None)

    def look(state: dict[str, Any]) -> None:
        seen.append(copy.deepcopy(state))
        if len(seen) == 1:
            raise RuntimeError("the process dies here")

    wf = ds.Workflow("same", store=ds.MemoryStore(), steps=[put, look])
    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})  # seen[0]: the live state after put's commit
    wf.run("r1")  # seen[1]: the state decoded from put's checkpoint
    assert same(seen[0], seen[1])


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=examples(300), deadline=None)
@given(json_values)
def test_what_dumps_accepts_loads_gives_back_identically(value: Any) -> None:
    """Every value made of the JSON types is accepted and decodes equal, with the same types."""
    serializer = JSONSerializer()
    assert same(serializer.loads(serializer.dumps(value)), value)


bad_leaves = st.sampled_from(
    [(1,), {1: "a"}, {None: 1}, math.nan, math.inf, -math.inf, {1, 2}, Color.RED, object()]
)


@settings(max_examples=examples(300), deadline=None)
@given(json_values, bad_leaves, st.data())
def test_one_bad_value_anywhere_is_refused_at_its_path(value: Any, bad: Any, data: Any) -> None:
    """A value that would not round-trip, put anywhere in a JSON state, is refused at its path."""
    state = {"root": value}
    parent: Any = state
    key: Any = "root"
    path = "state['root']"
    while isinstance(parent[key], (list, dict)) and parent[key] and data.draw(st.booleans()):
        node = parent[key]
        key = data.draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        parent, path = node, f"{path}[{key!r}]"
    parent[key] = bad
    with pytest.raises(ds.SerializationError) as raised:
        JSONSerializer().dumps(state)
    assert raised.value.path == path


def test_check_json_names_the_path_of_a_part() -> None:
    """check_json(part, path) reports paths under ``path``: a delta writer checks only a part."""
    check_json({"role": "user", "content": "hi"}, "state['messages'][41]")
    with pytest.raises(ds.SerializationError) as raised:
        check_json({"role": "user", "args": ("x",)}, "state['messages'][41]")
    assert raised.value.path == "state['messages'][41]['args']"
    check_json(deep_list(5), "state['t']", depth=MAX_DEPTH - 5)  # 5 more levels: at the limit
    with pytest.raises(ds.SerializationError, match="nested more than"):
        check_json(deep_list(6), "state['t']", depth=MAX_DEPTH - 5)


def test_pickle_keeps_what_json_refuses() -> None:
    """The error's advice holds: serializer="pickle" keeps tuples and int keys across a resume."""
    store = ds.MemoryStore()
    wf = ds.Workflow("pk", store=store, serializer="pickle")
    wf.step(name="put")(lambda s: s.update(pair=(1, 2), by_id={1: "a"}))
    wf.step(name="stop")(lambda s: (_ for _ in ()).throw(RuntimeError("crash")))
    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    assert committed(store, ckpt.checkpoint_key("pk", "r1"))[1] == {
        "pair": (1, 2),
        "by_id": {1: "a"},
    }


def test_initial_state_error_says_nothing_was_written() -> None:
    """An unsavable initial state says the run was not created, not that a step will run again."""
    store = ds.MemoryStore()
    wf = ds.Workflow("init", store=store)
    wf.step(name="a")(lambda s: None)
    with pytest.raises(ds.SerializationError) as raised:
        wf.run("r1", {"pair": (1, 2)})
    message = raised.value.message
    assert "run init/r1" in message
    assert "state['pair']" in message
    assert "not created" in message
    assert "run again on resume" not in message
    assert raised.value.step is None
    assert store.get(ckpt.checkpoint_key("init", "r1")) is None


# --- 2. deep nesting, both ways ---------------------------------------------------------


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_state_nested_100000_deep_is_a_serialization_error(serializer: str) -> None:
    """A very deep state gives SerializationError naming the depth and path, not RecursionError."""
    store = ds.MemoryStore()
    wf = ds.Workflow("deep", store=store, serializer=serializer)
    wf.step(name="grow")(lambda s: s.update(tree=deep_list(DEEP)))
    with pytest.raises(ds.SerializationError) as raised:
        wf.run("r1", {})
    err = raised.value
    assert f"nested more than {MAX_DEPTH} levels deep" in err.message
    assert err.path is not None
    assert err.path.startswith("state['tree'][0][0]")
    assert len(err.message) < 1000, "a 500-level path must be shortened in the message"
    assert err.step == "grow"


def test_json_accepts_state_at_the_depth_limit() -> None:
    """MAX_DEPTH levels are stored and read back; one more is refused at commit."""
    serializer = JSONSerializer()
    assert serializer.loads(serializer.dumps(deep_list(MAX_DEPTH))) == deep_list(MAX_DEPTH)
    with pytest.raises(ds.SerializationError):
        serializer.dumps(deep_list(MAX_DEPTH + 1))


def test_a_cycle_is_named_as_a_cycle() -> None:
    """A state that contains itself is refused as a cycle at its path."""
    state: dict[str, Any] = {"messages": [{"role": "user"}]}
    state["messages"][0]["parent"] = state
    with pytest.raises(ds.SerializationError, match="reference cycle") as raised:
        JSONSerializer().dumps(state)
    assert raised.value.path == "state['messages'][0]['parent']"


def run_from_payload(payload: bytes, serializer: str) -> tuple[ds.Workflow, list[str]]:
    """A workflow whose stored run r1 holds ``payload`` as its state, and its ran-steps log."""
    store = ds.MemoryStore()
    ran: list[str] = []
    wf = ds.Workflow("deepload", store=store, serializer=serializer)
    wf.step(name="a")(lambda s: ran.append("a"))
    wf.submit("r1", {})
    key = ckpt.checkpoint_key("deepload", "r1")
    found = store.get(key)
    assert found is not None
    header, _ = ckpt.decode(found[0], where="t")
    store.put(
        key, ckpt.encode(header.replace(format=1), payload), match=found[1]
    )  # a format-1 state
    return wf, ran


def test_a_json_state_nested_100000_deep_is_corrupt_checkpoint() -> None:
    """Resuming a checkpoint whose JSON state is 100,000 deep is CorruptCheckpoint; no step runs."""
    wf, ran = run_from_payload(b"[" * DEEP + b"]" * DEEP, "json")
    with pytest.raises(ds.CorruptCheckpoint, match="not valid JSON") as raised:
        wf.run("r1")
    assert raised.value.run == "deepload/r1"
    assert ran == []


def test_a_pickle_state_nested_100000_deep_stops_with_a_clear_error() -> None:
    """A 100,000-deep pickle state loads (unpickling does not recurse), then cannot be saved:
    a SerializationError naming the depth, never a RecursionError.
    """
    payload = b"\x80\x04" + b"]" * DEEP + b"a" * (DEEP - 1) + b"."  # lists appended into lists
    wf, _ = run_from_payload(payload, "pickle")
    with pytest.raises(ds.SerializationError, match=f"nested more than {MAX_DEPTH}"):
        wf.run("r1")


def deep_header(levels: int = DEEP) -> bytes:
    return b'{"format":1,"x":' + b"[" * levels + b"]" * levels + b"}\n{}"


def test_a_header_nested_100000_deep_is_corrupt_checkpoint() -> None:
    """A header line nested 100,000 deep (or just deeper than a header) is CorruptCheckpoint."""
    for data in (deep_header(), deep_header(20)):
        assert ckpt.split_header(data) is None
        assert "not a durable_steps checkpoint" in decode_problem(data)


def test_ls_and_workers_survive_a_header_nested_100000_deep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One object with a 100,000-deep header does not take down `ls` or a worker's scan."""
    url = str(tmp_path / "store")
    store = ds.LocalStore(url)
    wf = ds.Workflow("scan", store=store)
    wf.step(name="a")(lambda s: s.update(a=1))
    wf.submit("bad", {})
    wf.submit("good", {})
    key = ckpt.checkpoint_key("scan", "bad")
    found = store.get(key)
    assert found is not None
    store.put(key, deep_header(), match=found[1])
    assert cli.main(["--store", url, "ls"]) == 0
    out = capsys.readouterr().out
    assert "good" in out
    assert "corrupt" in out
    assert ds.Worker(wf).run(until_idle=True).completed == ["good"]


# --- 3. every decode problem is CorruptCheckpoint -------------------------------------


def real_checkpoints() -> list[bytes]:
    """Every checkpoint real runs wrote: created, intent (owner set), failed, completed."""
    found: list[bytes] = []

    class Recording(Wrapped):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if key.startswith("_index/"):  # the index of runs: not what is tested
                return super().put(key, data, match=match)
            found.append(data)
            return super().put(key, data, match=match)

    def think(state: dict[str, Any]) -> None:
        state["messages"] = [{"role": "user", "content": "hi é"}]

    def charge(state: dict[str, Any]) -> None:
        state["charged"] = True

    def fail(state: dict[str, Any]) -> None:
        raise RuntimeError("boom")

    steps = [ds.step(think), ds.step(charge, idempotent=False), ds.step(fail)]
    with pytest.raises(ds.StepFailed):
        ds.Workflow("real", store=Recording(ds.MemoryStore()), steps=steps).run("r1", {})
    pickled = ds.Workflow(
        "real", store=Recording(ds.MemoryStore()), steps=steps[:2], serializer="pickle"
    )
    pickled.run("r2", {"pair": (1, 2)})
    return found


REAL = real_checkpoints()
# Edge values a damaged header may hold: ints beyond float and int64, NaN and
# Infinity (which Python's json writes and reads), the pid that overflows os.kill.
edge_values = st.sampled_from([10**400, -(10**400), 2**63, 2**40, -1, 0, math.inf, math.nan])
json_scalars = st.one_of(
    edge_values,  # twice: they are what a per-field check can trip over
    edge_values,
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
)
any_json = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=12,
)
field_values = edge_values | json_scalars | any_json  # a field's own value is often a scalar
FIELDS = [*ckpt._REQUIRED, "format"]


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    """A real checkpoint, then bytes cut, flipped, inserted, or header fields changed."""
    data = draw(st.sampled_from(REAL))
    how = draw(st.sampled_from(["truncate", "flip", "insert", "field", "drop", "nested", "deep"]))
    line, _, payload = data.partition(b"\n")
    if how == "truncate":
        return data[: draw(st.integers(0, len(data)))]
    if how == "flip":
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    if how == "insert":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    if how == "deep":  # a value nested far deeper than the JSON parser recurses
        levels = draw(st.sampled_from([9, 2_000, DEEP]))
        at = draw(st.sampled_from([b'"intent":', b'"history":', b'"format":', b'"steps":']))
        return data.replace(at, at + b"[" * levels + b"1" + b"]" * levels + b',"x":', 1)
    record = json.loads(line)
    name = draw(st.sampled_from(FIELDS))
    if how == "drop":
        record.pop(name, None)
    elif how == "field":
        record[name] = draw(field_values)
    else:  # a key inside intent/error/owner, or a history entry
        inner = draw(st.sampled_from(["intent", "error", "owner", "history"]))
        value = record.get(inner) or {}
        if isinstance(value, dict):
            value[draw(st.sampled_from(["step", "pid", "until", "key", "policy", "lease"]))] = draw(
                any_json
            )
        else:
            value.append(draw(field_values))
        record[inner] = value
    keep_crc = draw(st.booleans())  # a hand edit that fixed size and CRC, or not
    if keep_crc and "size" in record:
        return stored(record, payload)
    return json.dumps(record).encode() + b"\n" + payload


@settings(max_examples=examples(600), deadline=None)
@given(damaged())
def test_decode_of_damaged_real_checkpoints_is_corrupt_checkpoint_or_a_header(data: bytes) -> None:
    """decode either returns or raises CorruptCheckpoint, whatever the damage."""
    try:
        ckpt.decode(data, where="t")
    except ds.CorruptCheckpoint:
        pass


@settings(max_examples=examples(600), deadline=None)
@given(
    st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=3),
    st.dictionaries(st.text(max_size=6), any_json, max_size=2) | st.just({}),
    st.binary(max_size=20),
    st.booleans(),
)
@example({"created_at": 10**400}, {}, b"", True)  # escaped as OverflowError (math.isnan)
@example({"owner": {"host": "h", "pid": 2**40, "token": "t", "until": 1.0}}, {}, b"", True)
@example({"format": "1"}, {}, b"", True)
def test_decode_of_random_json_headers_is_corrupt_checkpoint_or_a_header(
    fields: dict[str, Any], extra: dict[str, Any], payload: bytes, complete: bool
) -> None:
    """Any JSON object as a header line decodes or is CorruptCheckpoint; nothing else escapes.

    ``complete``: the other fields are a real header's and size and CRC-32 match the
    payload, so the damage reaches the per-field checks.
    """
    record = {**header_record(), **fields, **extra} if complete else {**fields, **extra}
    data = stored(record, payload) if complete else json.dumps(record).encode() + b"\n" + payload
    try:
        ckpt.decode(data, where="t")
    except ds.CorruptCheckpoint:
        pass


def test_real_checkpoints_decode() -> None:
    """The corpus the properties mutate is valid to begin with (every status written)."""
    statuses = {ckpt.decode(d, where="t")[0].status for d in REAL}
    assert statuses == {"running", "failed", "completed"}
    assert any(ckpt.decode(d, where="t")[0].intent for d in REAL)


# --- 4. missing fields are refused, not defaulted --------------------------------------


@pytest.mark.parametrize("name", ckpt._REQUIRED)
def test_a_missing_header_field_is_corrupt_checkpoint(name: str) -> None:
    """Every field the writer writes is required: a missing one is named, never defaulted."""
    record = header_record()
    del record[name]
    data = json.dumps(record).encode() + b"\n{}"
    assert f"missing field {name}" in decode_problem(data)


def test_a_missing_run_nonce_is_not_regenerated() -> None:
    """A header without run_nonce stops the run before any step (new nonce = new keys)."""
    store = ds.MemoryStore()
    keys: list[str] = []
    wf = ds.Workflow("nonce", store=store)
    wf.step(name="charge", idempotent=False)(lambda s, ctx: keys.append(ctx.idempotency_key))
    wf.submit("r1", {})
    key = ckpt.checkpoint_key("nonce", "r1")
    found = store.get(key)
    assert found is not None
    line, _, payload = found[0].partition(b"\n")
    record = json.loads(line)
    del record["run_nonce"]
    store.put(key, json.dumps(record).encode() + b"\n" + payload, match=found[1])
    with pytest.raises(ds.CorruptCheckpoint, match="missing field run_nonce"):
        wf.run("r1")
    assert keys == []


def test_an_unknown_header_field_is_corrupt_checkpoint() -> None:
    """A field this version does not know is refused by name."""
    assert "unknown field 'note'" in decode_problem(stored(header_record(note="x")))


# --- 5. the format field ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (0, "format 0 is not a valid checkpoint format"),
        (-5, "format -5 is not a valid checkpoint format"),
        ("1", "malformed header: format is '1'"),
        (1.0, "malformed header: format is 1.0"),
        (True, "malformed header: format is True"),
        (None, "malformed header: format is None"),
        (3, "has checkpoint format 3, newer than this durable_steps reads"),
    ],
)
def test_only_an_int_format_is_a_format(version: Any, message: str) -> None:
    """0 and -5 are invalid, "1" and 1.0 malformed, and only a greater int is "newer"."""
    assert message in decode_problem(stored(header_record(format=version)))


def test_a_newer_format_is_newer_whatever_its_fields() -> None:
    """A format-3 header is reported as newer even though its fields differ from format 2's."""
    assert "newer" in decode_problem(b'{"format":3,"head":{}}\n')


# --- 6. owner, intent and status values -------------------------------------------------


def owner(**changes: Any) -> dict[str, Any]:
    return {"host": "h", "pid": 42, "started": 1.5, "token": "t", "until": 2e9, **changes}


def intent(**changes: Any) -> dict[str, Any]:
    return {"step": "a", "index": 0, "iteration": 0, "key": "ds-1", "at": 1e9, **changes}


@pytest.mark.parametrize(
    "fields",
    [
        {"owner": owner(pid=2**40)},
        {"owner": owner(pid=2**22)},
        {"owner": owner(pid=0)},
        {"owner": owner(pid=-1)},
        {"owner": owner(pid=True)},
        {"owner": owner(until=math.inf)},
        {"owner": owner(until=math.nan)},
        {"owner": owner(started=-math.inf)},
        {"owner": owner(lease=0)},
        {"owner": owner(lease="60")},
        {"owner": owner(skew="x")},
        {"owner": owner(boot=5)},
        {"owner": owner(pidns="4026531836")},
        {"intent": intent(policy="maybe")},
        {"intent": intent(key="x" * 65)},
        {"intent": intent(at=math.nan)},
        {"updated_at": math.inf},
        {"created_at": 10**400},
        {"status": "deleted", "next_step": 3},
        {"status": "running", "next_step": 2},
        {"status": ["running"]},
    ],
    ids=repr,
)
def test_implausible_header_values_are_corrupt_checkpoint(fields: dict[str, Any]) -> None:
    """A pid no process can have, a non-finite time, a bad optional field: CorruptCheckpoint."""
    decode_problem(stored(header_record(**fields)))


@pytest.mark.parametrize(
    "fields",
    [
        {"owner": owner(pid=2**22 - 1, lease=60, skew=None, boot="b-1", pidns=4026531836)},
        {"owner": owner(started=None, skew=-0.25)},
        {"intent": intent(policy="reconcile", resolution="fired")},
        {"status": "deleted", "next_step": 2},
        {"status": "completed", "next_step": 2},
    ],
    ids=repr,
)
def test_plausible_header_values_decode(fields: dict[str, Any]) -> None:
    """The optional owner/intent fields, and a "deleted" tombstone, are accepted."""
    header, _ = ckpt.decode(stored(header_record(**fields), b""), where="t")
    assert header.status == fields.get("status", "running")


def test_an_owner_pid_of_2_to_the_40_does_not_reach_the_lease_check() -> None:
    """A run whose owner pid overflows os.kill is CorruptCheckpoint on resume, and workers go on."""
    store = ds.MemoryStore()
    wf = ds.Workflow("bigpid", store=store)
    wf.step(name="a")(lambda s: s.update(a=1))
    wf.submit("bad", {})
    wf.submit("good", {})
    key = ckpt.checkpoint_key("bigpid", "bad")
    found = store.get(key)
    assert found is not None
    line, _, payload = found[0].partition(b"\n")
    record = {**json.loads(line), "owner": owner(host=socket.gethostname(), pid=2**40)}
    store.put(key, json.dumps(record).encode() + b"\n" + payload, match=found[1])
    with pytest.raises(ds.CorruptCheckpoint, match=r"owner\.pid"):
        wf.run("bad")
    assert ds.Worker(wf).run(until_idle=True).completed == ["good"]
