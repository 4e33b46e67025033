"""The τ² dataset for TRL: one row per task (system prompt, then the user's opening message), and the
agent's system prompt."""

from __future__ import annotations

import hashlib
import random

from .domain import Domain, get_domain
from .scripted_user import ScriptedUser
from .users import AGENT_GREETING

# τ²'s LLMAgent prompt, with the way to message the user spelled out
AGENT_INSTRUCTION = """You are a customer service agent that helps the user according to the <policy> provided below.
In each turn you can either:
- Send a message to the user, by calling the `send_message_to_user` tool: its result is the user's reply.
- Make a tool call.
You cannot do both at the same time.
When the user replies ###STOP### (or ###TRANSFER###), the conversation is over: end with a short final message without any tool call.

Try to be helpful and always follow the policy. Always make sure you generate valid JSON only."""  # noqa: E501

AGENT_INSTRUCTION_NO_POLICY = AGENT_INSTRUCTION.replace(" according to the <policy> provided below", "")


def tau2_system_prompt(domain: str = "retail", policy: bool = True) -> str:
    """The agent's system prompt: τ²'s ``LLMAgent`` prompt (``<instructions>`` + the domain's ``<policy>``),
    its instructions adapted to the messaging tool. ``policy=False`` drops the policy (a short prompt for
    tests and very small models)."""
    if not policy:
        return f"<instructions>\n{AGENT_INSTRUCTION_NO_POLICY}\n</instructions>"
    text = get_domain(domain).policy.strip()
    return f"<instructions>\n{AGENT_INSTRUCTION}\n</instructions>\n<policy>\n{text}\n</policy>"


def _split_ids(d: Domain, split: str | None) -> list[str]:
    order = list(d.tasks)
    if split in (None, "all", "base") and split not in d.splits:
        return order
    if split in d.splits and (split not in ("train", "test") or {"train", "test"} <= d.splits.keys()):
        wanted = set(d.splits[split])
        return [i for i in order if i in wanted]
    if split in ("train", "test"):  # no official split: 80/20 by a hash of the task id
        bucket = {i: int(hashlib.sha256(f"{d.name}:{i}".encode()).hexdigest()[:8], 16) % 100 for i in order}
        train = [i for i in order if bucket[i] < 80]
        return train if split == "train" else [i for i in order if i not in set(train)]
    raise ValueError(
        f"Unknown split {split!r} for τ² domain {d.name!r}: expected one of "
        f"{sorted({'train', 'test', 'all', *d.splits})}."
    )


def _has_history(task) -> bool:
    return bool(task.initial_state is not None and task.initial_state.message_history)


def load_tau2_dataset(
    domain: str = "retail",
    split: str | None = "train",
    write_only: bool = True,
    max_tasks: int | None = None,
    seed: int = 0,
    *,
    policy: bool = True,
    greeting: bool = False,
    task_ids=None,
):
    """One row per τ² task: ``prompt`` (system prompt, then the scripted user's opening message), ``task_id``
    (str) and ``domain``; rows in τ²'s task order. Tasks that start from a recorded conversation
    (``initial_state.message_history``: 2 of the 9 mock tasks, none in retail/airline) are left out.

    Args:
        domain: τ² domain ("retail", "airline", "mock").
        split: τ²'s own split when the domain ships one (retail: 74 train / 40 test tasks; airline 30 / 20):
            "train", "test", or "all"/"base"/None for every task. A domain without a train/test split is
            split 80/20 by ``sha256(f"{domain}:{task_id}")``.
        write_only: Keep only tasks whose gold actions contain at least one write tool call (τ² tools are
            decorated ``@is_tool(ToolType.WRITE)``). On the others the gold database is the pristine one,
            so doing nothing passes τ²'s database check (task reward 1 unless the task also requires
            information to be told to the user).
        max_tasks: Keep this many tasks, drawn with ``random.Random(seed)`` (kept in τ² order).
        seed: Seed of that draw.
        policy: Put the domain policy in the system prompt (``False``: instructions only, for tests).
        greeting: Start the conversation with τ²'s agent greeting ("Hi! How can I help you today?") before the
            user's opening (off by default: some chat templates require the first turn after the system
            message to be a user turn).
        task_ids: These tasks, in this order (e.g. :func:`~trl_dta.envs.tau2.synthetic.add_mock_create_tasks`'
            ids); ``split`` and ``write_only`` are then ignored.
    """
    d = get_domain(domain)
    if task_ids is not None:
        ids = [str(i) for i in task_ids]
        unknown = [i for i in ids if i not in d.tasks]
        if unknown:
            raise ValueError(f"Unknown τ² {domain} task ids: {unknown[:5]}")
    else:
        ids = [i for i in _split_ids(d, split) if not _has_history(d.tasks[i])]
        if write_only:
            ids = [i for i in ids if d.is_write_task(d.tasks[i])]
    if max_tasks is not None and max_tasks < len(ids):
        keep = set(random.Random(seed).sample(ids, max_tasks))
        ids = [i for i in ids if i in keep]
    system = {"role": "system", "content": tau2_system_prompt(domain, policy=policy)}
    rows = []
    for i in ids:
        opening = ScriptedUser(d.tasks[i]).opening
        prompt = [system] + ([{"role": "assistant", "content": AGENT_GREETING}] if greeting else [])
        rows.append(
            {"prompt": [*prompt, {"role": "user", "content": opening}], "task_id": i, "domain": domain}
        )
    from datasets import Dataset

    if not rows:
        return Dataset.from_dict({"prompt": [], "task_id": [], "domain": []})
    return Dataset.from_list(rows)
