"""The reward of a finished τ² episode: τ²'s task reward, computed without any LLM, plus a small shaping term.

::

    reward = task_reward + shaping * (gold_fraction + valid_fraction) / 2

* ``task_reward`` (0 or 1) follows τ²'s ``evaluate_simulation`` for the task's ``reward_basis``
  (retail/airline: DB and COMMUNICATE): **DB** - the final database equals the database obtained by
  replaying the gold actions on a fresh copy (τ²'s hash of the whole database; the agent's database is the
  live one, i.e. all its tool calls replayed in order, as τ²'s evaluator does); **ENV_ASSERTION** - τ²'s
  assertions hold on it; **ACTION** - every gold action was called (τ²'s argument comparison);
  **COMMUNICATE** - every ``communicate_info`` string occurs (case-insensitive, commas removed from the
  message) in some message sent with ``send_message_to_user`` (1 when none is required); the product of
  those. NL assertions need an LLM and are skipped. 0 when the episode ended abnormally (``max_errors``
  failed tool calls, a failing user simulator, an internal error).
* ``gold_fraction``: share of the gold actions (name + compared arguments) matched by a successful call of
  the agent; ``valid_fraction``: share of the agent's tool calls (messages excluded) that ran without error
  (0 without calls).

Doing nothing scores 0 + 0 on a task whose gold actions write to the database; on a task without write
actions the database already equals the gold one, so doing nothing passes the DB check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .domain import Domain, apply_initial_state

_GOLD_HASHES: dict[tuple[str, str], tuple] = {}


def gold_hashes(d: Domain, task) -> tuple:
    """(agent DB hash, user DB hash) after replaying the task's gold actions on a fresh database, as τ²'s
    EnvironmentEvaluator does (a failing gold action is skipped). Cached per task."""
    key = (d.name, str(task.id))
    if key not in _GOLD_HASHES:
        environment = d.fresh_environment()
        apply_initial_state(environment, task)
        for action in (task.evaluation_criteria.actions or []) if task.evaluation_criteria else []:
            try:
                environment.make_tool_call(
                    tool_name=action.name, requestor=action.requestor, **action.arguments
                )
            except Exception:  # noqa: BLE001, S110 - as τ²: a failing gold action is skipped
                pass
        _GOLD_HASHES[key] = (environment.get_db_hash(), environment.get_user_db_hash())
    return _GOLD_HASHES[key]


def episode_reward(
    d: Domain,
    task,
    calls: Sequence[Any],
    agent_messages: Sequence[str],
    *,
    db_hashes: Callable[[], tuple],
    environment: Callable[[], Any],
    abnormal: str | None,
    shaping: float,
) -> dict:
    """The reward of one finished episode and its parts (see the module docstring).

    Args:
        d: The episode's domain.
        task: The τ² task.
        calls: The agent's tool calls in order, each with ``name``, ``arguments`` and ``error``.
        agent_messages: The messages the agent sent to the user.
        db_hashes: Returns the (agent, user) database hashes at the end of the episode.
        environment: Returns the episode's τ² environment (for ENV_ASSERTION tasks).
        abnormal: Why the episode ended abnormally (task reward 0), or None.
        shaping: Weight of the shaping term.

    Returns:
        ``reward``, ``task_reward``, ``gold_fraction``, ``valid_fraction``, ``shaping_term``, and the checks
        made (``db_match``, ``env_assertions``, ``actions``, ``communicate``) or ``note``.
    """
    from tau2.data_model.message import ToolCall

    crit = task.evaluation_criteria
    gold = list(crit.actions or []) if crit else []
    tool_calls = [ToolCall(id=str(i), name=c.name, arguments=c.arguments) for i, c in enumerate(calls)]
    ok_calls = [tc for tc, c in zip(tool_calls, calls, strict=True) if not c.error]
    info: dict = {}
    if abnormal is not None:
        task_reward = 0.0
        info["note"] = abnormal
    elif crit is None:
        task_reward = 1.0
    else:
        task_reward = _task_reward(d, task, tool_calls, agent_messages, db_hashes, environment, info)
    matched_gold = sum(any(a.compare_with_tool_call(tc) for tc in ok_calls) for a in gold)
    gold_fraction = matched_gold / len(gold) if gold else 0.0
    valid_fraction = len(ok_calls) / len(tool_calls) if tool_calls else 0.0
    shaping_term = shaping * (gold_fraction + valid_fraction) / 2
    info.update(
        task_reward=task_reward,
        gold_fraction=gold_fraction,
        valid_fraction=valid_fraction,
        shaping_term=shaping_term,
        reward=task_reward + shaping_term,
    )
    return info


def _task_reward(d: Domain, task, tool_calls, agent_messages, db_hashes, environment, info: dict) -> float:
    """τ²'s task reward: the product of the checks of the task's reward basis (each recorded in ``info``)."""
    from tau2.data_model.tasks import RewardType

    crit = task.evaluation_criteria
    gold = list(crit.actions or [])
    basis = set(crit.reward_basis)
    task_reward = 1.0
    if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
        env_reward = 1.0
        if crit.actions is not None or crit.env_assertions is not None:
            db_match = db_hashes() == gold_hashes(d, task)
            info["db_match"] = db_match
            if RewardType.DB in basis:
                env_reward *= float(db_match)
            if RewardType.ENV_ASSERTION in basis:
                held = all(
                    environment().run_env_assertion(a, raise_assertion_error=False)
                    for a in crit.env_assertions or []
                )
                info["env_assertions"] = held
                env_reward *= float(held)
        task_reward *= env_reward
    if RewardType.ACTION in basis:
        matched = all(any(a.compare_with_tool_call(tc) for tc in tool_calls) for a in gold)
        info["actions"] = matched
        task_reward *= float(matched)
    if RewardType.COMMUNICATE in basis:
        said = [m.lower().replace(",", "") for m in agent_messages]
        communicated = all(any(s.lower() in m for m in said) for s in crit.communicate_info or [])
        info["communicate"] = communicated
        task_reward *= float(communicated)
    return task_reward
