"""The test servers for journaled calls, driven by the real ``stripe`` and ``openai`` SDKs.

``stripe_mock`` (npm ``stripe-stateful-mock``) must deduplicate charges and
refunds by idempotency key, reject a key reused for other parameters, keep
connected accounts apart, and let a test count what reached it.
``openai_fake`` (``examples/fake_openai.py``) must answer chat completions with
tool calls the SDK parses, deterministically in the messages, and count them.
The crash tests of journaled calls rely on exactly these properties.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import stripe

from tests.openaiserver import FAKE_OPENAI, OPENAI_TEST_KEY, OpenAIFake, start_openai_fake
from tests.stripeserver import (
    STRIPE_TEST_KEY,
    count_charges,
    count_refunds,
    list_objects,
    new_account,
    start_stripe_mock,
    stripe_env,
)

MODEL = "gpt-4o-mini"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "reason": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
    for name, description in (
        ("lookup_order", "Look an order up by its number."),
        ("refund", "Refund an order's charge."),
    )
]


def stripe_client(base_url: str, account: str) -> stripe.StripeClient:
    """A StripeClient on the mock, for one connected account, with SDK retries off."""
    return stripe.StripeClient(
        STRIPE_TEST_KEY,
        stripe_account=account,
        base_addresses={"api": base_url},
        max_network_retries=0,
    )


def charge(client: stripe.StripeClient, key: str, amount: int = 500) -> stripe.Charge:
    return client.v1.charges.create(
        params={"amount": amount, "currency": "usd", "source": "tok_visa"},
        options={"idempotency_key": key},
    )


def replayed(obj: stripe.StripeObject) -> bool:
    """Whether the mock answered ``obj`` from its idempotency cache."""
    response = obj.last_response
    assert response is not None
    return response.headers.get("idempotent-replayed") == "true"


def openai_client(server: OpenAIFake) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=OPENAI_TEST_KEY, max_retries=0)


# --- stripe-stateful-mock ------------------------------------------------------------


def test_same_idempotency_key_gives_the_same_charge(stripe_mock: str, stripe_account: str) -> None:
    """Two creates with one key make one charge; another key makes a second one."""
    client = stripe_client(stripe_mock, stripe_account)
    first = charge(client, "order-17-charge")
    again = charge(client, "order-17-charge")
    other = charge(client, "order-18-charge")
    assert first.id == again.id
    assert first.id.startswith("ch_")
    assert not replayed(first)
    assert replayed(again)
    assert other.id != first.id
    assert again.amount == 500
    assert again.status == "succeeded"
    assert count_charges(stripe_mock, stripe_account) == 2
    assert sorted(c["id"] for c in list_objects(stripe_mock, "charges", stripe_account)) == sorted(
        [first.id, other.id]
    )


def test_module_api_takes_the_key_as_a_keyword(
    stripe_mock: str, stripe_account: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stripe.Charge.create(..., idempotency_key=k)``, as ctx.effect calls it, deduplicates."""
    monkeypatch.setattr(stripe, "api_key", STRIPE_TEST_KEY)
    monkeypatch.setattr(stripe, "api_base", stripe_mock)
    monkeypatch.setattr(stripe, "max_network_retries", 0)
    made = [
        stripe.Charge.create(
            amount=1200,
            currency="usd",
            source="tok_visa",
            stripe_account=stripe_account,
            idempotency_key="ds-0123456789abcdef",
        )
        for _ in range(3)
    ]
    assert len({c.id for c in made}) == 1
    assert count_charges(stripe_mock, stripe_account) == 1


def test_key_reused_for_other_parameters_is_rejected(stripe_mock: str, stripe_account: str) -> None:
    """A key sent again with a different amount is an IdempotencyError, and charges nothing."""
    client = stripe_client(stripe_mock, stripe_account)
    charge(client, "turn-3-refund", amount=500)
    with pytest.raises(stripe.IdempotencyError, match="same parameters"):
        charge(client, "turn-3-refund", amount=700)
    assert count_charges(stripe_mock, stripe_account) == 1


def test_refunds_deduplicate_and_are_counted(stripe_mock: str, stripe_account: str) -> None:
    """A refund created twice with one key is one refund of the full charge."""
    client = stripe_client(stripe_mock, stripe_account)
    paid = charge(client, "order-21-charge", amount=2500)
    refunds = [
        client.v1.refunds.create(params={"charge": paid.id}, options={"idempotency_key": "r-21"})
        for _ in range(2)
    ]
    assert refunds[0].id == refunds[1].id
    assert refunds[0].amount == 2500
    assert count_refunds(stripe_mock, stripe_account) == 1
    assert client.v1.charges.retrieve(paid.id).refunded is True


