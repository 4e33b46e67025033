"""Soak: many optimizer steps with a trie of another shape at each step; does memory grow?

    python benchmarks/soak.py [--steps 200] [--every 10] [--oom_at 60,61] [--out benchmarks/out] [--plot PNG]
    python benchmarks/soak.py --oom_at 60,61 --plot docs/soak-memory.png   # docs/memory.md's run
    python benchmarks/soak.py --mode executor --device cuda   # no TRL (the GPU machine): the walk + SGD alone

``--mode trainer`` (default): ``TreePPOTrainer`` on the offline fixture (trl_dta/testing/grpo.py: the tiny
Qwen3, scripted tool-call rollouts, SGD), 16 prompts, 8 rows per step; each rollout's final answer gets a
step-dependent number of extra tokens (0-48), so the trie's depth, branching and token count change at every
step. ``--mode executor``: ``TreeExecutor.backward`` and an SGD step on a random trie per step (a shared
system prompt, 2-4 groups of 2-6 completions of random lengths) through a 4-layer Qwen3, no TRL.

Every ``--every`` steps it records the process's resident memory (Linux ``VmRSS``, after ``gc.collect()``),
its peak since the last sample (``VmHWM``, reset each time) and, on CUDA, ``torch.cuda.memory_allocated``,
``max_memory_allocated`` (reset each time) and ``memory_reserved``. ``--oom_at`` injects an out-of-memory
error into the gradient walk of those steps (trl_dta/testing/oom.py): the walk is run again with halved
budgets (trl_dta/walk/memory/recovery.py), and the step's time against the median is the cost of a retry.

Output: ``soak_<mode>.json`` in ``--out`` (samples, per-step times, the growth after warm-up: the RSS at the
last sample minus at ``--warmup``, and the least-squares slope in KiB per step), a line per sample, and with
``--plot`` a PNG (matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trl_dta.testing.oom import InjectOOM  # noqa: E402
from trl_dta.walk.memory import peak as walk_peak  # noqa: E402


def status_mib(key: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of this process in MiB (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024
    except (OSError, StopIteration):
        return None


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass


class Sampler:
    """Memory every ``every`` steps (module docstring), and each step's wall time."""

    def __init__(self, every: int, device: torch.device):
        self.every, self.device = every, device
        self.samples: list[dict] = []
        self.step_s: list[float] = []
        self._t = time.perf_counter()

    def step_done(self, step: int, retries: int = 0) -> None:
        now = time.perf_counter()
        self.step_s.append(now - self._t)
        if step % self.every == 0:
            gc.collect()
            row = {"step": step, "rss_mib": status_mib("VmRSS"), "peak_rss_mib": status_mib("VmHWM"),
                   "retries": retries}  # fmt: skip
            if self.device.type == "cuda":
                row["cuda_allocated_mib"] = torch.cuda.memory_allocated(self.device) / 2**20
                row["cuda_max_allocated_mib"] = walk_peak.max_memory_allocated(self.device) / 2**20
                row["cuda_reserved_mib"] = torch.cuda.memory_reserved(self.device) / 2**20
                walk_peak.reset_peak_memory_stats(self.device)
            reset_peak()
            self.samples.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)  # fmt: skip
        self._t = time.perf_counter()


