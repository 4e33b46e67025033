"""Benchmark: TreePPOTrainer vs stock TRL GRPOTrainer end to end (``trainer.train()``) on tau2-shaped batches.

    python benchmarks/trainer.py [--quick] [--case tau2-ga1|tau2-ga4|tau2-ga8|long-prompt-ga4] [--steps 4]
                                 [--threads 2]

Four trainers, same initial weights, same scripted batches (trl_dta/testing/grpo.py: every rollout of a group
shares the system prompt + tool schemas, the user turn and a first tool-call turn with its tool response,
then gives its own final answer), same config otherwise:

* (a) stock ``GRPOTrainer``, gradient checkpointing off;
* (b) stock ``GRPOTrainer``, gradient checkpointing on (TRL's default);
* (c) ``TreePPOTrainer`` (one trie per optimizer step for the loss forward/backward; no-grad log-prob
  passes over the generation batch);
* (d) ``TreePPOTrainer`` walking one trie per micro-batch (how it worked before the step walk; only with
  gradient accumulation > 1, where the two differ).

Cases (groups of 8 rollouts, num_iterations 2, so TRL also runs the no-grad old-log-prob pass once per
generation; ``--steps`` optimizer steps):

* ``tau2-ga1``: one micro-batch = one group (per_device_train_batch_size 8), gradient accumulation 1;
* ``tau2-ga4``: 4 groups per optimizer step, per-device batch 8, gradient accumulation 4: TRL's shuffle
  spreads each group over the 4 micro-batches;
* ``tau2-ga8``: the same 4 groups with per-device batch 4 and gradient accumulation 8;
* ``long-prompt-ga4``: single-turn GRPO (no tools), a long user prompt (``--prompt_words``), groups of 8,
  gradient accumulation 4. Model: a 4-layer Qwen3 (hidden 256, GQA 4/2 heads, head_dim 64,
vocab 600) in fp32 with sdpa, so model compute dominates. Runs alternate a, b, c, a, b, c, ... ``--repeats``
times after one untimed warm-up step of each; medians are reported. Measured per run:

* ``train s``: wall time of ``trainer.train()`` (construction excluded): generation, rewards, old log-probs,
  loss, optimizer, logging - everything;
* ``step s``: TRL's logged ``step_time`` (one ``training_step``), median over steps;
* ``fwd+bwd s``: per optimizer step, ``compute_loss`` + ``accelerator.backward`` summed over its micro-batches
  (the policy forward/backward; for (c) and (d) the walk, plus TRL's ``_compute_loss`` on detached values for
  its metrics), median over steps;
* ``logp s``: the no-grad log-prob pass(es) per generation (old log-probs), median;
* ``tree/time_s``: the walk alone as TreePPOTrainer logs it (c only);
* ``peak RSS MiB``: peak resident memory of one ``--steps`` ``train()`` in a fresh process per trainer, minus
  the process's resident memory once the trainer is built (so the model, TRL and torch themselves are not
  counted): what training adds on top of them.

How to read ``speedup / dedup``: ``dedup`` = tokens / unique tokens of an optimizer step's rollouts is the
speedup one would expect if cost were linear in tokens forwarded. ``fwd+bwd`` speedup / dedup is the walk's
efficiency against that ideal: it can exceed 1 (dense also pays for padding - ``padded`` = B x (prompt width
+ completion width) / real tokens - and attends over the shared prefix once per row), and below 1 it
measures the walk's overheads (many small forwards instead of one big one, the block-diagonal mask of packed
sibling leaves and their attention over the shared prefix, per-segment backward calls, Python). For
``train s`` the ratio is diluted by everything the trie does not touch (generation, tool calls, optimizer,
logging).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import transformers
import trl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's trl_dta
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_dta import TreePPOConfig, TreePPOTrainer  # noqa: E402
from trl_dta.testing.grpo import ScriptedGenerationMixin, make_config, make_trainer, tiny_model  # noqa: E402

CASES = {  # name: (per_device_train_batch_size, gradient_accumulation_steps, prompts, tools)
    "tau2-ga1": (8, 1, 2, True),
    "tau2-ga4": (8, 4, 4, True),
    "tau2-ga8": (4, 8, 4, True),
    "long-prompt-ga4": (8, 4, 4, False),
}
MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)  # fmt: skip


class Timed(ScriptedGenerationMixin):
    """Scripted generation plus timers: compute_loss + accelerator.backward (fwd+bwd), the no-grad log-prob
    passes, and the dense micro-batch's padding (from the inputs compute_loss sees)."""

    scripted_record = False

    def compute_loss(self, model, inputs, *args, **kwargs):
        if not getattr(self.accelerator, "_bench_timed", False):  # wrap this trainer's accelerator once
            backward = self.accelerator.backward

            def timed_backward(loss, **kw):
                backward(loss, **kw)
                self.bench["fwd_bwd"].append(time.perf_counter() - self._fb_start)

            self.accelerator.backward, self.accelerator._bench_timed = timed_backward, True
        (rows, p_width), c_width = inputs["prompt_ids"].shape, inputs["completion_ids"].shape[1]
        real = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        self.bench["padded"].append(rows * (p_width + c_width) / real)
        self._fb_start = time.perf_counter()
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if torch.is_grad_enabled():  # the loss's own pass: inside the fwd+bwd timer
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        started = time.perf_counter()
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self.bench["logp"].append(time.perf_counter() - started)
        return out


