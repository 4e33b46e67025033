"""Synthetic τ² mock tasks: enough tasks of one kind for a held-out split that a small model can learn.

τ²'s mock domain ships 9 tasks (2 replay a recorded conversation, 2 need no tool call), too few to measure
held-out success. :func:`add_mock_create_tasks` adds tasks of the kind of its ``create_task_1`` to the mock
domain of this process: the user asks for a new task with a given title for ``user_1``; the gold action is
``create_task(user_id="user_1", title=<title>)``, and success is τ²'s database check (the final database
equals the one the gold action gives: the task must exist, with exactly that title and no description, and
nothing else may change). Titles are two distinct words of a fixed list; train and test titles never
coincide, so held-out tasks ask for titles the policy never saw.

The tasks are τ² ``Task`` objects scored by τ²'s own evaluation semantics (:mod:`.reward`) like the shipped
ones; they live in this process only (a worker process that loads the mock domain anew does not have them).
A process that builds its environments from a pickled factory (TRL's asynchronous rollout worker, a spawned
process) gets them with :func:`synthetic_mock_environment`: ``functools.partial(synthetic_mock_environment,
num_train, num_test, seed, ...)`` adds the same tasks in whichever process calls it.
"""

from __future__ import annotations

import random

from .domain import get_domain

WORDS = (
    "Budget",
    "Review",
    "Dentist",
    "Groceries",
    "Report",
    "Call",
    "Project",
    "Launch",
    "Meeting",
    "Gym",
    "Taxes",
    "Laundry",
    "Planning",
    "Invoice",
    "Garden",
    "Car",
    "Service",
    "Birthday",
    "Party",
    "Book",
    "Club",
    "Team",
    "Sync",
    "Flight",
    "Hotel",
    "Doctor",
    "Visit",
    "Slides",
    "Draft",
    "Paint",
    "Fence",
    "Piano",
    "Lesson",
    "Kitchen",
    "Window",
    "Coffee",
    "Dinner",
    "Email",
    "Backup",
    "Garage",
)
PREFIX = "create_task:"  # task ids are PREFIX + title: the same title is the same task in every run


def _task(title: str):
    from tau2.data_model.tasks import Task

    return Task.model_validate(
        {
            "id": PREFIX + title,
            "user_scenario": {
                "instructions": {
                    "domain": "mock",
                    "reason_for_call": f"You want to create a new task called '{title}' for user_1.",
                    "known_info": "You are user_1.",
                    "task_instructions": "Ask for the task, then end the conversation.",
                }
            },
            "evaluation_criteria": {
                "actions": [
                    {
                        "action_id": "create",
                        "name": "create_task",
                        "arguments": {"user_id": "user_1", "title": title},
                    }
                ],
                "reward_basis": ["DB"],
            },
        }
    )


def add_mock_create_tasks(num_train: int, num_test: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Add ``num_train + num_test`` create-task tasks with distinct titles to the mock domain (drawn with
    ``random.Random(seed)``) and return their ids: (train ids, test ids). Adding the same titles again is a
    no-op."""
    if num_train < 0 or num_test < 0:
        raise ValueError(f"num_train and num_test must be >= 0, got {num_train} and {num_test}")
    pairs = [f"{a} {b}" for a in WORDS for b in WORDS if a != b]
    if num_train + num_test > len(pairs):
        raise ValueError(f"at most {len(pairs)} distinct titles, asked for {num_train + num_test}")
    titles = random.Random(seed).sample(pairs, num_train + num_test)
    tasks = get_domain("mock").tasks
    for title in titles:
        tasks.setdefault(PREFIX + title, _task(title))
    ids = [PREFIX + t for t in titles]
    return ids[:num_train], ids[num_train:]


def synthetic_mock_environment(num_train: int, num_test: int, seed: int = 0, **environment_kwargs):
    """A mock-domain :class:`~trl_dta.envs.Tau2Environment` (``environment_kwargs``: its arguments) in a
    process that has the synthetic tasks of ``add_mock_create_tasks(num_train, num_test, seed)``: they are
    added first (a no-op when already there). Use it through ``functools.partial`` as an
    ``environment_factory`` that works in a spawned process too."""
    from .environment import Tau2Environment

    add_mock_create_tasks(num_train, num_test, seed)
    return Tau2Environment("mock", **environment_kwargs)
