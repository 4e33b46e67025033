"""A training run's reward curve: the reward (group mean ± std, and each reward source), the held-out success
when it was evaluated, and grad_norm per optimizer step, from ``trainer.state.log_history``, as a PNG. Needs
matplotlib (the ``dev`` extra)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["plot_rewards"]


def plot_rewards(log_history: list[dict], path: str | os.PathLike, before_rl=()) -> str | None:
    """Reward (group mean with ±std error bars, and each ``rewards/<source>/mean``) and grad_norm per
    optimizer step, from ``trainer.state.log_history``; the held-out success (``eval_tau2_success`` entries,
    and ``before_rl``: ``(label, value)`` pairs measured before RL, drawn at step 0). Returns the path
    written, or None if matplotlib is missing or no step logged a reward."""
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
    steps = [r["step"] for r in rows]  # (also logged: eval_tau2_success rows, without "reward")
    reward = [r["reward"] for r in rows]
    std = [r.get("reward_std", 0.0) for r in rows]
    grads = [(r["step"], r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.errorbar(steps, reward, yerr=std, marker="o", capsize=3, label="training reward (group mean ± std)")
    before = dict(before_rl)
    evals = [(r["step"], r["eval_tau2_success"]) for r in log_history if "eval_tau2_success" in r]
    if "before training" in before:
        ax1.plot([0], [before["before training"]], marker="s", linestyle="none", color="tab:gray",
                 label="held-out success before training")  # fmt: skip
    if "after warm start" in before:
        evals.insert(0, (0, before["after warm start"]))
    if evals:
        label = "held-out success (greedy, τ²'s check" + (", step 0: after warm start)" if before else ")")
        ax1.plot([x for x, _ in evals], [y for _, y in evals], marker="D", color="tab:green", label=label)
    sources = sorted({k for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    for key in sources if len(sources) > 1 else ():  # one source is the reward itself
        ax1.plot(steps, [r.get(key, float("nan")) for r in rows], linestyle="--", marker="x", label=key)
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(set(steps)) == 1:
        ax2.set_xticks(steps)
    ax1.set_ylabel("reward / success")
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
