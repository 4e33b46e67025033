"""Reward functions to add to an environment's reward, by name (for recipes' ``--reward_funcs``).

TRL sums the reward functions (weighted by ``reward_weights``) with the environment's ``get_reward``. Names:

* ``soft_overlong_punishment``: DAPO's length penalty (``trl.rewards.get_soft_overlong_punishment``), 0 down
  to -1 over the last quarter of ``max_completion_length``;
* ``tool_call_format``: :func:`tool_call_format`, 1 if the rollout made a tool call TRL could parse;
* a dotted import path (``my_module.my_reward``): your own function, called TRL's way. The recipe makes the
  working directory importable for it, as TRL's own scripts do.
"""

from __future__ import annotations

import importlib

__all__ = ["reward_functions", "tool_call_format"]


def tool_call_format(completions, **kwargs) -> list[float]:
    """1.0 if the rollout made at least one tool call TRL could parse (any tool, any result), else 0.0."""

    def called(message) -> bool:
        return (
            isinstance(message, dict)
            and message.get("role") == "assistant"
            and bool(message.get("tool_calls"))
        )

    return [float(any(called(m) for m in c)) if isinstance(c, list) else 0.0 for c in completions]


def reward_functions(names: list[str] | None, max_completion_length: int) -> list:
    """The reward functions named by ``names`` (see the module docstring; "none" and "" are skipped)."""
    from trl.rewards import get_soft_overlong_punishment

    funcs = []
    for name in names or []:
        if name in ("none", ""):
            continue
        if name == "soft_overlong_punishment":
            length = max_completion_length
            funcs.append(
                get_soft_overlong_punishment(max_completion_len=length, soft_punish_cache=length // 4 or 1)
            )
        elif name == "tool_call_format":
            funcs.append(tool_call_format)
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            funcs.append(getattr(importlib.import_module(module), attr))
        else:
            raise ValueError(f"Unknown reward function {name!r}: expected soft_overlong_punishment, "
                             "tool_call_format or a dotted import path.")  # fmt: skip
    return funcs
