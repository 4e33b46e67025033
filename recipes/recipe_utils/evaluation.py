"""Held-out success: greedy rollouts of the policy on τ² tasks, scored by τ²'s own check alone.

The training reward mixes τ²'s 0/1 task reward with shaping and extra rewards, and is measured on sampled
rollouts of training tasks. :func:`greedy_success` answers the question a user asks of a trained agent: on
tasks it never trained on, decoding greedily, how often does the final database equal the gold one (τ²'s
``task_reward``, no shaping, no length terms)?

A rollout follows TRL's multi-turn loop for ``environment_factory`` environments (``GRPOTrainer``): the
prompt is rendered with the chat template TRL trains with, the model generates a turn, TRL's
``parse_response`` extracts its tool calls, the environment runs them, and the tool results are appended as
the template renders them; a turn without a tool call, the tool-call limit or the token budget ends the
rollout. Rollouts are generated in batches (left-padded), greedily (``do_sample=False``).

:class:`GreedySuccessCallback` runs it every ``every`` optimizer steps and logs ``eval_tau2_success``.
"""

from __future__ import annotations

import inspect
import logging

import torch
from transformers import TrainerCallback

logger = logging.getLogger("ppo_tau2")


def _tools(environment) -> list:
    """The environment's tools as TRL lists them: public functions of its class, sorted, bound."""
    members = inspect.getmembers(type(environment), predicate=inspect.isfunction)
    names = [n for n, _ in members if not n.startswith("_") and n not in ("reset", "get_reward")]
    return [getattr(environment, n) for n in names]


def _training_template(tokenizer):
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    return None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)


def _suffix_ids(tokenizer, template, tool_messages: list[dict]) -> list[int]:
    """Token ids that follow an assistant turn ending with its end-of-turn token: the tool results and the
    next assistant header (rendered after a one-call dummy turn, and cut there)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    render = lambda messages, gen: tokenizer.apply_chat_template(  # noqa: E731
        messages, add_generation_prompt=gen, tokenize=True, chat_template=template, return_dict=False
    )
    before, full = render(head, False), render(head + tool_messages, True)
    ends = [i for i, t in enumerate(before) if t == tokenizer.eos_token_id]
    before = before[: ends[-1] + 1] if ends else before
    if full[: len(before)] != before:
        raise ValueError("the chat template does not render tool results after an assistant turn as a suffix")
    return full[len(before) :]


def _run_calls(environment, tool_calls) -> list[dict]:
    messages = []
    for call in tool_calls:
        function = call.get("function", call)
        name, arguments = function.get("name"), function.get("arguments") or {}
        public = isinstance(name, str) and not name.startswith("_")
        tool = getattr(environment, name, None) if public else None
        try:
            result = str(tool(**arguments)) if callable(tool) else f"Error: tool {name!r} not found."
        except Exception as e:  # noqa: BLE001 - the model's malformed call is an error result, as in TRL
            result = f"Error: {e}"
        messages.append({"role": "tool", "name": str(name), "content": result})
    return messages


@torch.no_grad()
def greedy_success(
    model, tokenizer, rows, environment_factory, max_tool_calls: int, max_completion_length: int,
    batch_size: int = 16,
) -> float:  # fmt: skip
    """Fraction of ``rows`` (dataset rows with ``prompt`` and ``task_id``) whose greedy rollout passes τ²'s
    check. ``max_tool_calls`` and ``max_completion_length`` (generated tokens and tool results, as TRL counts
    them) bound each rollout as TRL's ``max_tool_calling_iterations`` and ``max_completion_length`` do."""
    from trl.chat_template_utils import add_response_schema, parse_response

    if all(getattr(tokenizer, key, None) is None for key in ("response_template", "response_schema")):
        add_response_schema(tokenizer)  # as GRPOTrainer does, so tool calls can be parsed
    template = _training_template(tokenizer)
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    passed = 0
    try:
        for lo in range(0, len(rows), batch_size):
            batch = [dict(rows[i]) for i in range(lo, min(lo + batch_size, len(rows)))]
            envs = [environment_factory() for _ in batch]
            for env, row in zip(envs, batch, strict=True):
                env.reset(**row)
            tools = [_tools(env) for env in envs]
            prompts = [
                tokenizer.apply_chat_template(
                    row["prompt"], tools=t, add_generation_prompt=True, tokenize=True, chat_template=template,
                    return_dict=False,
                )
                for row, t in zip(batch, tools, strict=True)
            ]  # fmt: skip
            ids = [list(p) for p in prompts]
            calls = [0] * len(batch)
            active = list(range(len(batch)))
            while active:
                budget = min(max_completion_length - (len(ids[i]) - len(prompts[i])) for i in active)
                if budget <= 0:
                    break
                width = max(len(ids[i]) for i in active)
                pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
                inputs = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in active], device=device)
                lengths = [len(ids[i]) for i in active]
                mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=device)
                out = model.generate(
                    input_ids=inputs, attention_mask=mask, max_new_tokens=budget, do_sample=False,
                    pad_token_id=pad, eos_token_id=eos,
                )  # fmt: skip
                still = []
                for row_out, i in zip(out[:, width:].tolist(), active, strict=True):
                    if tokenizer.eos_token_id in row_out:
                        row_out = row_out[: row_out.index(tokenizer.eos_token_id) + 1]
                    turn = parse_response(tokenizer, row_out, prefix=ids[i], tools=tools[i])
                    ids[i] += row_out
                    if not turn.get("tool_calls") or calls[i] >= max_tool_calls:
                        continue
                    calls[i] += 1
                    ids[i] += _suffix_ids(tokenizer, template, _run_calls(envs[i], turn["tool_calls"]))
                    still.append(i)
                active = still
            for env in envs:
                env.get_reward()
                passed += env.reward_info.get("task_reward") == 1.0
    finally:
        model.train(was_training)
    return passed / max(len(rows), 1)


