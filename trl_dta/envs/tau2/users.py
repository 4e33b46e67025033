"""The users of the τ²-bench environment: the interface both users implement, and τ²'s conversation markers.

A user has two methods, used by :class:`trl_dta.envs.Tau2Environment`:

* ``reset(instructions, opening=None) -> str``: start a new conversation for a task's user scenario and
  return the user's opening message (``opening`` replays a given opening instead of making one).
* ``respond(message) -> str``: the user's reply to one message of the agent. A reply containing one of
  :data:`END_MARKERS` (``###STOP###``, ``###TRANSFER###``, ``###OUT-OF-SCOPE###``, τ²'s own markers) ends the
  conversation.

``instructions`` is a τ² ``Task``, ``UserScenario``, ``StructuredUserInstructions``, a plain string, or a
dict with τ²'s fields (``reason_for_call``, ``known_info``, ``unknown_info``, ``task_instructions``).

Two users ship: :class:`~trl_dta.envs.tau2.scripted_user.ScriptedUser` (offline, no LLM, deterministic) and
:class:`~trl_dta.envs.tau2.llm_user.LLMUser` (any OpenAI-compatible chat endpoint). None of these modules
imports ``tau2``.
"""

from __future__ import annotations

STOP = "###STOP###"
TRANSFER = "###TRANSFER###"
OUT_OF_SCOPE = "###OUT-OF-SCOPE###"
END_MARKERS = (STOP, TRANSFER, OUT_OF_SCOPE)

AGENT_GREETING = "Hi! How can I help you today?"  # τ²'s default first agent message

_FIELDS = ("reason_for_call", "known_info", "unknown_info", "task_instructions")


def scenario_fields(instructions) -> dict[str, str]:
    """τ²'s user-instruction fields as plain strings ('' when absent), from any accepted form."""
    obj = instructions
    for attr in ("user_scenario", "instructions"):  # Task -> UserScenario -> instructions
        inner = obj.get(attr) if isinstance(obj, dict) else getattr(obj, attr, None)
        if inner is not None and not isinstance(obj, str):
            obj = inner
    if isinstance(obj, str):
        return {"reason_for_call": obj, "known_info": "", "unknown_info": "", "task_instructions": ""}
    if not isinstance(obj, dict):
        obj = obj.model_dump() if hasattr(obj, "model_dump") else vars(obj)
    out = {k: (obj.get(k) or "") for k in _FIELDS}
    return {k: ("" if v.strip() in ("", ".") else v.strip()) for k, v in out.items()}
