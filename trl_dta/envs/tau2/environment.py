"""The τ² episode as a TRL ``environment_factory`` environment: a per-domain class whose methods are the
domain's agent tools, and the episode's state machine (reset, tool calls, messages to the user, end).

TRL lists the public *functions of the environment's class* (``inspect.getmembers(type(env),
inspect.isfunction)``, minus ``reset`` / ``get_reward`` / ``_private``) and exposes them as tools. So
``Tau2Environment(domain=...)`` returns an instance of a per-domain subclass (``Tau2RetailEnvironment``, ...),
made once per process by :func:`environment_class`: one method per τ² agent tool, calling it on the
episode's database, plus :meth:`Tau2Environment.send_message_to_user`. The subclasses are found by name
through this module's ``__getattr__``, so instances and classes pickle by reference like any other class.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import pkgutil
import re
import time
from dataclasses import dataclass

from ...walk.errors import MEMORY_ERRORS
from .domain import Domain, ToolSpec, apply_initial_state, get_domain, require_tau2
from .reward import episode_reward
from .scripted_user import ScriptedUser
from .users import END_MARKERS, STOP, TRANSFER

MESSAGE_TOOL = "send_message_to_user"
_RESERVED = {"reset", "get_reward", MESSAGE_TOOL}
_MESSAGE_SIGNATURE = inspect.Signature(
    [inspect.Parameter("message", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)]
)


@dataclass
class ToolCallRecord:
    """One tool call of the agent, as it ran: its arguments, its result (the text the policy saw), and
    whether it failed."""

    name: str
    arguments: dict
    content: str
    error: bool


def _make_tool_method(spec: ToolSpec):
    name = spec.name

    def tool(self, *args, **kwargs):
        return self._call_tool(name, args, kwargs)

    tool.__name__ = tool.__qualname__ = name
    tool.__module__ = __name__
    tool.__doc__ = spec.doc
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    tool.__signature__ = inspect.Signature([self_param, *spec.parameters], return_annotation=str)
    tool.__annotations__ = {**{p.name: p.annotation for p in spec.parameters}, "return": str}
    return tool


def _class_name(domain: str) -> str:
    return "Tau2" + "".join(w.title() for w in re.split(r"[^A-Za-z0-9]+", domain) if w) + "Environment"


@functools.cache
def environment_class(domain: str) -> type:
    """The subclass of :class:`Tau2Environment` for ``domain``, made once per process: one method per τ²
    agent tool of the domain (what TRL exposes as tools)."""
    d = get_domain(domain)
    name = _class_name(domain)
    tools = ", ".join(s.name for s in d.tools)
    doc = f"{Tau2Environment.__doc__}\n    This class exposes the τ² {domain!r} agent tools: {tools}.\n"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "_tau2_domain": domain,
        "__doc__": doc,
    }
    for spec in d.tools:
        if spec.name in _RESERVED or spec.name.startswith("_"):
            raise ValueError(f"τ² tool name {spec.name!r} clashes with the environment's own methods.")
        namespace[spec.name] = _make_tool_method(spec)
    return type(name, (Tau2Environment,), namespace)


def __getattr__(name: str):
    """``Tau2<Domain>Environment``: the domain's class (how pickle finds it in a fresh process)."""
    if name.startswith("Tau2") and name.endswith("Environment") and name != "Tau2Environment":
        require_tau2()
        import tau2.domains

        for module in pkgutil.iter_modules(tau2.domains.__path__):
            if _class_name(module.name) == name:
                return environment_class(module.name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        tool_latency: Seconds slept by every tool call and every message to the user (the user's turn), as a
            remote API or a human would take (default 0: no wait). It changes no result, only the wall time;
            it is how a benchmark gives the rollouts waits that an asynchronous trainer can overlap with
            training (benchmarks/async_overlap.py). The sleep blocks the calling thread: TRL's
            ``GRPOTrainer`` (and ``TreePPOTrainer``) run the tools of a step one after another, TRL's async
            rollout worker runs them in a thread pool.

    After :meth:`get_reward`, ``env.reward_info`` holds the reward's parts (db_match, communicate, ...).
    """

    _tau2_domain: str | None = None

    def __new__(cls, domain: str = "retail", *args, **kwargs):
        target = environment_class(domain) if cls._tau2_domain is None else cls  # generic class: dispatch
        return super().__new__(target)

    def __init__(
        self,
        domain: str = "retail",
        user=None,
        max_user_turns: int = 6,
        shaping: float = 0.1,
        *,
        max_errors: int = 10,
        tool_latency: float = 0.0,
    ):
        if domain != self._tau2_domain:
            raise ValueError(
                f"{type(self).__name__} serves the {self._tau2_domain!r} domain, not {domain!r}."
            )
        self._d: Domain = get_domain(domain)
        self._user_spec = user
        self._max_user_turns = max_user_turns
        self._shaping = float(shaping)
        self._max_errors = max_errors
        if isinstance(tool_latency, bool) or not isinstance(tool_latency, int | float):
            raise TypeError(f"tool_latency must be a number of seconds, got {tool_latency!r}.")
        if not math.isfinite(tool_latency) or tool_latency < 0:
            raise ValueError(f"tool_latency must be a finite number of seconds >= 0, got {tool_latency!r}.")
        self._tool_latency = float(tool_latency)
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
        self._calls: list[ToolCallRecord] = []
        self._agent_messages: list[str] = []
        self._events: list[tuple] = [
            ("user", self._opening)
        ]  # ("call", index) | ("agent", text) | ("user", text)
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
            apply_initial_state(self._env, self._task)
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

    def _wait(self) -> None:
        """The simulated round trip of a tool call or a user turn (``tool_latency`` seconds)."""
        if self._tool_latency:
            time.sleep(self._tool_latency)

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
        self._wait()
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
        except MEMORY_ERRORS:
            raise  # not the tool's answer
        except Exception as e:  # noqa: BLE001
            response, error = f"Error: {e}", True
        try:
            content = self._d.shared.to_json_str(response)
        except Exception:  # noqa: BLE001
            content = str(response)
        self._calls.append(ToolCallRecord(name, arguments, content, error))
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
        self._wait()
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
            except MEMORY_ERRORS:
                raise  # an LLM user out of memory is not a user who ended the episode
            except Exception as e:  # noqa: BLE001 - a failing user simulator ends the episode, reward 0
                self._finish("error", failure=f"user simulator failed: {e!r}")
                return f"Error: the user is unavailable ({e}); the conversation has ended."
            self._user_turns += 1
        self._events.append(("user", reply))
        if any(marker in reply for marker in END_MARKERS):
            self._finish("user_stop")
        return reply

    send_message_to_user.__signature__ = inspect.Signature(
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("message", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
        ],
        return_annotation=str,
    )
    send_message_to_user.__annotations__ = {"message": str, "return": str}  # noqa: RUF012

    # ---------------------------------------------------------------------------------------------- reward
    def get_reward(self) -> float:
        """τ²'s task reward (no LLM) plus a small shaping term (see :mod:`trl_dta.envs.tau2.reward`)::

            reward = task_reward + shaping * (gold_fraction + valid_fraction) / 2

        Called by TRL once per finished rollout. Never raises: an internal error scores 0 (``reward_info``
        then holds the error).
        """
        if self._task is None:
            self.reward_info = {"reward": 0.0, "note": "not reset"}
            return 0.0
        info: dict = {
            "termination": self._termination,
            "num_tool_calls": len(self._calls),
            "num_tool_errors": self._num_errors,
            "num_user_turns": self._user_turns,
        }
        abnormal = None
        if self._termination in ("too_many_errors", "error"):
            abnormal = self._failure or self._termination
        try:
            info.update(
                episode_reward(
                    self._d,
                    self._task,
                    self._calls,
                    self._agent_messages,
                    db_hashes=self._db_hashes,
                    environment=self._private_environment,
                    abnormal=abnormal,
                    shaping=self._shaping,
                )
            )
        except MEMORY_ERRORS:
            raise  # a reward of 0 would be a wrong answer
        except Exception as e:  # noqa: BLE001 - never crash the trainer
            info = {"reward": 0.0, "task_reward": 0.0, "error": repr(e)}
        self.reward_info = info
        return info["reward"]