class GreedySuccessCallback(TrainerCallback):
    """After the step log of every ``every``-th optimizer step (0: none) and at the end of training, add
    ``{"eval_tau2_success": ..., "step": ...}`` to the trainer's ``log_history``: :func:`greedy_success` of
    the trainer's model on ``rows``. (Not through ``trainer.log``: ``GRPOTrainer.log`` would fold in, and
    clear, the metrics TRL is accumulating for the current step.)"""

    def __init__(self, trainer, rows, environment_factory, every: int = 0):
        self.trainer, self.rows, self.factory, self.every = trainer, rows, environment_factory, every
        self.last_step = None

    def _evaluate(self, state) -> None:
        trainer, args = self.trainer, self.trainer.args
        model = trainer.accelerator.unwrap_model(trainer.model)
        success = greedy_success(
            model, trainer.processing_class, self.rows, self.factory, args.max_tool_calling_iterations or 0,
            args.max_completion_length,
        )  # fmt: skip
        state.log_history.append({"eval_tau2_success": success, "step": state.global_step})
        logger.info("step %d: held-out success %.3f (greedy)", state.global_step, success)
        self.last_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        step = state.global_step
        if self.every and "reward" in (logs or {}) and step % self.every == 0 and step < state.max_steps:
            self._evaluate(state)

    def on_train_end(self, args, state, control, **kwargs):
        if self.last_step != state.global_step:
            self._evaluate(state)


def saved_policy(base: str, output_dir: str, adapter: bool):
    """(model, tokenizer) of a policy saved by ``trainer.save_model(output_dir)``: the full model, or with
    ``adapter`` the PEFT adapter on ``base``; fp32, in eval mode. The saved files, not the trainer's model
    object: TRL's async trainer changes its LM head's outputs for training."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype="float32"), output_dir
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(output_dir, dtype="float32")
    return model.eval(), AutoTokenizer.from_pretrained(base, padding_side="left")
