"""durable_steps.integrations.openai_agents: OpenAI Agents SDK agents run inside a step.

The real SDK (``openai-agents``) and the real ``openai`` client talk over
loopback to the scripted OpenAI server (``examples/fake_openai.py``, its
Responses API), whose counts tell a replayed model response from a repeated
one. Crashes are real: ``tests/oachild.py`` SIGKILLs itself on cue and is run
again; in-process tests replay through a durable wait (an approval), which
re-runs the step from its start as a resume does.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib.metadata
import json
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agents", reason="the openai-agents extra is not installed")

from agents import (
    Agent,
    GuardrailFunctionOutput,
    InputGuardrailTripwireTriggered,
    MaxTurnsExceeded,
    RunContextWrapper,
    SQLiteSession,
    function_tool,
    input_guardrail,
    set_tracing_disabled,
)
from pydantic import BaseModel

import durable_steps as ds
from durable_steps.integrations.openai_agents import (
    DurableRunner,
    idempotency_key,
)
from tests import oachild
from tests.forkserver import ForkServer
from tests.openaiserver import OpenAIFake, start_openai_fake

pytestmark = pytest.mark.openai_agents

CHILD = Path(__file__).with_name("oachild.py")
ROOT = CHILD.parent.parent
KILLED = -signal.SIGKILL
TWO_ORDERS = "Orders #1001 and #1002 both arrived broken. Please refund them."

set_tracing_disabled(True)  # no trace export to OpenAI from a test


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIFake]:
    """One scripted server for the module; tests count what they add to its counts."""
    server = start_openai_fake(tmp_path_factory.mktemp("fake-openai"))
    yield server
    server.stop()


_clients: list[Any] = []
"""The OpenAI clients a test made in this process, closed after it."""


@pytest.fixture(autouse=True)
def close_the_loop_run_sync_keeps() -> Iterator[None]:
    """run_sync keeps one event loop per thread, as the SDK's does: close the test's
    clients on it, then the loop, as an exit would.
    """
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            loop = asyncio.get_event_loop()
        except RuntimeError:
            loop = None
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
    while _clients:
        loop.run_until_complete(_clients.pop().close())
    if not loop.is_running():
        loop.close()
    asyncio.set_event_loop(None)


_forks = ForkServer(CHILD)


def child(tmp: Path, fake: OpenAIFake, *args: str, name: str = "child") -> Any:
    """``python tests/oachild.py`` on run r1 in ``tmp``, as a fresh fork of the server."""
    argv = ["--store", str(tmp / "store"), "--run", "r1", "--log", str(tmp / "log")]
    argv += ["--base-url", fake.base_url, *args]
    return _forks.run(argv, cwd=tmp, out=tmp / name)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


_reference: dict[str, tuple[dict[str, Any], int]] = {}


def reference(tmp_path_factory: pytest.TempPathFactory, fake: OpenAIFake, mode: str) -> Any:
    """An uncrashed run's summary and how many responses it cost (one per mode)."""
    if mode not in _reference:
        before = fake.calls()
        done = child(tmp_path_factory.mktemp(f"reference-{mode}"), fake, "--mode", mode)
        assert done.returncode == 0, done.stderr
        _reference[mode] = (json.loads(done.stdout), fake.calls() - before)
    return _reference[mode]


def test_plain_and_durable_runs_give_the_same_output_and_usage(
    tmp_path_factory: pytest.TempPathFactory, fake: OpenAIFake
) -> None:
    """Runner.run and DurableRunner (sync and async) answer alike, with the same usage,
    items and last agent, for the same number of model responses.
    """
    plain, plain_calls = reference(tmp_path_factory, fake, "plain")
    assert plain_calls == 3  # triage's handoff, billing's tool calls, billing's answer
    assert "refunded order 1001" in plain["output"]
    assert plain["last_agent"] == "billing"
    for mode in ("sync", "async"):
        assert reference(tmp_path_factory, fake, mode) == (plain, plain_calls)


