"""Journaled calls on the real ``openai`` and ``stripe`` SDKs, in processes killed with SIGKILL.

``examples/support_agent.py`` talks to the fake OpenAI server (``openai_fake``)
and to stripe-stateful-mock (``stripe_mock``, a connected account of the test's
own: ``stripe_account``) over loopback; ``tests/chargechild.py`` makes three
charges as three effects of one step (issue 12's real-client test). Each is
killed right after Stripe answered a request, before the answer was recorded,
then run again: Stripe must hold each refund or charge once, and the model must
have been asked once per turn.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import stripe

import durable_steps as ds
from tests.conftest import StoreTarget
from tests.openaiserver import OpenAIFake
from tests.stripeserver import (
    STRIPE_TEST_KEY,
    count_charges,
    list_objects,
    new_account,
    stripe_env,
)

ROOT = Path(__file__).resolve().parent.parent
SUPPORT_AGENT = ROOT / "examples" / "support_agent.py"
CHARGE_CHILD = Path(__file__).with_name("chargechild.py")
KILLED = -signal.SIGKILL
REFUND = re.compile(r"refund (re_\w+) for order (\d+) \(key (ds-[0-9a-f]{40}), (new|replayed)")
CHARGE = re.compile(r"^charge (\d) (ch_\w+) key (ds-[0-9a-f]{40}) (new|replayed)$", re.MULTILINE)
STRIPE_ID = re.compile(r"\b(ch|re)_[A-Za-z0-9]+")


def clean_env(*extra: dict[str, str]) -> dict[str, str]:
    """``os.environ`` without the developer's OpenAI and Stripe settings, plus ``extra``.

    A real key in the shell must never reach a test (nor be charged by one).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "STRIPE_"))}
    for more in extra:
        env.update(more)
    return env