class PerMicroBatch(TreePPOTrainer):
    """TreePPOTrainer as it was before the step walk: one trie per micro-batch (no step schedule: each
    micro-batch walked alone)."""

    def _scheduled(self, inputs):
        return None


TRAINERS = {  # name: (trainer class, config class, gradient checkpointing)
    "a: GRPO": (type("StockTimed", (Timed, GRPOTrainer), {}), GRPOConfig, False),
    "b: GRPO+ckpt": (type("StockTimed", (Timed, GRPOTrainer), {}), GRPOConfig, True),
    "c: TreePPO": (type("TreeTimed", (Timed, TreePPOTrainer), {}), TreePPOConfig, False),
    "d: TreePPO/mb": (type("TreeMbTimed", (Timed, PerMicroBatch), {}), TreePPOConfig, False),
}


def long_prompt_dataset(num_prompts, words):
    from datasets import Dataset

    from trl_dta.testing.grpo import _WORDS, SYSTEM_PROMPT, _user_message

    filler = " ".join(_WORDS[j % len(_WORDS)] for j in range(words))
    prompts = [[{"role": "system", "content": SYSTEM_PROMPT + " " + filler},
                {"role": "user", "content": _user_message(i)}] for i in range(num_prompts)]  # fmt: skip
    return Dataset.from_dict({"prompt": prompts})


def run(name, steps, out_dir, case="tau2-ga1", prompt_words=600):  # out_dir: scratch (nothing is saved)
    trainer_cls, config_cls, ckpt = TRAINERS[name]
    batch, accumulation, prompts, tools = CASES[case]
    config = make_config(out_dir, config_cls=config_cls, per_device_train_batch_size=batch,
                         num_generations=8, gradient_accumulation_steps=accumulation, num_iterations=2,
                         max_steps=steps, learning_rate=1e-4, gradient_checkpointing=ckpt,
                         disable_tqdm=True)  # fmt: skip
    dataset = long_prompt_dataset(prompts, prompt_words) if not tools else None
    trainer = make_trainer(trainer_cls, config, model=tiny_model(seed=0, **MODEL), num_prompts=prompts,
                           tools=tools, dataset=dataset)  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # disable_tqdm=True would print every log dict instead
    trainer.bench = {"fwd_bwd": [], "logp": [], "padded": []}
    started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    assert trainer.model.is_gradient_checkpointing == ckpt, f"{name}: gradient checkpointing is not {ckpt}"
    med = statistics.median
    tree = lambda key: [h[f"tree/{key}"] for h in logs if f"tree/{key}" in h]  # noqa: E731 (c only)
    micro = trainer.bench["fwd_bwd"]  # per micro-batch; the step walk does its work in the first one
    per_step = [sum(micro[i : i + accumulation]) for i in range(0, len(micro), accumulation)]
    return dict(
        train_s=train_s, step_s=med(h["step_time"] for h in logs), fwd_bwd_s=med(per_step),
        logp_s=med(trainer.bench["logp"]), padded_ratio=statistics.mean(trainer.bench["padded"]),
        dedup_ratio=tree("dedup_ratio"),
        tree_time_s=med(tree("time") or [float("nan")]), tokens=tree("tokens"),
        unique_tokens=tree("unique_tokens"), loss=[h["loss"] for h in logs],
        fwd_bwd_runs_s=trainer.bench["fwd_bwd"], logp_runs_s=trainer.bench["logp"],
    )  # fmt: skip