CRASHES = {
    "after-a-recorded-response": "recorded:model:1",
    "inside-an-effect-tool": "tool:refund",
    "in-the-handoff": "handoff",
    "after-the-handoff": "recorded:model:2",
}
SAMPLE = {
    ("sync", "after-a-recorded-response"),
    ("async", "inside-an-effect-tool"),
    ("sync", "in-the-handoff"),
}


@pytest.mark.parametrize(
    ("mode", "crash"),
    [
        pytest.param(
            mode,
            cue,
            id=f"{mode}-{name}",
            marks=() if (mode, name) in SAMPLE else pytest.mark.matrix,
        )
        for mode in ("sync", "async")
        for name, cue in CRASHES.items()
    ],
)
def test_a_killed_agent_run_repeats_no_response_and_fires_the_effect_under_one_key(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    fake: OpenAIFake,
    mode: str,
    crash: str,
) -> None:
    """SIGKILL after a recorded response, inside the refund, at or after the handoff:
    the resumed run asks for no recorded response again, re-fires an effect in doubt
    once with its first key, and ends as an uncrashed run does.
    """
    expected, responses = reference(tmp_path_factory, fake, mode)
    before = fake.calls()
    crashed = child(tmp_path, fake, "--mode", mode, "--crash", crash, name="crashed")
    assert crashed.returncode == KILLED, crashed.stderr
    resumed = child(tmp_path, fake, "--mode", mode, name="resumed")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout) == expected
    assert fake.calls() - before == responses  # every response paid for once
    ledger = lines(tmp_path / "log" / "ledger")
    assert len({line.split(":", 1)[1] for line in ledger}) == 1, ledger  # one key
    assert len(ledger) == (2 if crash == "tool:refund" else 1), ledger
    # the handoff's callback is journaled too: it runs again only if killed inside it
    assert lines(tmp_path / "log" / "handoffs") == ["billing"] * (2 if crash == "handoff" else 1)


def test_an_effect_in_doubt_resolved_by_hand_gives_the_model_that_result(
    tmp_path: Path, fake: OpenAIFake
) -> None:
    """Killed inside the refund, then `resolve --fired --result`: show names the tool and
    its arguments, the rerun does not refund again, and the model reads the given result.
    """
    crashed = child(tmp_path, fake, "--crash", "tool:refund", name="crashed")
    assert crashed.returncode == KILLED, crashed.stderr
    cli = [sys.executable, "-m", "durable_steps", "--store", str(tmp_path / "store")]
    title = "refund(order_id='1001', reason='requested by the customer')"

    def durable_steps(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, *args], capture_output=True, text=True, cwd=ROOT, check=False, timeout=60
        )

    show = durable_steps("show", "support/r1")
    assert f"effect {title}  in doubt" in show.stdout, show.stdout
    resolved = durable_steps("resolve", "support/r1", "--fired", "--result", '"refunded by hand"')
    assert resolved.returncode == 0, resolved.stderr
    done = child(tmp_path, fake, name="done")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output"].endswith("- refunded by hand")
    assert len(lines(tmp_path / "log" / "ledger")) == 1