def run_script(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def final_answer(stdout: str) -> str:
    """What the agent said at the end (printed once, by the turn that answered in text)."""
    start = stdout.index("agent: ") + len("agent: ")
    return stdout[start : stdout.index("\ndone: ", start)]


def refunds_by_charge(stripe_mock: str, account: str) -> dict[str, tuple[str, int]]:
    """The mock's refunds of ``account``: charge id -> (refund id, amount)."""
    refunds = list_objects(stripe_mock, "refunds", account)
    return {r["charge"]: (r["id"], r["amount"]) for r in refunds}


@pytest.mark.slow
@pytest.mark.parametrize("crash_after", [1, 2], ids=["after-refund-1", "after-refund-2"])
def test_the_support_agent_killed_after_a_refund_refunds_each_order_once(
    tmp_path: Path,
    openai_fake: OpenAIFake,
    stripe_mock: str,
    stripe_account: str,
    crash_after: int,
) -> None:
    """SIGKILL right after a refund returned, rerun: one refund per order in Stripe, the
    refund cut short re-sent with its key (replayed by Stripe), the model asked once per
    turn, and the final answer equal to an uncrashed run's but for Stripe's ids.
    """
    env = clean_env(openai_fake.env(), stripe_env(stripe_mock, stripe_account))
    store = ["--store", str(tmp_path / "runs")]

    killed = run_script(SUPPORT_AGENT, env, *store, "--crash-after-refund", str(crash_after))
    assert killed.returncode == KILLED, killed.stdout + killed.stderr
    sent = REFUND.findall(killed.stdout)
    assert [(order, how) for _, order, _, how in sent] == [("1001", "new"), ("1002", "new")][
        :crash_after
    ]
    assert len(refunds_by_charge(stripe_mock, stripe_account)) == crash_after
    assert openai_fake.calls() == 1
    show = subprocess.run(
        [sys.executable, "-m", "durable_steps", *store, "show", "support-agent/ticket-1001"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "in-doubt" in show.stdout, show.stdout + show.stderr
    assert f"in doubt (it may have fired), idempotency key {sent[-1][2]}" in show.stdout

    resumed = run_script(SUPPORT_AGENT, env, *store)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "charged" not in resumed.stdout  # the checkout run had finished: nothing charged twice
    again = REFUND.findall(resumed.stdout)
    refund_id, order, key, _ = sent[-1]
    assert again[0] == (refund_id, order, key, "replayed")  # the same key, the same refund
    assert [(o, how) for _, o, _, how in again[1:]] == [("1002", "new")][: 2 - crash_after]
    assert openai_fake.calls() == 2  # turn 1 replayed its model call; turn 2 asked once

    charges = {
        c["metadata"]["order"]: c for c in list_objects(stripe_mock, "charges", stripe_account)
    }
    assert sorted(charges) == ["1001", "1002", "1003"]
    refunds = refunds_by_charge(stripe_mock, stripe_account)
    assert sorted(refunds) == sorted([charges["1001"]["id"], charges["1002"]["id"]])  # not 1003
    for order in ("1001", "1002"):
        assert refunds[charges[order]["id"]][1] == charges[order]["amount"]  # in full
    answer = final_answer(resumed.stdout)
    assert sorted(re.findall(r"re_\w+", answer)) == sorted(r for r, _ in refunds.values())

    baseline_account = new_account(stripe_mock)
    baseline_env = clean_env(openai_fake.env(), stripe_env(stripe_mock, baseline_account))
    uncrashed = run_script(SUPPORT_AGENT, baseline_env, "--store", str(tmp_path / "baseline"))
    assert uncrashed.returncode == 0, uncrashed.stdout + uncrashed.stderr
    assert STRIPE_ID.sub(r"\1_ID", final_answer(uncrashed.stdout)) == STRIPE_ID.sub(
        r"\1_ID", answer
    )
    assert openai_fake.calls() == 4

    third = run_script(SUPPORT_AGENT, env, *store)
    assert third.returncode == 0, third.stdout + third.stderr
    assert third.stdout.splitlines()[-1] == "done: 2 turns, 8 messages"
    assert "refund" not in third.stdout
    assert "charged" not in third.stdout
    assert openai_fake.calls() == 4
    assert refunds_by_charge(stripe_mock, stripe_account) == refunds


def test_the_support_agent_runs_offline_on_its_own_fake_model(
    tmp_path: Path, stripe_mock: str, stripe_account: str
) -> None:
    """Without OPENAI_* it starts fake_openai.py itself, and refunds the two orders asked about."""
    env = clean_env(stripe_env(stripe_mock, stripe_account))
    done = run_script(SUPPORT_AGENT, env, "--store", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "using the scripted model of fake_openai.py" in done.stdout
    assert [order for _, order, _, _ in REFUND.findall(done.stdout)] == ["1001", "1002"]
    assert len(refunds_by_charge(stripe_mock, stripe_account)) == 2
    assert count_charges(stripe_mock, stripe_account) == 3


def test_the_support_agent_says_what_to_set_without_a_test_mode_stripe(tmp_path: Path) -> None:
    """No Stripe configured: it names STRIPE_API_KEY and STRIPE_API_BASE; a live key is refused."""
    store = ["--store", str(tmp_path / "runs")]
    nothing = run_script(SUPPORT_AGENT, clean_env(), *store)
    assert nothing.returncode == 1
    assert "STRIPE_API_KEY=sk_test_" in nothing.stderr
    assert "STRIPE_API_BASE=http://127.0.0.1:12111" in nothing.stderr
    assert "npm ci --prefix tests/emulators" in nothing.stderr
    live = run_script(SUPPORT_AGENT, clean_env({"STRIPE_API_KEY": "sk_live_nope"}), *store)
    assert live.returncode == 1
    assert "must be a test-mode key" in live.stderr
    assert not (tmp_path / "runs").exists()  # refused before any run was created


def test_three_charges_in_one_step_killed_after_the_second_make_three_charges(
    durable_target: StoreTarget, stripe_mock: str, stripe_account: str
) -> None:
    """Issue 12 on the real stripe SDK: three effects, SIGKILL right after charge 2 returned,
    rerun: charge 1 replayed from the journal, charge 2 re-sent with its key (Stripe replays
    it), charge 3 made once; exactly three charges in Stripe, and a third run makes none.
    """
    env = {**durable_target.child_env(), **stripe_env(stripe_mock, stripe_account)}
    args = ["--store", durable_target.url, "--run", "order-77"]

    killed = run_script(CHARGE_CHILD, env, *args, "--crash-after-charge", "2")
    assert killed.returncode == KILLED, killed.stdout + killed.stderr
    first = CHARGE.findall(killed.stdout)
    assert [(n, how) for n, _, _, how in first] == [("1", "new"), ("2", "new")]
    assert count_charges(stripe_mock, stripe_account) == 2

    resumed = run_script(CHARGE_CHILD, env, *args)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    second = CHARGE.findall(resumed.stdout)
    assert second[0] == (*first[1][:3], "replayed")  # charge 2: same key, same charge
    assert [(n, how) for n, _, _, how in second[1:]] == [("3", "new")]
    assert second[1][2] not in (first[0][2], first[1][2])  # charge 3 has a key of its own
    assert count_charges(stripe_mock, stripe_account) == 3
    state = json.loads(resumed.stdout.splitlines()[-1])
    assert state == {"1": first[0][1], "2": first[1][1], "3": second[1][1]}
    in_stripe = list_objects(stripe_mock, "charges", stripe_account)
    assert sorted(c["id"] for c in in_stripe) == sorted(state.values())
    assert sorted(c["amount"] for c in in_stripe) == [1100, 2200, 3300]

    third = run_script(CHARGE_CHILD, env, *args)
    assert third.returncode == 0, third.stdout + third.stderr
    assert CHARGE.findall(third.stdout) == []
    assert json.loads(third.stdout.splitlines()[-1]) == state
    assert count_charges(stripe_mock, stripe_account) == 3


def test_stripe_charge_create_works_as_written_under_json_and_pickle(
    tmp_path: Path, stripe_mock: str, stripe_account: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ctx.effect("charge", stripe.Charge.create, ...)`` as written: one charge; under JSON
    the Charge comes back as its plain dict (``to_dict()``), under pickle as a Charge.
    """
    monkeypatch.setattr(stripe, "api_key", STRIPE_TEST_KEY)
    monkeypatch.setattr(stripe, "api_base", stripe_mock)
    params = {"amount": 500, "currency": "usd", "source": "tok_visa"}
    params["stripe_account"] = stripe_account
    kinds: list[type] = []

    def charge_as_written(state: dict[str, Any], ctx: ds.Context) -> None:
        charge = ctx.effect("charge", stripe.Charge.create, **params)
        kinds.append(type(charge))
        state["charge"] = charge["id"]

    store = str(tmp_path / "runs")
    as_json = ds.Workflow("pay", store=store, steps=[ds.step(charge_as_written, name="pay")])
    state = as_json.run("order-9", {})
    assert kinds == [dict]
    assert [c["id"] for c in list_objects(stripe_mock, "charges", stripe_account)] == [
        state["charge"]
    ]
    pickled = ds.Workflow(
        "pay-pickled",
        store=store,
        serializer="pickle",
        steps=[ds.step(charge_as_written, name="pay")],
    )
    assert pickled.run("order-9", {})["charge"].startswith("ch_")
    assert issubclass(kinds[1], stripe.Charge)
    assert count_charges(stripe_mock, stripe_account) == 2