# ------------------------------------------------------------------ trainer mode (TRL)
def run_trainer(args, sampler: Sampler) -> dict:
    from transformers import TrainerCallback

    from trl_dta import TreePPOConfig, TreePPOTrainer
    from trl_dta.testing.grpo import ScriptedGenerationMixin, make_config, make_trainer

    class Varying(ScriptedGenerationMixin):
        """Scripted rollouts whose final answers get 0-48 extra tokens, by step and row. (Not recorded: the
        fixture's record of every batch would grow by ~0.17 MiB a step.)"""

        scripted_record = False

        def _scripted_turn(self, input_ids, member, budget):
            ids = super()._scripted_turn(input_ids, member, budget)
            rng = random.Random(hash((self.state.global_step, member, len(input_ids))) & 0xFFFF)
            extra = [rng.randrange(20, 500) for _ in range(rng.choice((0, 8, 16, 32, 48)))]
            room = max(budget - len(ids), 0)
            return ids[:-1] + extra[:room] + ids[-1:]

    oom_at = set(args.oom_at)
    layer = {}

    class Sample(TrainerCallback):
        def on_step_begin(self, a, state, control, model=None, **kw):
            if state.global_step + 1 in oom_at:  # in this step's gradient walk (its 5th forward there)
                layer["oom"] = InjectOOM(model.model.layers[0], 5, inside="backward").__enter__()

        def on_step_end(self, a, state, control, model=None, **kw):
            if "oom" in layer:
                layer.pop("oom").__exit__()
            sampler.step_done(state.global_step, retries=int(trainer_retries()))

    tree_cls = type("SoakTrainer", (Varying, TreePPOTrainer), {})
    config = make_config(
        args.out / "soak_run", config_cls=TreePPOConfig, max_steps=args.steps, per_device_train_batch_size=8,
        num_generations=4, num_iterations=1, max_completion_length=160, logging_steps=10, save_strategy="no",
        tree_block_size=64, tree_batch_tokens=96,
        tree_dense_fallback="never", tree_cost_fit="off",  # (the soak measures the walk: walked, one plan)
    )  # fmt: skip
    trainer = make_trainer(tree_cls, config, num_prompts=16, callbacks=[Sample()])

    def trainer_retries():
        return sum(e.oom_recovery.retried for e in trainer._walker.executors.values() if e.oom_recovery)

    trainer.train()
    history = [h for h in trainer.state.log_history if "tree/unique_tokens" in h]
    logged = sum(h.get("tree/oom_retries", 0.0) for h in history) * config.logging_steps  # (means of 10)
    return {"unique_tokens": [h["tree/unique_tokens"] for h in history], "oom_retries_logged": logged}


