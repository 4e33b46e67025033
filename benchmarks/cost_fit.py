"""The online cost fit on this device (issue 41): started from deliberately wrong constants, how close it
comes to ``benchmarks/call_costs.py``'s offline fit, how fast its plans walk, and how well it predicts.

The model is call_costs.py's (a SmolLM2-wide Llama, sdpa, fp32) and the steps are random GRPO-like tries
(groups of rollouts on shared prompts, lengths varying per step, as in ``peers.py``'s shapes). The walk's
budgets come from a memory budget in bytes (``--memory``), so that the plan is built with the cost model.
For each prior (CUDA's shipped constants; the CPU's x10):

1. ``--steps`` gradient walks with a :class:`~trl_dta.walk.cost.cost_model.CostModel` started from that prior
   (mode "reset", a temporary cache): per step the constants in use, the predicted and measured walk time;
2. then, alternating on the same tries (``--compare`` pairs), the walk planned with the online fit against
   the walk planned with the offline fit: the median ratio of their times;
3. with ``--peers``, for the first prior: the calibrated walk's predicted and measured time on each of
   ``peers.py``'s shapes (``benchmarks/peer_bench/workloads.py``; CPU or GPU profile), one walk each.

The offline constants are call_costs.py's fit: ``--offline fresh`` (the default) measures it in this run, on
the same model, threads and machine load, before the online runs; a path reads its JSON
(``docs/call-costs-cpu.json``: 2 threads, an idle machine). Results go to ``--out`` as
``cost_fit_<device>.json``.

    python benchmarks/cost_fit.py [--threads 1] [--steps 8] [--compare 6] [--offline fresh|none|PATH]
        [--peers] [--priors cuda,"cpu x10"]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from call_costs import measure, measured_model

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.walk.cost.cost_model import CostModel
from trl_dta.walk.cost.costs import DEVICE_COSTS, CallCost, device_costs


def step_trie(rng: random.Random, vocab: int) -> tuple[PrefixTrie, list[int]]:
    """A GRPO-like step: 1-3 prompts of 64-768 tokens, 2-8 rollouts each of 16-384 tokens."""
    seqs, froms = [], []
    for _ in range(rng.randint(1, 3)):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(64, 768))]
        for _ in range(rng.randint(2, 8)):
            seqs.append(prompt + [rng.randrange(1, vocab) for _ in range(rng.randint(16, 384))])
            froms.append(len(prompt) - 1)
    return PrefixTrie.from_sequences(seqs), froms


def offline_costs(fit: dict, config, device: str) -> CallCost:
    """call_costs.py's fit (its JSON's ``fit``) as the cost model's constants for ``config``."""
    reference = CallCost.for_model(config, device)
    rate = device_costs(device).flop_rate
    return replace(reference, fixed=fit["layer_call_s"] * config.num_hidden_layers,
                   per_token=reference.per_token * rate / fit["matmul_flop_rate"],
                   per_pair=reference.per_pair * rate / fit["attention_flop_rate"])  # fmt: skip


def timed(executor, trie, froms) -> float:
    """Seconds of a gradient walk (CUDA: synchronised here, by the benchmark, not by the walk)."""
    sync = torch.cuda.synchronize if executor.device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    executor.backward(trie, lambda i, lp, e: -lp.mean(), score_from=froms)
    sync()
    return time.perf_counter() - start


def peers_shapes(executor, costs: CostModel, vocab: int) -> list[dict]:
    """The calibrated walk on each of peers.py's shapes (its CPU profile; on CUDA its GPU one): predicted
    (before the walk, by the constants in use) and measured seconds, one walk each."""
    from peer_bench.workloads import shapes_for

    out = []
    for workload in shapes_for("gpu" if executor.device.type == "cuda" else "cpu", vocab):
        rows = workload.rows
        trie = PrefixTrie.from_sequences([seq for seq, _ in rows])
        froms = [prompt - 1 for _, prompt in rows]
        # (the walk's score_from is per sequence: the prompts' last token scores the first completion token)
        predicted = costs.predict(executor.plan(trie, record=False), executor.pack_leaves)
        measured = timed(executor, trie, froms)
        out.append({"shape": workload.name, "unique_tokens": trie.num_unique_tokens, "predicted_s": predicted,
                    "measured_s": measured, "ratio": predicted / measured})  # fmt: skip
        print(f"[peers] {workload.name}: predicted {predicted:.2f} s, measured {measured:.2f} s "
              f"({predicted / measured:.2f}x)", flush=True)  # fmt: skip
    return out


