"""Gold conversations: a τ² task solved by replaying its gold actions in the environment, for a supervised
warm start.

Every τ² task ships its gold actions (tool name and arguments). :func:`gold_conversation` plays them in a
:class:`~.environment.Tau2Environment` episode, so the tool results are the environment's real ones, and
writes the episode as the conversation a policy would have had in TRL's rollout: the dataset row's prompt
(system prompt and the user's opening), one assistant turn per gold tool call followed by its tool result,
a ``send_message_to_user`` call carrying the facts τ² checks were told (``communicate_info``), and a closing
assistant message. The episode must pass τ²'s check (task reward 1), or it raises.

The rows are in TRL's conversational format with tools (``messages`` and ``tools``, as ``trl.SFTTrainer``
reads them); ``tools`` are the JSON schemas of the environment's tools in the order TRL lists them, so the
warm start renders the same system turn as the RL rollouts. :func:`per_turn` cuts a conversation into
per-turn samples (one per assistant turn).
"""

from __future__ import annotations

import inspect
import json

CLOSING = "Your request is done. Have a nice day!"


def tool_schemas(environment) -> list[dict]:
    """JSON schemas of an environment's tools as TRL exposes them: the public functions of its class other
    than ``reset`` and ``get_reward``, sorted by name (``inspect.getmembers``)."""
    from transformers.utils import get_json_schema

    return [
        get_json_schema(getattr(environment, name))
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    ]


def _call(name: str, arguments: dict) -> dict:
    # arguments as a JSON string: rows of different tools keep one Arrow schema (chat templates print strings
    # as they are, mappings as JSON)
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}],
    }


def gold_conversation(row: dict, environment, closing: str = CLOSING) -> dict:
    """``{"messages": [...], "tools": <JSON string>}`` for a dataset row of
    :func:`~.dataset.load_tau2_dataset` (its ``prompt`` and ``task_id``), played in ``environment`` (a
    :class:`~.environment.Tau2Environment` of the row's domain, reset here)."""
    environment.reset(**row)
    task = environment._d.tasks[str(row["task_id"])]
    criteria = task.evaluation_criteria
    messages = list(row["prompt"])
    steps = [(a.name, dict(a.arguments)) for a in (criteria.actions or [])]
    if criteria.communicate_info:
        steps.append(("send_message_to_user", {"message": " ".join(criteria.communicate_info)}))
    for name, arguments in steps:
        result = getattr(environment, name)(**arguments)
        messages += [_call(name, arguments), {"role": "tool", "name": name, "content": str(result)}]
    messages.append({"role": "assistant", "content": closing})
    environment.get_reward()
    if environment.reward_info.get("task_reward") != 1.0:
        raise ValueError(
            f"Replaying the gold actions of τ² task {task.id!r} does not pass τ²'s check: "
            f"{environment.reward_info}"
        )
    return {"messages": messages, "tools": json.dumps(tool_schemas(environment))}


def per_turn(conversation: dict) -> list[dict]:
    """A conversation as per-turn samples: one per assistant turn, the conversation up to and including it
    (each sample a prefix of the next), as datasets that train each turn as its own sample are built."""
    messages = conversation["messages"]
    return [
        {**conversation, "messages": messages[: end + 1]}
        for end, message in enumerate(messages)
        if message["role"] == "assistant"
    ]