# ------------------------------------------------------------------ executor mode (no TRL)
def run_executor(args, sampler: Sampler) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trl_dta import PrefixTrie, TreeExecutor

    device = torch.device(args.device)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).to(device).train()
    model.config._attn_implementation = "sdpa"
    executor = TreeExecutor(model, block_size=256, batch_tokens=384)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    rng = random.Random(0)
    unique = []
    for step in range(1, args.steps + 1):
        system = [rng.randrange(3, 512) for _ in range(rng.randint(100, 400))]
        seqs = []
        for _ in range(rng.randint(2, 4)):
            prompt = system + [rng.randrange(3, 512) for _ in range(rng.randint(10, 80))]
            seqs += [prompt + [rng.randrange(3, 512) for _ in range(rng.randint(5, 200))]
                     for _ in range(rng.randint(2, 6))]  # fmt: skip
        trie = PrefixTrie.from_sequences(seqs)
        unique.append(trie.num_unique_tokens)
        scale = 1.0 / len(seqs)
        with InjectOOM(model.model.layers[0], 5 if step in args.oom_at else None):
            executor.backward(trie, lambda i, lp, ent, scale=scale: -lp.sum() * scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        sampler.step_done(step, retries=executor.oom_recovery.retried)
    return {"unique_tokens": unique, "retry_cost": retry_cost(executor, model, trie, device)}


def retry_cost(executor, model, trie, device, repeats: int = 3) -> dict:
    """The cost of a retry on the soak's last trie: the walk at its budgets, at half of them, and with an
    out-of-memory error at its first and at its last model call (walked again at half the budgets); the
    median of ``repeats`` each, seconds."""
    layer = model.model.layers[0]
    with InjectOOM(layer, None) as count:
        executor.backward(trie, lambda i, lp, ent: -lp.sum())
    start = executor.token_budgets(trie, False)
    settings = executor.budgets.given
    executor.budgets.set_given(*vars(start).values())

    def timed(at, halved=False):
        times = []
        for _ in range(repeats):
            executor.budgets.set_given(*vars(start.halved() if halved else start).values())
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            with InjectOOM(layer, at):
                executor.backward(trie, lambda i, lp, ent: -lp.sum())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    out = {"calls": count.calls, "budgets": str(start), "walk_s": timed(None),
           "halved_walk_s": timed(None, True), "oom_at_first_call_s": timed(1),
           "oom_at_last_call_s": timed(count.calls)}  # fmt: skip
    executor.budgets.set_given(*settings)
    return out


def growth(samples: list[dict], warmup: int, key: str = "rss_mib") -> dict:
    """The ``key`` at the last sample minus at step ``warmup``, and the least-squares slope after it."""
    after = [(s["step"], s[key]) for s in samples if s["step"] >= warmup and s.get(key) is not None]
    if len(after) < 2:
        return {}
    xs, ys = zip(*after, strict=True)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in after) / sum((x - mx) ** 2 for x in xs)
    return {f"{key}_growth_mib": ys[-1] - ys[0], f"{key}_slope_kib_per_step": slope * 1024,
            f"{key}_range_mib": max(ys) - min(ys)}  # fmt: skip


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    steps = [s["step"] for s in samples]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(steps, [s["rss_mib"] for s in samples], marker="o", label="resident (VmRSS, after gc)")
    ax.plot(steps, [s["peak_rss_mib"] for s in samples], marker=".", ls="--", label="peak since last sample")
    if "cuda_reserved_mib" in samples[0]:
        ax.plot(steps, [s["cuda_reserved_mib"] for s in samples], label="CUDA reserved")
        ax.plot(steps, [s["cuda_max_allocated_mib"] for s in samples], label="CUDA max allocated")
    for step in result["oom_at"]:
        ax.axvline(step, color="red", lw=0.8, alpha=0.6)
    ax.axvline(result["warmup"], color="gray", lw=0.8, ls=":")
    values = [v for s in samples for k, v in s.items() if k.endswith("_mib") and v is not None]
    ax.set_ylim(min(values) - 25, max(values) + 25)  # (a fixed margin: noise is not drawn as growth)
    g = result["growth"]
    change, slope = (
        g.get("rss_mib_growth_mib", float("nan")),
        g.get("rss_mib_slope_kib_per_step", float("nan")),
    )
    title = f"{result['mode']}: {result['steps']} steps; RSS after step {result['warmup']}: {change:+.1f} MiB"
    ax.set_title(f"{title} ({slope:+.1f} KiB/step)", fontsize=9)
    ax.set_xlabel("optimizer step (red: injected out-of-memory, walked again)")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("trainer", "executor"), default="trainer")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=20, help="growth is measured from this step's sample on")
    ap.add_argument("--oom_at", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=256, help="executor mode: the model's hidden size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    ap.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device if args.mode == "executor" else "cpu")
    sampler = Sampler(args.every, device)
    started = time.perf_counter()
    extra = (run_trainer if args.mode == "trainer" else run_executor)(args, sampler)
    steps = sampler.step_s
    retried = [steps[s - 1] for s in args.oom_at if s <= len(steps)]
    plain = [t for i, t in enumerate(steps, 1) if i not in args.oom_at and i > args.warmup]
    result = {
        "mode": args.mode, "steps": args.steps, "every": args.every, "warmup": args.warmup,
        "oom_at": args.oom_at, "device": str(device), "threads": args.threads,
        "wall_s": time.perf_counter() - started, "samples": sampler.samples,
        "growth": growth(sampler.samples, args.warmup), "retried_step_s": retried, "step_s": steps,
        "median_step_s": statistics.median(plain) if plain else None, **extra,
    }  # fmt: skip
    if device.type == "cuda":
        result["growth"].update(growth(sampler.samples, args.warmup, "cuda_reserved_mib"))
        result["growth"].update(growth(sampler.samples, args.warmup, "cuda_allocated_mib"))
    path = args.out / f"soak_{args.mode}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("growth", "median_step_s", "retried_step_s", "wall_s")}))
    print(f"wrote {path}")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