def plan_calls(executor, trie) -> int:
    """Forward + backward calls of the walk of ``trie`` as ``executor`` plans it (a push and its pop: one)."""
    return sum(1 for step in executor.plan(trie, record=False) if type(step).__name__ != "Pop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compare", type=int, default=6, help="alternating online/offline pairs")
    parser.add_argument("--memory", type=float, default=8e9, help="the walk's memory budget, bytes")
    parser.add_argument("--offline", default="fresh", help="'fresh' (measured here) or call_costs.py's JSON")
    parser.add_argument("--peers", action="store_true", help="predicted vs measured on peers.py's CPU shapes")
    parser.add_argument("--priors", default="", help="comma-separated subset of the priors (default: all)")
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config, model = measured_model(args.hidden, args.layers, device)
    if args.offline == "fresh":
        print("the offline fit (call_costs.py's calls), in this run:", flush=True)
        fit = measure(config, model, device)[0]
    elif args.offline != "none":
        fit = json.loads(Path(args.offline).read_text())["fit"]
    offline = offline_costs(fit, config, device.type) if args.offline != "none" else None
    cpu, cuda = CallCost.for_model(config, "cpu"), CallCost.for_model(config, "cuda")
    wrong = replace(cpu, fixed=10 * cpu.fixed, per_token=10 * cpu.per_token, per_pair=10 * cpu.per_pair)
    priors = {"cuda": cuda, "cpu x10": wrong}  # deliberately wrong on a CPU
    if device.type == "cuda":  # on a GPU: the shipped constants, and their launch cost x4
        priors = {"shipped": cuda, "launch x4": replace(cuda, fixed=4 * cuda.fixed)}
    if args.priors:
        priors = {k: priors[k] for k in args.priors.split(",")}
    names = ("fixed", "per_token", "per_pair")
    report = {"device": args.device, "threads": args.threads, "hidden": args.hidden, "layers": args.layers,
              "memory": args.memory, "offline_source": args.offline,
              "offline": {k: getattr(offline, k) for k in names} if offline else None,
              "shipped": {k: v.__dict__ for k, v in DEVICE_COSTS.items()}, "runs": {}}  # fmt: skip
    for name, prior in priors.items():
        rng = random.Random(0)
        costs = CostModel("reset", cache_dir=tempfile.mkdtemp(), prior=prior, persist=False)
        online = TreeExecutor(model, memory_budget=args.memory, cost_model=costs)
        steps = []
        for k in range(args.steps):
            trie, froms = step_trie(rng, config.vocab_size)
            plan = online.plan(trie, record=False) if costs.key else None
            predicted = costs.predict(plan, online.pack_leaves) if plan is not None else None
            explored = costs.explored
            seconds = timed(online, trie, froms)
            a = costs.active
            steps.append({"step": k, "unique_tokens": trie.num_unique_tokens, "measured_s": seconds,
                          "predicted_s": predicted, "calibrated": costs.calibrated,
                          "explored": costs.explored > explored, "fixed_uncertainty": costs.uncertainty(),
                          "constants": a._asdict(), "observations": costs.observed})  # fmt: skip
            ratio = "" if predicted is None else f", predicted {predicted:.2f} s ({predicted / seconds:.2f}x)"
            print(f"[{name}] step {k}: {seconds:.2f} s{ratio}; fixed {a.fixed * 1e3:.2f} ms, per token "
                  f"{a.per_token * 1e6:.1f} us, per pair {a.per_pair * 1e9:.2f} ns", flush=True)  # fmt: skip
        probe_trie, _ = step_trie(random.Random(1), config.vocab_size)  # the plan before and after the fit
        before = TreeExecutor(model, memory_budget=args.memory)
        before.call_cost = replace(prior, kernel=costs.template.kernel, overlap=costs.template.overlap)
        plan = {"calls_before": plan_calls(before, probe_trie), "calls_after": plan_calls(online, probe_trie)}
        fitted = costs.active
        relative = None
        if offline is not None:
            relative = {k: getattr(fitted, k) / getattr(offline, k) for k in names}
        # alternating on the same tries: the walk planned with the online fit, then with the offline one
        reference = None
        if offline is not None:
            frozen = CostModel("frozen", cache_dir=tempfile.mkdtemp(), persist=False)
            reference = TreeExecutor(model, memory_budget=args.memory, cost_model=frozen)
            reference.call_cost = offline
        pairs, predictions = [], []
        for _ in range(args.compare):
            trie, froms = step_trie(rng, config.vocab_size)
            predicted = costs.predict(online.plan(trie, record=False), online.pack_leaves)
            walked = timed(online, trie, froms)
            if reference is not None:
                pairs.append(walked / timed(reference, trie, froms))
            predictions.append(predicted / walked)
        run = {"prior": {k: getattr(prior, k) for k in names}, "plan": plan, "steps": steps,
               "fitted": fitted._asdict(), "fitted_vs_offline": relative, "online_vs_offline_time": pairs,
               "median_online_vs_offline_time": statistics.median(pairs) if pairs else None,
               "predicted_vs_measured": predictions,
               "median_predicted_vs_measured": statistics.median(predictions) if predictions else None,
               }  # fmt: skip
        if args.peers and name == next(iter(priors)):
            run["peers_shapes"] = peers_shapes(online, costs, config.vocab_size)
        report["runs"][name] = run
        print(
            f"[{name}] plan of a reference step: {plan['calls_before']} calls with the prior, "
            f"{plan['calls_after']} with the fit",
            flush=True,
        )
        summary = (
            ["fitted / offline: " + ", ".join(f"{k} {v:.2f}" for k, v in relative.items())]
            if relative
            else []
        )
        if pairs:
            summary.append(f"walk time online / offline plan: median {statistics.median(pairs):.3f}")
        if predictions:
            summary.append(f"predicted / measured: median {statistics.median(predictions):.3f}")
        print(f"[{name}] " + "; ".join(summary), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / f"cost_fit_{device.type}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
