"""AsyncTreePPOConfig: TRL's AsyncGRPOConfig plus the tree walk's options (shared ones: ``tree_args.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from ...walk.adapter.checks import SUPPORTED_ATTENTION
from ..critic.args import ValueArguments
from ..dense_fallback import refuse_always
from ..tree_args import TreeArguments, check_flag


@dataclass
class AsyncTreePPOConfig(TreeArguments, ValueArguments, AsyncGRPOConfig):
    """Configuration for :class:`~trl_dta.AsyncTreePPOTrainer`: every ``AsyncGRPOConfig`` field (TRL's
    ``trl.experimental.async_grpo``: the vLLM server, the rollout pipeline, ``max_staleness``,
    ``weight_sync_steps``, ``epsilon``/``epsilon_high``, ...), plus:

    Args:
        tree_memory_budget, tree_block_size, tree_batch_tokens, tree_subtree_tokens, tree_oom_retries,
        tree_check_gradients, tree_check_tolerance:
            The walk's memory and token budgets, its out-of-memory retries and its gradient check, shared
            with :class:`~trl_dta.TreePPOConfig`: :class:`~trl_dta.train.tree_args.TreeArguments` documents
            them. The budgets bound the memory of a step's walk (one root-to-leaf path at a time); they
            replace TRL's ``token_budget``. ``tree_check_gradients`` compares the first step with the dense
            loss of :func:`~trl_dta.train.async_ppo.loss.dense_loss` (a plain forward per sample).
        gamma, lam, cliprange_value, whiten_advantages, value_learning_rate, value_max_grad_norm:
            PPO with a value model (the trainer's `value_model`; not read without one):
            :class:`~trl_dta.train.critic.args.ValueArguments` documents them (docs/ppo-critic.md).
        tree_attn_implementation (`str`, defaults to `"sdpa"`):
            The attention the policy runs under. TRL's trainer loads the model with its FA3 tree-packing
            kernel (fetched from a kernel hub at the first forward, CUDA only); this trainer switches the
            loaded model to this implementation, one of those the walk supports (``"eager"``, ``"sdpa"``,
            ``"flex_attention"``, ``"flash_attention_2"``, ``"flash_attention_3"``). Give it here, not as
            ``attn_implementation`` in ``model_init_kwargs`` (TRL passes its own).
        check_staleness_at_training (`bool`, defaults to `False`):
            TRL checks `max_staleness` when a sample leaves the queue; accelerate prefetches the next
            micro-batch, so a sample can train one policy version later than that (`max_staleness + 1`).
            With `True`, the bound is checked again when the step trains: a sample past it leaves the loss
            (counted as `staleness/train_dropped`; its micro-batch's normaliser is kept). The staleness at
            training is logged either way (`staleness/train_max`, `staleness/train_mean`).
        use_decoupled_loss (`bool`, defaults to `False`):
            AReaL's decoupled PPO objective for stale samples (docs/async.md, "The objective"): the ratio is
            clipped against the *proximal* policy (the trainer's weights when the step starts) and each
            token is weighted by the importance weight π_prox / π_behav (capped), instead of TRL's coupled
            ratio against the behaviour policy, which clips the tokens of stale samples out of the gradient.
            `False` keeps TRL's objective, so that this trainer stays a drop-in for `AsyncGRPOTrainer`; turn
            it on when samples train more than one policy version after they were generated.
        behav_imp_weight_cap (`float` or `None`, defaults to `5.0`):
            With `use_decoupled_loss`: the largest importance weight π_prox / π_behav a token keeps (AReaL's
            name; > 1). `None`: not capped.
        behav_imp_weight_mode (`str`, defaults to `"mask"`):
            What happens to a token whose weight exceeds the cap: `"mask"` leaves it out of the loss (AReaL's
            filter), `"truncate"` keeps it with the weight clamped to the cap (truncated importance
            sampling).
        ppo_n_minibatches (`int`, defaults to `1`):
            With `use_decoupled_loss`: optimizer steps per proximal pass (AReaL's name; TRL's synchronous
            trainer calls the idea `steps_per_generation`). The trainer takes this many optimizer steps'
            micro-batches from the queue together, computes their proximal log-probs (with a value model,
            old values and advantages) in one no-gradient walk of one trie, then takes the optimizer steps,
            each on its own micro-batches. With `1` the proximal policy is the policy each step trains and
            the clip never binds; from the second step of a pass on it does
            (`clip_ratio/proximal_region_mean`, `value/clip_ratio`). Each is an optimizer step for the
            learning-rate schedule, logging, checkpoints and weight syncs (AReaL syncs the server once per
            pass: `weight_sync_steps` equal to this). docs/async.md, "The objective";
            :mod:`~trl_dta.train.async_ppo.minibatches`.

    Fields of ``AsyncGRPOConfig`` that behave differently:

    * ``per_device_train_batch_size``: the number of rollout samples per rank in each micro-batch (TRL's
      fixed-count batching; a micro-batch is split across ranks by the contiguous lexicographic partition).
      No sample is ever dropped for its length; an optimizer step is ``gradient_accumulation_steps`` such
      micro-batches, each rank's share walked as one trie.
    * ``token_budget``: not used (TRL's budgeted batching drops a sample longer than the budget, the walk
      never does). Leave it `None`; a positive value is refused.
    * ``router_aux_loss_coef``: MoE load balancing is not supported (TRL computes it on its packed rows); a
      Mixture-of-Experts model needs ``router_aux_loss_coef=0.0``.

    ``disable_dropout`` (TRL's async trainer keeps the model's dropout) and ``gradient_checkpointing``
    default to what the walk needs (True, False): :class:`~trl_dta.train.tree_args.TreeArguments` says why.
    """

    tree_attn_implementation: str = field(
        default="sdpa",
        metadata={"help": f"Attention of the policy for the walk, one of {SUPPORTED_ATTENTION}."},
    )
    check_staleness_at_training: bool = field(
        default=False,
        metadata={
            "help": "Also check max_staleness when a sample trains (TRL checks it when the sample leaves the "
            "queue): a sample past it leaves the loss."
        },
    )
    use_decoupled_loss: bool = field(
        default=False,
        metadata={
            "help": "AReaL's decoupled PPO: clip against the proximal policy (the weights at the step's "
            "start), weight each token by the capped pi_prox / pi_behav (False: TRL's coupled loss)."
        },
    )
    behav_imp_weight_cap: float | None = field(
        default=5.0,
        metadata={
            "help": "use_decoupled_loss: the largest weight pi_prox/pi_behav a token keeps (> 1; None: any)."
        },
    )
    behav_imp_weight_mode: str = field(
        default="mask",
        metadata={
            "help": "use_decoupled_loss: a token over the cap is left out ('mask', AReaL's) or clamped to "
            "the cap ('truncate').",
            "choices": ["mask", "truncate"],
        },
    )

    ppo_n_minibatches: int = field(
        default=1,
        metadata={
            "help": "use_decoupled_loss: optimizer steps per proximal pass (AReaL's ppo_n_minibatches): the "
            "proximal log-probs of that many steps' samples are computed once, before the first of them."
        },
    )

    def __post_init__(self):
        super().__post_init__()  # (TreeArguments checks the shared options)
        check_async_arguments(self)


def check_async_arguments(args) -> None:
    """What :class:`~trl_dta.AsyncTreePPOTrainer` refuses in a config (an ``AsyncTreePPOConfig`` at its
    construction, a plain ``AsyncGRPOConfig`` at the trainer's): an attention the walk does not support,
    ``attn_implementation`` in ``model_init_kwargs``, a positive ``token_budget``, a decoupled loss's cap of
    1 or less or an unknown cap mode, ``tree_dense_fallback="always"`` with
    ``check_staleness_at_training``, ``ppo_n_minibatches`` below 1, or above 1 without the decoupled loss or
    with ``tree_dense_fallback="always"``."""
    check_flag("use_decoupled_loss", getattr(args, "use_decoupled_loss", False))
    check_flag("check_staleness_at_training", getattr(args, "check_staleness_at_training", False))
    if getattr(args, "check_staleness_at_training", False):  # (it works on the step's walk)
        refuse_always(getattr(args, "tree_dense_fallback", "auto"), "with check_staleness_at_training")
    cap = getattr(args, "behav_imp_weight_cap", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 1):
        raise ValueError(f"behav_imp_weight_cap must be a number > 1 or None, got {cap!r}")
    mode = getattr(args, "behav_imp_weight_mode", "mask")
    if mode not in ("mask", "truncate"):
        raise ValueError(f"behav_imp_weight_mode must be 'mask' or 'truncate', got {mode!r}")
    check_minibatches(args)
    attention = getattr(args, "tree_attn_implementation", "sdpa")
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"tree_attn_implementation={attention!r} is not supported by the tree walk; use one of "
            f"{SUPPORTED_ATTENTION}."
        )
    if isinstance(args.model_init_kwargs, dict) and "attn_implementation" in args.model_init_kwargs:
        raise ValueError(
            "AsyncTreePPOTrainer: give the attention as tree_attn_implementation=... (AsyncTreePPOConfig), "
            "not as attn_implementation in model_init_kwargs (TRL's trainer passes its own when loading)."
        )
    if args.token_budget is not None and args.token_budget > 0:
        raise ValueError(
            f"token_budget={args.token_budget}: AsyncTreePPOTrainer does not use TRL's token-budgeted "
            "batching (it drops samples longer than the budget); micro-batches hold "
            "per_device_train_batch_size samples per rank and the walk's tree_* budgets bound memory. Leave "
            "token_budget unset."
        )


def check_minibatches(args) -> None:
    """``ppo_n_minibatches``: a whole number >= 1; above 1 it needs the decoupled objective (the coupled one
    clips the ratio to the behaviour policy: a proximal pass would compute log-probs its loss never reads)
    and a walk for the pass (``tree_dense_fallback="always"`` would walk every pass)."""
    k = getattr(args, "ppo_n_minibatches", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"ppo_n_minibatches must be a whole number >= 1, got {k!r}")
    if k == 1:
        return
    if not getattr(args, "use_decoupled_loss", False):
        raise ValueError(
            f"ppo_n_minibatches={k} needs use_decoupled_loss=True: k optimizer steps per pass clip the ratio "
            "to the proximal policy (the weights before the pass), which only the decoupled objective reads. "
            "TRL's coupled objective clips the ratio to the behaviour policy at every step already."
        )
    if getattr(args, "tree_dense_fallback", "auto") == "always":
        raise ValueError(
            f'tree_dense_fallback="always" is not supported with ppo_n_minibatches={k}: the proximal '
            'log-probs of each pass are computed by a walk. Use "auto" (the steps still take the dense path '
            'where it is predicted faster) or "never".'
        )
