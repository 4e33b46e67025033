"""The tiny shop task of the offline test fixtures (no Hub access): a byte-level BPE tokenizer trained on the
fly with TRL's qwen3 chat template, a conversational dataset of order questions, two tools and a
deterministic reward. :mod:`trl_dta.testing.grpo` builds its tiny model and GRPO trainers on them (and
re-exports these names)."""

from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path

import trl
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils import get_json_schema
from trl.chat_template_utils import add_response_schema

SPECIAL_TOKENS = [
    "<|endoftext|>",  # pad
    "<|im_start|>",
    "<|im_end|>",  # eos (end of turn), as in Qwen3
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
VOCAB_SIZE = 600
SYSTEM_PROMPT = "You are a helpful support agent for an online shop. Answer briefly and politely."
_WORDS = (
    "the parcel left our warehouse and is now with the carrier it should reach you soon thank you for "
    "waiting please keep your receipt we will email tracking details today refund processed within five days"
).split()


def _crc(x) -> int:
    return zlib.crc32(x if isinstance(x, bytes) else str(x).encode())


# ------------------------------------------------------------------------------------------------------------
# Tools (TRL builds their JSON schemas from the type hints and Google-style docstrings)
# ------------------------------------------------------------------------------------------------------------
def get_order_status(order_id: str) -> str:
    """Look up the shipping status of an order.

    Args:
        order_id: The identifier of the order to look up.

    Returns:
        A one-line status report.
    """
    h = _crc(order_id)
    carrier = ("UPS", "DHL", "FedEx")[h % 3]
    day, eta = h % 28 + 1, h % 5 + 2
    return f"Order {order_id}: shipped on day {day} via {carrier}, expected delivery in {eta} days."


def cancel_order(order_id: str, reason: str) -> str:
    """Cancel an order that has not been delivered yet.

    Args:
        order_id: The identifier of the order to cancel.
        reason: Why the customer wants to cancel.

    Returns:
        A confirmation message.
    """
    refund = _crc(order_id) % 90 + 10
    return f"Order {order_id} cancelled (reason: {reason}). A refund of {refund} USD is on its way."


TOOLS = [get_order_status, cancel_order]


# ------------------------------------------------------------------------------------------------------------
# Dataset, reward
# ------------------------------------------------------------------------------------------------------------
def _order_id(i: int) -> str:
    return f"{'ABCDEFGH'[i % 8]}{17 + 7 * i}"


def _user_message(i: int) -> str:
    if i % 2 == 0:
        return f"Hi, where is my order {_order_id(i)}? It has been a while."
    return f"Please cancel my order {_order_id(i)}, I changed my mind."


def make_dataset(num_prompts: int = 2) -> Dataset:
    """Conversational prompts (system + user), pairwise distinct; even rows ask for a status, odd rows for a
    cancellation (so the scripted first turn calls get_order_status or cancel_order)."""
    prompts = [
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": _user_message(i)}]
        for i in range(num_prompts)
    ]
    return Dataset.from_dict({"prompt": prompts})


def _text_of(completion) -> str:
    if isinstance(completion, str):
        return completion
    return (completion[-1].get("content") or "") if completion else ""


def reward_fn(completions, **kwargs) -> list[float]:
    """Deterministic reward from the final message's text: its length plus a content hash, so the members of a
    group (whose final answers differ) get different rewards and non-zero advantages."""
    return [0.02 * len(t) + (_crc(t) % 97) / 97.0 for t in map(_text_of, completions)]


# ------------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------------
def _corpus() -> list[str]:
    schemas = [json.dumps(get_json_schema(t)) for t in TOOLS]
    boiler = [
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        'XML tags:\n\n{"name": <function-name>, "arguments": <args-json-object>}\n',
        "system\nuser\nassistant\n\n\n",
    ]
    lines = [SYSTEM_PROMPT, *schemas, *boiler]
    for i in range(16):
        oid = _order_id(i)
        status = json.dumps({"name": "get_order_status", "arguments": {"order_id": oid}})
        cancel = json.dumps(
            {"name": "cancel_order", "arguments": {"order_id": oid, "reason": "changed my mind"}}
        )
        lines += [
            _user_message(i),
            get_order_status(oid),
            cancel_order(oid, "changed my mind"),
            f"Let me check order {oid}.\n\n{status}\n",
            f"I will cancel order {oid}.\n\n{cancel}\n",
            f"Done for order {oid}. Note {i}: Checking order {oid} in the shop system now.",
        ]
    lines.append(" ".join(_WORDS) + " 0123456789 .,:;!?()[]{}\"'-_/")
    return lines * 4


@functools.cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (vocab 600, special tokens included) trained here on a small synthetic corpus, with
    TRL's qwen3 chat template and its response parser. eos = <|im_end|> (as in Qwen3), pad = <|endoftext|>,
    no BOS. Cached: callers share one instance, do not mutate it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
        model_max_length=4096,
    )
    # GRPOTrainer sets the response template itself when given tools; setting it here keeps the shared
    # instance in one state, so runs without tools parse completions the same way whatever ran before.
    return add_response_schema(tokenizer)