def test_an_approval_waits_survives_a_kill_and_completes_on_a_signal(
    tmp_path: Path, fake: OpenAIFake
) -> None:
    """A refund that needs approval suspends the run; killed while it waits and run
    again it still waits (no new model call); approved from the CLI it finishes,
    refunding once, without asking the model again for the tool call.
    """
    before = fake.calls()
    killed = child(tmp_path, fake, "--approval", "--crash", "waiting", name="killed")
    assert killed.returncode == KILLED, killed.stderr
    assert fake.calls() - before == 2  # the handoff and the tool calls
    waiting = child(tmp_path, fake, "--approval", name="waiting")
    assert waiting.returncode == 3, waiting.stderr
    signal_name = json.loads(waiting.stdout)["suspended"]
    assert signal_name.startswith("approve:call")
    assert fake.calls() - before == 2  # replayed
    assert lines(tmp_path / "log" / "ledger") == []
    cli = [sys.executable, "-m", "durable_steps", "--store", str(tmp_path / "store")]
    sent = subprocess.run(
        [*cli, "signal", "support/r1", signal_name, "--data", "true"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=60,
    )
    assert sent.returncode == 0, sent.stderr
    done = child(tmp_path, fake, "--approval", name="done")
    assert done.returncode == 0, done.stderr
    assert "refunded order 1001" in json.loads(done.stdout)["output"]
    assert fake.calls() - before == 3  # only the answer after the approved refund
    assert len(lines(tmp_path / "log" / "ledger")) == 1


# --- in process ------------------------------------------------------------------


def agents_for(fake: OpenAIFake, log: Path, *, approval: bool = False) -> tuple[Any, Any]:
    """tests/oachild.py's triage agent and run config, logging to ``log``."""
    args = argparse.Namespace(log=log, crash=None, approval=approval, mode="async")
    args.base_url = fake.base_url
    log.mkdir(parents=True, exist_ok=True)
    triage, config, _, client = oachild.build(args)
    _clients.append(client)
    return triage, config


def workflow(tmp_path: Path, body: Any, **kwargs: Any) -> ds.Workflow:
    return ds.Workflow(
        "agents", steps=[ds.step(body, name="turn")], store=str(tmp_path / "store"), **kwargs
    )


def test_parallel_tool_calls_in_an_async_step_are_each_recorded(
    tmp_path: Path, fake: OpenAIFake
) -> None:
    """Four tool calls in one response (two orders) run concurrently, each recorded;
    each refund fires once under its own key, and the titles name tool and arguments.
    """
    triage, config = agents_for(fake, tmp_path / "log")
    runner = DurableRunner(effects={"refund"})
    titles: list[str] = []

    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        result = await runner.run(triage, TWO_ORDERS, ctx=ctx, run_config=config)
        state["output"] = result.final_output
        state["outputs"] = sum(type(i).__name__ == "ToolCallOutputItem" for i in result.new_items)
        ctx.finish()

    def on_event(event: ds.Event) -> None:
        if event.kind == "call_recorded" and event.title:
            titles.append(event.title)

    async def main() -> dict[str, Any]:
        try:
            return await workflow(tmp_path, turn, on_event=[on_event]).arun("r1", {})
        finally:  # its connections belong to this loop
            await _clients.pop().close()

    before = fake.calls()
    final = asyncio.run(main())
    assert final["outputs"] == 4
    assert "refunded order 1001" in final["output"]
    assert "refunded order 1002" in final["output"]
    assert fake.calls() - before == 3
    ledger = lines(tmp_path / "log" / "ledger")
    assert sorted(line.split(":")[0] for line in ledger) == ["1001", "1002"]
    assert len({line.split(":")[1] for line in ledger}) == 2
    assert "refund(order_id='1002', reason='requested by the customer')" in titles
    assert "gpt-fake: response 1" in titles


def approve_and_finish(wf: ds.Workflow, payload: Any) -> dict[str, Any]:
    """Run r1 to its approval wait, send ``payload`` as the decision, run it again."""
    with pytest.raises(ds.RunSuspended) as waiting:
        wf.run("r1", {})
    assert waiting.value.signal is not None
    assert wf.signal("r1", waiting.value.signal, payload)
    result: dict[str, Any] = wf.run("r1", {})
    return result


def test_a_rejected_approval_tells_the_model_and_fires_nothing(
    tmp_path: Path, fake: OpenAIFake
) -> None:
    """A rejection (a signal with approved false) reaches the model as the rejection
    message; the refund never runs.
    """
    triage, config = agents_for(fake, tmp_path / "log", approval=True)
    runner = DurableRunner(effects={"refund"})

    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["output"] = runner.run_sync(triage, oachild.MESSAGE, ctx=ctx, run_config=config)
        state["output"] = state["output"].final_output
        ctx.finish()

    final = approve_and_finish(
        workflow(tmp_path, turn), {"approved": False, "message": "refunds need a manager"}
    )
    assert "refunds need a manager" in final["output"]
    assert lines(tmp_path / "log" / "ledger") == []


def test_the_documented_payload_approves_and_another_shape_is_refused_when_sent(
    tmp_path: Path, fake: OpenAIFake
) -> None:
    """{"approved": true} approves the refund; {"approve": true} (what earlier versions
    took) and "approve" are refused by wf.signal, nothing is sent, the run still waits
    and the refund has not run; bare false rejects with the SDK's own message.
    """
    triage, config = agents_for(fake, tmp_path / "log", approval=True)
    runner = DurableRunner(effects={"refund"})

    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["output"] = runner.run_sync(triage, oachild.MESSAGE, ctx=ctx, run_config=config)
        state["output"] = state["output"].final_output
        ctx.finish()

    wf = workflow(tmp_path, turn)
    with pytest.raises(ds.RunSuspended) as waiting:
        wf.run("r1", {})
    name = waiting.value.signal
    assert name is not None
    assert '{"approved": true}' in waiting.value.message
    for wrong in ({"approve": True}, "approve"):
        with pytest.raises(ds.SignalRefused) as refused:
            wf.signal("r1", name, wrong)
        assert f"run agents/r1 waits at step 'turn' for signal {name!r}" in refused.value.message
        assert '{"approved": false, "message": "why"}' in refused.value.message
    with pytest.raises(ds.RunSuspended):
        wf.run("r1", {})
    assert lines(tmp_path / "log" / "ledger") == []
    assert wf.signal("r1", name, {"approved": True})
    assert "refunded order 1001" in wf.run("r1", {})["output"]
    assert len(lines(tmp_path / "log" / "ledger")) == 1

    rejected = workflow(tmp_path / "no", turn)
    final = approve_and_finish(rejected, False)
    assert "refunded order 1001" not in final["output"]
    assert len(lines(tmp_path / "log" / "ledger")) == 1  # still only the approved one


def test_live_tools_run_on_every_replay_and_the_others_once(
    tmp_path: Path, fake: OpenAIFake
) -> None:
    """A tool in live= runs again each time the step replays (here: woken by the
    approval); a journaled tool and a guardrail run once; the session keeps each
    item once.
    """
    results = {}
    for live in ((), ("lookup_order",)):
        log = tmp_path / f"log-{len(live)}"
        triage, config = agents_for(fake, log, approval=True)
        checks: list[str] = []

        @input_guardrail
        def polite(ctx: RunContextWrapper[Any], agent: Agent[Any], data: Any) -> Any:
            checks.append("checked")
            return GuardrailFunctionOutput(output_info={"ok": True}, tripwire_triggered=False)

        guarded = triage.clone(input_guardrails=[polite])
        session = SQLiteSession("ticket", str(log / "session.db"))
        runner = DurableRunner(effects={"refund"}, live=live)

        def turn(state: dict[str, Any], ctx: ds.Context, runner: Any = runner) -> None:
            result = runner.run_sync(
                guarded, oachild.MESSAGE, ctx=ctx, run_config=config, session=session
            )
            state["output"] = result.final_output
            ctx.finish()

        wf = workflow(tmp_path / f"store-{len(live)}", turn)
        final = approve_and_finish(wf, True)
        assert "refunded order 1001" in final["output"]
        assert checks == ["checked"]
        # on run_sync's loop: asyncio.run would drop it (unclosed) as the thread's loop
        items = asyncio.get_event_loop().run_until_complete(session.get_items())
        results[live] = (len(lines(log / "lookup")), len(items))
        # each item once, though the step ran twice (before and after the approval)
        users = [i for i in items if i.get("role") == "user"]
        calls = [(i["type"], i["call_id"]) for i in items if "call_id" in i]
        assert len(users) == 1, items
        assert len(calls) == len(set(calls)) > 0, items
        session.close()
    assert results[()][0] == 1
    assert results[("lookup_order",)][0] == 2  # the first run, then the replay after approval
    assert results[()][1] == results[("lookup_order",)][1] > 0


class Answer(BaseModel):
    text: str
    tools: int


def test_structured_output_and_a_tripped_guardrail(tmp_path: Path, fake: OpenAIFake) -> None:
    """An output_type comes back typed (and last_agent is the user's agent); a
    guardrail's tripwire raises out of the step.
    """
    triage, config = agents_for(fake, tmp_path / "log")
    billing = triage.handoffs[0].agent_name
    assert billing == "billing"

    @function_tool
    def lookup_order(order_id: str) -> str:
        return f"order {order_id} is late"

    agent = Agent(name="typed", model="gpt-fake", tools=[lookup_order], output_type=Answer)
    runner = DurableRunner()

    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        result = runner.run_sync(agent, "where is order #7?", ctx=ctx, run_config=config)
        assert isinstance(result.final_output, Answer)
        assert result.last_agent is agent  # the user's agent, not the runner's copy
        state["answer"] = result.final_output.model_dump()
        ctx.finish()

    final = workflow(tmp_path, turn).run("r1", {})
    assert final["answer"]["tools"] == 1
    assert "order 7 is late" in final["answer"]["text"]

    @input_guardrail
    def no_refunds(ctx: RunContextWrapper[Any], agent: Agent[Any], data: Any) -> Any:
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered="refund" in str(data))

    tripped = agent.clone(input_guardrails=[no_refunds])

    def guarded(state: dict[str, Any], ctx: ds.Context) -> None:
        runner.run_sync(tripped, "refund order #7", ctx=ctx, run_config=config)

    with pytest.raises(ds.StepFailed) as failed:
        workflow(tmp_path / "guarded", guarded).run("r1", {})
    assert isinstance(failed.value.__cause__, InputGuardrailTripwireTriggered)


