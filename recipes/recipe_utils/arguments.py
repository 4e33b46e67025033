"""The τ² RL recipes' own arguments (:class:`Tau2Arguments`: the domain, its tasks, the simulated user, the
reward, evaluation, the value model; shared by ``recipes/ppo_tau2.py`` and ``recipes/ppo_tau2_async.py``)
and their logging set-up (:func:`setup_logging`); ``--model_cache_dir`` and the ``--domain``
check for every τ² recipe (:func:`model_cache_dir_field`, :func:`check_domain`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from recipe_utils.offline_model import OFFLINE_SMOLLM2
from trl_dta.envs.tau2.domain import UNSUPPORTED_DOMAINS  # (cheap: does not import tau2)

DOMAINS = ("retail", "airline", "mock")  # τ²'s telecom domains are refused (UNSUPPORTED_DOMAINS says why)


def model_cache_dir_field():
    """Every τ² recipe's ``--model_cache_dir``: where the offline SmolLM2 is cached."""
    return field(
        default=None,
        metadata={
            "help": f"Where --model_name_or_path {OFFLINE_SMOLLM2} is cached (unset: $TRL_DTA_CACHE, else "
            "$XDG_CACHE_HOME/trl_dta or ~/.cache/trl_dta)."
        },
    )


@dataclass
class Tau2Arguments:
    """Arguments of the τ² RL recipes: ``recipes/ppo_tau2.py``'s ``ScriptArguments`` (``ppo_tau2_async.py``
    refuses those that need the model before training). The trainer's are its config's, the model's TRL's
    ``ModelConfig``."""

    domain: str = field(default="retail", metadata={"help": "τ² domain.", "choices": list(DOMAINS)})
    max_tasks: int | None = field(
        default=None,
        metadata={"help": "Train on at most this many tasks of the train split, a seeded draw (unset: all)."},
    )
    max_eval_tasks: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate (--eval_strategy steps|epoch, --greedy_eval) on at most this many test tasks "
            "(unset: all)."
        },
    )
    write_only: bool = field(
        default=True,
        metadata={
            "help": "Keep only tasks whose gold answer writes to the database: on those, doing nothing "
            "scores 0. On the others the database already matches, so doing nothing scores τ²'s 1 unless "
            "the task requires information told to the user (5 of retail's 9 such tasks)."
        },
    )
    user_base_url: str | None = field(
        default=None,
        metadata={
            "help": "OpenAI-compatible endpoint (e.g. http://localhost:8000/v1) of an LLM that plays the "
            "user (unset: τ²'s task instructions replayed by an offline scripted user, no LLM)."
        },
    )
    user_model: str | None = field(default=None, metadata={"help": "Model name at --user_base_url."})
    user_api_key: str | None = field(
        default=None,
        metadata={"help": "API key for --user_base_url (unset: $OPENAI_API_KEY, else 'EMPTY')."},
    )
    max_user_turns: int = field(
        default=6, metadata={"help": "Most messages the simulated user answers before the episode ends."}
    )
    shaping: float = field(
        default=0.1,
        metadata={"help": "Weight of the dense shaping term added to τ²'s 0/1 reward (0 = off)."},
    )
    tool_latency: float = field(
        default=0.0,
        metadata={
            "help": "Seconds each tool call and each user turn waits, as a remote API or a human would "
            "(Tau2Environment's tool_latency; 0 = none). Changes only the wall time."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Rewards added to the environment's (TRL sums them, weighted by --reward_weights in this "
            "order, the environment's last): 'soft_overlong_punishment' (DAPO's length penalty), "
            "'tool_call_format' (1 if the rollout made a parseable tool call), or a dotted import path "
            "(module.function). See recipes/recipe_utils/rewards.py."
        },
    )
    policy: bool = field(
        default=True,
        metadata={"help": "Put the domain policy in the system prompt (False: τ²'s instructions only)."},
    )
    synthetic_tasks: int = field(
        default=0,
        metadata={
            "help": "With --domain mock: train on this many synthetic create-task tasks "
            "(trl_dta/envs/tau2/synthetic.py) instead of τ²'s 9, and hold out --synthetic_eval_tasks more."
        },
    )
    synthetic_eval_tasks: int = field(
        default=16, metadata={"help": "Held-out synthetic tasks (titles never trained on)."}
    )
    warm_start_steps: int = field(
        default=0,
        metadata={
            "help": "Before RL, this many SFT steps (TreeSFTTrainer; with --no_tree stock trl.SFTTrainer) on "
            "the gold conversations of the training tasks (recipe_utils/warm_start.py). 0: no warm start."
        },
    )
    warm_start_learning_rate: float = field(
        default=1e-4, metadata={"help": "Learning rate of the warm start."}
    )
    warm_start_batch_size: int = field(default=8, metadata={"help": "Conversations per warm-start step."})
    greedy_eval: bool = field(
        default=False,
        metadata={
            "help": "Held-out success (greedy rollouts, τ²'s check alone; recipe_utils/evaluation.py) before "
            "training, after the warm start, every --greedy_eval_steps RL steps and at the end, logged as "
            "eval_tau2_success. Held-out tasks: the synthetic ones, else τ²'s test split (--max_eval_tasks)."
        },
    )
    greedy_eval_steps: int = field(
        default=0, metadata={"help": "With --greedy_eval: also evaluate every this many RL steps (0: never)."}
    )
    value_model: str | None = field(
        default=None,
        metadata={
            "help": "PPO with a value model: 'policy' builds one from the policy's weights (after the warm "
            "start; a zero value head), else a Hub id or path of a value model (unset: no value model, "
            "TRL's group-relative advantages). docs/ppo-critic.md."
        },
    )
    no_tree: bool = field(
        default=False,
        metadata={
            "help": "Train with stock trl.GRPOTrainer and trl.SFTTrainer (same settings) instead of "
            "TreePPOTrainer and TreeSFTTrainer (A/B)."
        },
    )
    plot: bool = field(
        default=True,
        metadata={"help": "Write reward_curve.png (reward and grad_norm per step) to output_dir."},
    )
    model_cache_dir: str | None = model_cache_dir_field()

    def __post_init__(self):
        check_domain(self.domain, self.synthetic_tasks)
        if bool(self.user_base_url) != bool(self.user_model):
            raise ValueError("An LLM user needs both --user_base_url and --user_model.")
        if not 0 <= self.tool_latency < float("inf"):
            raise ValueError(f"--tool_latency is seconds >= 0, got {self.tool_latency}.")
        if self.value_model and self.no_tree:
            raise ValueError("--value_model needs the tree trainer: TRL has no PPO trainer (drop --no_tree).")


def check_domain(domain: str, synthetic_tasks: bool) -> None:
    """Every τ² recipe's ``--domain`` (and ``--synthetic_tasks``, mock only). Also catches a value from a
    YAML file, which argparse's ``choices`` does not check."""
    if domain in UNSUPPORTED_DOMAINS:
        reason = UNSUPPORTED_DOMAINS[domain]
        raise ValueError(f"--domain {domain} is not supported: {reason}. Choose one of {DOMAINS}.")
    if domain not in DOMAINS:
        raise ValueError(f"Unknown --domain {domain!r}: choose one of {DOMAINS}.")
    if synthetic_tasks and domain != "mock":
        raise ValueError("--synthetic_tasks adds tasks to τ²'s mock domain: use it with --domain mock.")


def setup_logging(training_args, recipe: str = "ppo_tau2") -> None:
    """INFO lines from the recipe's logger (``recipe``) and from trl_dta on the main process; other
    libraries' loggers (and the root logger) are left as they are."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    for name in (recipe, "trl_dta"):
        package_logger = logging.getLogger(name)
        package_logger.setLevel(logging.INFO if training_args.should_log else logging.WARNING)
        package_logger.addHandler(handler)
        package_logger.propagate = False