def test_what_the_mock_does_not_do(stripe_mock: str, stripe_account: str) -> None:
    """Live keys are refused (401) and PaymentIntents are a 404: the crash tests use Charges."""
    live = stripe.StripeClient(
        "sk_live_nope", base_addresses={"api": stripe_mock}, max_network_retries=0
    )
    with pytest.raises(stripe.AuthenticationError):
        live.v1.charges.list()
    with pytest.raises(stripe.InvalidRequestError, match="No matching path"):
        stripe_client(stripe_mock, stripe_account).v1.payment_intents.create(
            params={"amount": 500, "currency": "usd"}
        )
    assert count_charges(stripe_mock, stripe_account) == 0


def test_accounts_keep_charges_and_keys_apart(stripe_mock: str) -> None:
    """The same key on two connected accounts makes two charges, each counted on its own."""
    first, second = new_account(stripe_mock), new_account(stripe_mock)
    one = charge(stripe_client(stripe_mock, first), "shared-key")
    two = charge(stripe_client(stripe_mock, second), "shared-key")
    assert one.id != two.id
    assert count_charges(stripe_mock, first) == 1
    assert count_charges(stripe_mock, second) == 1
    assert new_account(stripe_mock) not in (first, second)


def test_count_charges_reads_every_page(stripe_mock: str, stripe_account: str) -> None:
    """Listing pages through the mock with starting_after and misses no charge."""
    client = stripe_client(stripe_mock, stripe_account)
    ids = {charge(client, f"page-{i}").id for i in range(5)}
    listed = list_objects(stripe_mock, "charges", stripe_account, page_size=2)
    assert len(listed) == 5
    assert {c["id"] for c in listed} == ids


def test_stripe_env_names_the_mock(stripe_mock: str, stripe_account: str) -> None:
    """stripe_env() is enough for a child process's module-level SDK to charge the mock."""
    env = stripe_env(stripe_mock, stripe_account)
    script = (
        "import os, stripe\n"
        "stripe.api_key = os.environ['STRIPE_API_KEY']\n"
        "stripe.api_base = os.environ['STRIPE_API_BASE']\n"
        "c = stripe.Charge.create(amount=900, currency='usd', source='tok_visa',\n"
        "    stripe_account=os.environ['STRIPE_ACCOUNT'], idempotency_key='child-1')\n"
        "print(c.id)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip().startswith("ch_")
    assert count_charges(stripe_mock, stripe_account) == 1


def test_stripe_mock_listens_on_loopback_and_stops(tmp_path: Path) -> None:
    """A mock of its own answers on 127.0.0.1 and its port is closed once stopped."""
    server = start_stripe_mock(tmp_path)
    try:
        assert server.base_url.startswith("http://127.0.0.1:")
        assert count_charges(server.base_url) == 0  # a new server starts empty
    finally:
        server.stop()
    assert server.process.poll() is not None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{server.base_url}/v1/charges", timeout=5)


# --- the fake OpenAI server ----------------------------------------------------------


def test_openai_sdk_reads_tool_calls_then_a_text_answer(openai_fake: OpenAIFake) -> None:
    """First turn: lookup_order and refund as tool calls; with their results: a text answer."""
    client = openai_client(openai_fake)
    messages: list[Any] = [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "Please refund order #1001, it arrived broken."},
    ]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None
    assert [c.function.name for c in calls] == ["lookup_order", "refund"]  # type: ignore[union-attr]
    arguments = [json.loads(c.function.arguments) for c in calls]  # type: ignore[union-attr]
    assert arguments == [
        {"order_id": "1001"},
        {"order_id": "1001", "reason": "requested by the customer"},
    ]
    assert len({c.id for c in calls}) == 2

    messages.append(choice.message.model_dump(exclude_none=True))
    for call, result in zip(calls, ["order 1001: 25.00 USD, paid", "refunded re_1"], strict=True):
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    answer = second.choices[0]
    assert answer.finish_reason == "stop"
    assert answer.message.tool_calls is None
    assert answer.message.content is not None
    assert "refunded re_1" in answer.message.content
    assert openai_fake.calls() == 2


def test_same_messages_get_the_same_completion_and_each_is_counted(
    openai_fake: OpenAIFake,
) -> None:
    """A repeated request is answered identically (ids too) and counted again."""
    client = openai_client(openai_fake)
    messages: list[Any] = [{"role": "user", "content": "Refund order A-7 and order A-8 please"}]
    answers = [
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).model_dump()
        for _ in range(2)
    ]
    assert answers[0] == answers[1]
    calls = answers[0]["choices"][0]["message"]["tool_calls"]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])["order_id"]) for c in calls
    ] == [
        ("lookup_order", "A-7"),
        ("refund", "A-7"),
        ("lookup_order", "A-8"),
        ("refund", "A-8"),
    ]
    other = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Refund order A-9"}], tools=TOOLS
    )
    assert other.id != answers[0]["id"]
    assert openai_fake.calls() == 3