def test_a_model_failure_retries_the_step_replaying_the_finished_responses(
    tmp_path: Path, fake: OpenAIFake
) -> None:
    """The second model response fails once (a timeout): the step's retry runs it again,
    the first response replays, and no response is paid for twice.
    """
    triage, config = agents_for(fake, tmp_path / "log")
    billing = triage.handoffs[0]._agent_ref()
    real = billing.model
    failed: list[int] = []

    class Flaky(type(real)):  # type: ignore[misc]
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            if not failed:
                failed.append(1)
                raise TimeoutError("the model timed out")
            return await real.get_response(*args, **kwargs)

    flaky = Flaky.__new__(Flaky)
    flaky.__dict__.update(real.__dict__)
    billing.model = flaky  # the agents are this test's own
    runner = DurableRunner(effects={"refund"})

    @ds.step(name="turn", retry=ds.Retry(attempts=2, wait=0, on=TimeoutError))
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        result = runner.run_sync(triage, oachild.MESSAGE, ctx=ctx, run_config=config)
        state["output"] = result.final_output
        state["attempt"] = ctx.attempt
        ctx.finish()

    before = fake.calls()
    wf = ds.Workflow("agents", steps=[turn], store=str(tmp_path / "store"))
    final = wf.run("r1", {})
    assert final["attempt"] == 2
    assert "refunded order 1001" in final["output"]
    assert fake.calls() - before == 3  # the handoff's response replayed in the retry
    assert len(lines(tmp_path / "log" / "handoffs")) == 1