def peak_rss_mib(name, case, steps, prompt_words):
    """Peak RSS that ``train()`` adds, measured in a fresh process (see the module docstring)."""
    import subprocess

    cmd = [sys.executable, __file__, "--memory_of", name, "--case", case, "--steps", str(steps),
           "--prompt_words", str(prompt_words)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def memory_of(name, case, steps, prompt_words):
    trainer_cls, config_cls, ckpt = TRAINERS[name]
    batch, accumulation, prompts, tools = CASES[case]
    config = make_config(tempfile.mkdtemp(prefix="bench_mem_"), config_cls=config_cls,
                         per_device_train_batch_size=batch, num_generations=8,
                         gradient_accumulation_steps=accumulation, num_iterations=2, max_steps=steps,
                         learning_rate=1e-4, gradient_checkpointing=ckpt, disable_tqdm=True)  # fmt: skip
    dataset = long_prompt_dataset(prompts, prompt_words) if not tools else None
    trainer = make_trainer(trainer_cls, config, model=tiny_model(seed=0, **MODEL), num_prompts=prompts,
                           tools=tools, dataset=dataset)  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.bench = {"fwd_bwd": [], "logp": [], "padded": []}

    def status_mib(key):  # VmRSS (now) or VmHWM (peak since the last reset), Linux
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS: earlier peaks (imports, setup) drop out
    before = status_mib("VmRSS:")
    trainer.train()
    print(f"{status_mib('VmHWM:') - before:.1f}")


def print_table(summary, dedup, padded):
    cols = ["trainer", "train s", "step s", "fwd+bwd s", "logp s", "train: c x", "train x/dedup",
            "fwd+bwd: c x", "fwd+bwd x/dedup", "peak RSS MiB"]  # fmt: skip
    c = summary["c: TreePPO"]
    rows = []
    for name, s in summary.items():
        tr, fb = s["train_s"] / c["train_s"], s["fwd_bwd_s"] / c["fwd_bwd_s"]
        ratios = [f"{tr:.2f}x", f"{tr / dedup:.2f}", f"{fb:.2f}x", f"{fb / dedup:.2f}"]
        ratios = ["-"] * 4 if s is c else ratios
        times = [f"{s['train_s']:.2f}", f"{s['step_s']:.2f}", f"{s['fwd_bwd_s']:.3f}", f"{s['logp_s']:.3f}"]
        rows.append([name, *times, *ratios, f"{s.get('rss_mib', float('nan')):.0f}"])
    cells = [cols] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    for i, r in enumerate(cells):
        print(
            "  ".join(
                x.ljust(w) if j == 0 else x.rjust(w) for j, (x, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\n'c x' = that trainer's time / TreePPO's (speedup of c over it). dedup ratio of the optimizer "
          f"step {dedup:.2f}x (tokens / unique tokens), padded ratio of the dense batch {padded:.2f}x; "
          f"TreePPO tree/time_s (walk only) {c['tree_time_s']:.3f} s per step.")  # fmt: skip


def plot(summary, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "train_s", "trainer.train() wall time, s"),
                           (axes[1], "fwd_bwd_s", "loss forward+backward per step, s")):  # fmt: skip
        ax.bar(names, [summary[n][key] for n in names], color=[f"C{i}" for i in range(len(names))])
        for i, n in enumerate(names):
            ax.plot([i] * len(runs[n]), [r[key] for r in runs[n]], "k.", ms=5)  # individual runs
            ax.annotate(f"{summary[n][key]:.2f}", (i, summary[n][key]), ha="center", va="bottom")
        ax.set_title(f"{title} (median; dots: runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 repeat (< 1.5 min)")
    ap.add_argument("--steps", type=int, help="optimizer steps per train() (default 4; 2 with --quick)")
    ap.add_argument("--repeats", type=int, help="timed train() runs per trainer (default 2; 1 with --quick)")
    ap.add_argument("--case", choices=sorted(CASES), default="tau2-ga1")
    ap.add_argument("--prompt_words", type=int, default=600, help="filler words of long-prompt-ga4's prompt")
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads (1 is steadier on a shared machine)"
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"))
    ap.add_argument("--memory_of", help=argparse.SUPPRESS)  # internal: one trainer's peak RSS, fresh process
    args = ap.parse_args()
    args.steps = args.steps or (2 if args.quick else 4)
    args.repeats = args.repeats or (1 if args.quick else 2)

    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.memory_of:
        return memory_of(args.memory_of, args.case, args.steps, args.prompt_words)
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: 1-min load average is {load_before:.1f} before starting; timings will be noisy")
    wall = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="bench_trainer_")
    names = [n for n in TRAINERS if not (n.startswith("d:") and CASES[args.case][1] == 1)]
    for name in names:  # warm-up (kernels, allocator, TreeExecutor's probe): one step each, untimed
        run(name, 1, scratch, args.case, args.prompt_words)
    runs = {name: [] for name in names}
    for rep in range(args.repeats):
        for name in names:
            runs[name].append(run(name, args.steps, scratch, args.case, args.prompt_words))
            r = runs[name][-1]
            losses = ", ".join(f"{x:.5f}" for x in r["loss"])  # equal across trainers up to fp32 rounding
            print(f"[{rep + 1}/{args.repeats}] {name:13s} train {r['train_s']:.2f} s, fwd+bwd "
                  f"{r['fwd_bwd_s']:.3f} s/step, logp {r['logp_s']:.3f} s, losses {losses}")  # fmt: skip
    wall = time.perf_counter() - wall
    shutil.rmtree(scratch, ignore_errors=True)

    keys = ("train_s", "step_s", "fwd_bwd_s", "logp_s", "tree_time_s")
    summary = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in runs.items()}
    for name in summary:
        summary[name]["rss_mib"] = peak_rss_mib(name, args.case, args.steps, args.prompt_words)
    c_run = runs["c: TreePPO"][0]
    dedup, padded = statistics.mean(c_run["dedup_ratio"]), runs["a: GRPO"][0]["padded_ratio"]
    paddings = {n: rs[0]["padded_ratio"] for n, rs in runs.items()}
    if max(paddings.values()) - min(paddings.values()) > 1e-9:
        print(f"warning: the trainers saw differently padded micro-batches: {paddings}")
    print()
    print_table(summary, dedup, padded)
    print(f"\nmedian of {args.repeats} run(s) x {args.steps} steps; {torch.get_num_threads()} threads; "
          f"total wall {wall:.0f} s")  # fmt: skip

    c = summary["c: TreePPO"]
    derived = {}
    for n, s in summary.items():
        if s is not c:
            tr, fb = s["train_s"] / c["train_s"], s["fwd_bwd_s"] / c["fwd_bwd_s"]
            derived[n] = dict(train_speedup_of_c=tr, train_speedup_over_dedup=tr / dedup,
                              fwd_bwd_speedup_of_c=fb, fwd_bwd_speedup_over_dedup=fb / dedup)  # fmt: skip
    env = dict(
        torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__,
        python=platform.python_version(), platform=platform.platform(), threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(), date=datetime.datetime.now().isoformat(timespec="seconds"), wall_s=wall,
        load_avg_1min_before=load_before, load_avg_1min_after=os.getloadavg()[0],
    )  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"trainer-{args.case}.json"), "w") as f:
        json.dump(dict(args=vars(args), model=MODEL, env=env, dedup_ratio=dedup, padded_ratio=padded,
                       tokens_per_step=c_run["tokens"],
                       unique_tokens_per_step=c_run["unique_tokens"],
                       summary=summary, speedups=derived, runs=runs), f, indent=2)  # fmt: skip
    plot(summary, runs, os.path.join(args.out, f"trainer-{args.case}.png"))
    print(f"wrote {args.out}/trainer-{args.case}.json and .png")


if __name__ == "__main__":
    main()