def test_openai_sdk_responses_api_tool_calls_then_a_text_answer(openai_fake: OpenAIFake) -> None:
    """The Responses API (the Agents SDK's default): function calls as output items, then,
    with their outputs in the input, a text message; an unanswered call is a 400.
    """
    client = openai_client(openai_fake)
    tools: list[Any] = [
        {
            "type": "function",
            "name": t["function"]["name"],
            "parameters": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    items: list[Any] = [{"role": "user", "content": "Please refund order #1001."}]
    first = client.responses.create(model=MODEL, input=items, tools=tools)
    calls = [o for o in first.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["lookup_order", "refund"]
    assert first.usage is not None
    assert first.usage.total_tokens > 0
    items += [c.model_dump(exclude_none=True) for c in calls]
    with pytest.raises(openai.BadRequestError, match="tool_call_ids"):
        client.responses.create(model=MODEL, input=items, tools=tools)
    items += [
        {"type": "function_call_output", "call_id": c.call_id, "output": f"done {c.name}"}
        for c in calls
    ]
    second = client.responses.create(model=MODEL, input=items, tools=tools)
    assert "done refund" in second.output_text
    assert openai_fake.counts() == {"chat_completions": 0, "responses": 2, "rejected": 1}


def test_without_an_order_or_tools_it_asks_in_text(openai_fake: OpenAIFake) -> None:
    """No order number, or no tools offered: the model answers with a question, no tool call."""
    client = openai_client(openai_fake)
    vague = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "My parcel is late"}], tools=TOOLS
    )
    no_tools = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Refund order #5"}]
    )
    for reply in (vague, no_tools):
        assert reply.choices[0].message.tool_calls is None
        assert "order number" in (reply.choices[0].message.content or "")


def test_bad_requests_are_rejected_like_the_real_api(openai_fake: OpenAIFake) -> None:
    """An empty message list is a 400 BadRequestError and is not counted as a completion."""
    client = openai_client(openai_fake)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    assert openai_fake.counts() == {"chat_completions": 0, "responses": 0, "rejected": 1}


def test_env_alone_points_the_sdk_at_the_fake(
    openai_fake: OpenAIFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OPENAI_BASE_URL and OPENAI_API_KEY from env() configure ``openai.OpenAI()``."""
    for name, value in openai_fake.env().items():
        monkeypatch.setenv(name, value)
    reply = openai.OpenAI(max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}]
    )
    assert reply.choices[0].message.content
    assert openai_fake.calls() == 1


def test_concurrent_async_requests_are_each_answered(openai_fake: OpenAIFake) -> None:
    """50 AsyncOpenAI requests at once (asyncio.gather) get 50 right answers and 50 counts."""

    async def ask_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=openai_fake.base_url, api_key=OPENAI_TEST_KEY, max_retries=0
        ) as client:
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"refund order #{i}"}],
                        tools=TOOLS,
                    )
                    for i in range(50)
                )
            )
        return [
            json.loads(r.choices[0].message.tool_calls[0].function.arguments)["order_id"]  # type: ignore[index,union-attr]
            for r in replies
        ]

    assert asyncio.run(ask_all()) == [str(i) for i in range(50)]
    assert openai_fake.calls() == 50


def test_fake_openai_runs_as_a_script(tmp_path: Path) -> None:
    """``python examples/fake_openai.py`` serves until stopped; stop() closes its port."""
    server = start_openai_fake(tmp_path)
    try:
        assert server.base_url.startswith("http://127.0.0.1:")
        assert server.counts() == {"chat_completions": 0, "responses": 0, "rejected": 0}
    finally:
        server.stop()
    assert server.process.poll() is not None
    assert "listening on " + server.base_url in server.log_tail()
    assert FAKE_OPENAI.name in str(server.process.args)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{server.base_url.removesuffix('/v1')}/calls", timeout=5)


def test_unanswered_or_stray_tool_messages_are_rejected(openai_fake: OpenAIFake) -> None:
    """A transcript missing, doubling or inventing a tool result is a 400, as on OpenAI."""
    client = openai_client(openai_fake)
    user: Any = {"role": "user", "content": "Refund order #42"}
    first = client.chat.completions.create(model=MODEL, messages=[user], tools=TOOLS)
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    lookup, refund = (c["id"] for c in assistant["tool_calls"])

    def tool(call_id: str) -> Any:
        return {"role": "tool", "tool_call_id": call_id, "content": "done"}

    for broken in (
        [user, assistant, tool(lookup)],  # the refund's result was lost
        [user, assistant, tool(lookup), tool(lookup), tool(refund)],  # one result twice
        [user, tool("call_made_up")],  # a result for a call nobody made
    ):
        with pytest.raises(openai.BadRequestError, match="tool"):
            client.chat.completions.create(model=MODEL, messages=broken, tools=TOOLS)
    whole = [user, assistant, tool(lookup), tool(refund)]
    answer = client.chat.completions.create(model=MODEL, messages=whole, tools=TOOLS)
    assert answer.choices[0].finish_reason == "stop"
    assert openai_fake.counts() == {"chat_completions": 2, "responses": 0, "rejected": 3}