def test_max_turns_is_kept(tmp_path: Path, fake: OpenAIFake) -> None:
    """max_turns= reaches the SDK: a run that needs more turns fails the step."""
    triage, config = agents_for(fake, tmp_path / "log")
    runner = DurableRunner(effects={"refund"})

    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        runner.run_sync(triage, oachild.MESSAGE, ctx=ctx, run_config=config, max_turns=2)

    with pytest.raises(ds.StepFailed) as failed:
        workflow(tmp_path, turn).run("r1", {})
    assert isinstance(failed.value.__cause__, MaxTurnsExceeded)


def test_mistakes_get_clear_errors(tmp_path: Path, fake: OpenAIFake) -> None:
    """One string for effects, a tool both effect and live, a misspelt effect, a
    key asked for outside an effect, and run_streamed are each refused, saying what to do.
    """
    with pytest.raises(ds.DefinitionError, match=r"effects=\{'refund'\}"):
        DurableRunner(effects="refund")
    with pytest.raises(ds.DefinitionError, match="both effects= and live="):
        DurableRunner(effects={"refund"}, live={"refund"})
    with pytest.raises(ds.DefinitionError, match="idempotency_key"):
        idempotency_key(RunContextWrapper(context=None))
    with pytest.raises(ds.DefinitionError, match=r"await runner\.run"):
        DurableRunner().run_streamed(Agent(name="a"), "hi")
    triage, config = agents_for(fake, tmp_path / "log")
    runner = DurableRunner(effects={"refnud"})

    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        runner.run_sync(triage, oachild.MESSAGE, ctx=ctx, run_config=config)

    with pytest.raises(ds.StepFailed) as failed:
        workflow(tmp_path, turn).run("r1", {})
    assert isinstance(failed.value.__cause__, ds.DefinitionError)
    assert "'refnud'" in str(failed.value.__cause__)
    assert "lookup_order" in str(failed.value.__cause__)


def test_import_durable_steps_does_not_import_the_sdk() -> None:
    """The integration is an optional extra: ``import durable_steps`` leaves it unloaded."""
    code = (
        "import sys, durable_steps; print([m for m in sys.modules if m.split('.')[0] == 'agents'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def _remove(internal: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the installed SDK lack ``internal``, as a later release might."""
    import agents
    import agents.usage

    owner, _, name = internal.rpartition(".")
    if owner == "RunResult":
        monkeypatch.delitem(agents.RunResult.__dataclass_fields__, name)
    elif owner == "agents.usage":
        monkeypatch.delattr(agents.usage, name)
    else:
        monkeypatch.delattr(getattr(agents, owner), name)


@pytest.mark.parametrize(
    "internal",
    [
        "Handoff._agent_ref",
        "Model._cleanup_on_run_end",
        "RunResult._last_agent",
        "agents.usage.serialize_usage",
        "agents.usage.deserialize_usage",
    ],
)
def test_an_sdk_without_an_internal_we_read_is_refused_clearly(
    internal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe names the SDK's version, the internal it lacks and the supported pin."""
    from durable_steps.integrations.openai_agents import _sdk

    _sdk.require()  # the installed SDK has them all
    _remove(internal, monkeypatch)
    assert _sdk.missing() == [internal]
    with pytest.raises(ImportError) as refused:
        _sdk.require()
    message = str(refused.value)
    assert f"openai-agents {importlib.metadata.version('openai-agents')}:" in message
    assert f"({internal})" in message
    assert "pip install 'openai-agents>=0.24,<0.26'" in message


def test_the_probe_runs_when_the_integration_is_imported() -> None:
    """An SDK without Model._cleanup_on_run_end fails the import itself, with the probe's
    message: not an AttributeError mid-run, nor a run-end hook silently never forwarded."""
    code = (
        "import agents; del agents.Model._cleanup_on_run_end\n"
        "import durable_steps.integrations.openai_agents"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: durable_steps.integrations.openai_agents cannot run on")
    assert "(Model._cleanup_on_run_end)" in last


def test_the_sdk_is_read_through_public_names_but_the_listed_internals() -> None:
    """Every SDK import of the integration is ``from agents import`` (the public names)
    but agents.usage's, and every internal the import-time probe checks is explained in
    the docs page; the installed SDK has them all."""
    from durable_steps.integrations.openai_agents import _sdk

    package = ROOT / "durable_steps" / "integrations" / "openai_agents"
    deep = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("agents."):
                deep.add((node.module, tuple(sorted(a.name for a in node.names))))
            if isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.startswith("agents.")], path
    assert deep == {("agents.usage", ("deserialize_usage", "serialize_usage"))}
    assert _sdk.missing() == []
    page = (ROOT / "docs" / "integrations" / "openai-agents.md").read_text()
    for internal in _sdk.INTERNALS:
        assert f"`{internal.removeprefix('agents.usage.')}`" in page, internal
