"""Architecture sweep: every causal LM of transformers' auto mapping, tiny and random, tree walk vs dense.

    python benchmarks/arch_sweep.py [--only llama,mistral] [--quick] [--json out.json] [--table FILE]
    # in parallel, then the table from the shards:
    python benchmarks/arch_sweep.py --shard 0/2 --json s0.json &
    python benchmarks/arch_sweep.py --shard 1/2 --json s1.json; wait
    python benchmarks/arch_sweep.py --merge s0.json s1.json --table docs/supported-models.md

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (and ``EXTRA_CASES``: ALiBi, windows,
length-dependent RoPE, KV sharing) a tiny config is built from the config class's defaults (2 layers,
hidden 32, 4 heads, vocab 96, small MoE/MLA sizes, windows and chunks of 16 tokens), then, per variant
(float64 and float32; eager and sdpa attention; LoRA on a few families), the walk's log-probs and gradients
(chunked and packed) are compared with the model's own dense forward/backward, and sequences longer than
the model's attention window are checked: refused at the call, or exact. The tiny models are
``trl_dta/testing/architectures.py``; the check and its verdicts (``exact``, ``refused``, ``not built``,
``n/a``, ``WRONG`` / ``CRASH``) are ``trl_dta/testing/exactness.py``, which ``tests/test_architectures.py``
runs on the quick subset. This script runs every case and summarises one verdict per case.

``--table`` rewrites the table between the ``<!-- arch-sweep:begin/end -->`` markers of a Markdown file.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from trl_dta.testing.architectures import QUICK, cases  # noqa: E402
from trl_dta.testing.exactness import LORA, Result, one_line, run_case  # noqa: E402


def summarize(results: list[Result]) -> tuple[str, str]:
    """One verdict for a case and the reason or the worst errors, for the model table."""
    own = [r for r in results if r.verdict == "refused" and "own forward fails on a plain input" in r.detail]
    if own and len(own) < len([r for r in results if r.verdict != "n/a"]):  # e.g. only float64 fails
        for r in own:
            r.verdict, r.detail = "n/a", "the model's own forward fails"
    verdicts = {r.verdict for r in results} - {"n/a"}
    if verdicts & {"WRONG", "CRASH"}:
        bad = next(r for r in results if r.verdict in ("WRONG", "CRASH"))
        return bad.verdict, f"{bad.variant}: {bad.detail or ''} {bad.long}".strip()
    if verdicts <= {"no tiny build"}:
        return "not built", one_line(
            results[0].detail.replace("_Timeout: ", "too slow for a tiny build: "), 90
        )
    if verdicts == {"exact"}:
        notes = []
        if any(r.extra.get("states") for r in results):
            notes.append("conv / recurrent states carried (float32 kernels)")
        if not all(r.extra.get("packed", True) for r in results):
            notes.append("padded")
        longs = {r.long for r in results if r.long}
        if any(x.startswith("refused") for x in longs):
            notes.append(_reason(next(x for x in longs if x.startswith("refused"))))
        fp64 = [r for r in results if r.verdict == "exact" and r.dtype == "fp64"]
        if not fp64:  # the model runs in float32 only: report those errors, and say so
            fp64 = [r for r in results if r.verdict == "exact"]
            notes.append("errors measured in float32")
        lp, grad = max(r.logp_err for r in fp64), max(r.grad_err for r in fp64)
        attn = sorted(
            {r.variant.split()[1] for r in results if r.verdict == "n/a" and "not supported" in r.detail}
        )
        if attn:
            notes.append(f"{', '.join(attn)} not offered by the model")
        fails = [r for r in results if r.verdict == "n/a" and "own forward fails" in r.detail]
        if fails:
            notes.append(f"the model's own forward fails in {', '.join(sorted({r.variant for r in fails}))}")
        return "exact", f"fp64 error {lp:.0e} / {grad:.0e}" + "".join(f"; {n}" for n in notes)
    if verdicts == {"refused"}:
        return "refused", _reason(results[0].detail)
    return "mixed", "; ".join(f"{r.variant}: {r.verdict} {_reason(r.detail)}" for r in results)


def _reason(message: str) -> str:
    """The cause part of a refusal message, short enough for a table cell."""
    message = message.removeprefix("refused: ")
    rules = [
        (
            "sparse or compressed attention",
            "sparse-indexer / compressed attention layers (caches other than K/V)",
        ),
        ("model's local attention", "sequences longer than the local attention window refused"),
        ("model's sliding window", "sequences longer than the sliding window refused"),
        ("model's chunked attention", "sequences longer than the attention chunk refused"),
        ("is not causal", "not causal (encoder / bidirectional attention)"),
        (
            "does not start from the given state",
            "state-space kernel ignores the given state (Mamba-1 layers)",
        ),
        ("linear-attention cache does not describe", "state layers of a kind the walk does not carry"),
        ("a forward on a cached prefix differs", "cached forward differs from dense"),
        ("fails when run on a given KV cache", "fails on a given KV cache"),
        ("own forward fails on a plain input", "the model's own forward fails on plain token ids"),
        ("wrote no K/V to the passed cache", "layers share or skip K/V"),
        ("ignores the passed KV cache", "cached forward differs from dense"),
        ("transforms its logits", "logit transform not reproduced"),
        ("RoPE", "sequences past the original context refused (length-dependent RoPE)"),
        ("not a decoder", "no decoder + LM head"),
        ("takes no KV cache", "takes no KV cache"),
    ]
    return next((short for key, short in rules if key in message), message[:120])


def model_table(rows: dict[str, tuple[str, str]]) -> str:
    """Model types grouped by verdict and notes (float64 errors: the group's largest)."""
    import transformers

    groups: dict[tuple[str, str], list] = {}
    for label, (verdict, note) in rows.items():
        errors = re.match(r"fp64 error ([^ ;]+) / ([^ ;]+)(; )?", note)
        key = (verdict, note[errors.end() :] if errors else note)
        groups.setdefault(key, []).append((label, errors.groups()[:2] if errors else None))
    counts: dict[str, int] = {}
    for verdict, _ in rows.values():
        counts[verdict] = counts.get(verdict, 0) + 1
    order = {"WRONG": 0, "CRASH": 1, "mixed": 2, "exact": 3, "refused": 4, "not built": 5}
    lines = [
        f"Generated by `python benchmarks/arch_sweep.py --table docs/supported-models.md` (transformers "
        f"{transformers.__version__}, torch {torch.__version__}, {len(rows)} cases: "
        + ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda x: order.get(x[0], 9)))
        + "), each in float64 and float32 with eager and sdpa attention, and with LoRA (r=4, all linear "
        + f"layers) on {', '.join(f'`{t}`' for t in sorted(LORA))}. Errors: the largest relative log-prob / "
        "gradient error in float64 over the group; 'padded' means sibling leaves are forwarded as a padded "
        "batch because packing them into one row would not be exact for the model.",
        "",
        "| verdict | notes | model types |",
        "|---|---|---|",
    ]
    for (verdict, note), members in sorted(groups.items(), key=lambda g: (order.get(g[0][0], 9), -len(g[1]))):
        errs = [e for _, e in members if e]
        if errs:
            worst = f"errors ≤ {max(float(a) for a, _ in errs):.0e} / {max(float(b) for _, b in errs):.0e}"
            note = f"{worst}; {note}" if note else worst
        names = ", ".join(f"`{label}`" for label, _ in sorted(members))
        lines.append(f"| {verdict} | {note.replace('|', '/')} | {names} |")
    return "\n".join(lines) + "\n"


def write_table(path: str, table: str) -> None:
    text = Path(path).read_text()
    begin, end = "<!-- arch-sweep:begin -->", "<!-- arch-sweep:end -->"
    if begin not in text:
        raise SystemExit(f"{path} has no {begin} / {end} markers")
    pre, rest = text.split(begin, 1)
    _, post = rest.split(end, 1)
    Path(path).write_text(f"{pre}{begin}\n{table}{end}{post}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="", help="comma-separated case labels (model types or extra cases)")
    parser.add_argument("--quick", action="store_true", help="the quick subset and variants only")
    parser.add_argument("--table", default="", help="rewrite the model table in this file")
    parser.add_argument("--json", default="", help="write every result to this file")
    parser.add_argument(
        "--shard", default="0/1", help="i/n: run every n-th case from the i-th (parallel runs)"
    )
    parser.add_argument("--merge", nargs="*", default=[], help="JSON files of shards: only write the table")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    # quiet and single-threaded while sweeping (tiny models); restored after: the slow test runs in-process
    saved = logging.root.manager.disable, hf_logging.get_verbosity(), torch.get_num_threads()
    logging.disable(logging.WARNING)
    hf_logging.set_verbosity(logging.CRITICAL)
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _sweep(args)
    finally:
        logging.disable(saved[0])
        hf_logging.set_verbosity(saved[1])
        torch.set_num_threads(saved[2])


def _sweep(args) -> int:
    names = args.only.split(",") if args.only else (QUICK if args.quick else None)
    results, rows = [], {}
    if args.merge:
        by_label = {}  # a later file's results for a case replace an earlier file's
        for f in args.merge:
            shard_results = [Result(**r) for r in json.loads(Path(f).read_text())]
            by_label |= {
                r.model_type: [x for x in shard_results if x.model_type == r.model_type]
                for r in shard_results
            }
        rows = {label: summarize(by_label[label]) for label in cases(names) if label in by_label}
        write_table(args.table, model_table(rows))
        return 0
    shard, shards = map(int, args.shard.split("/"))
    for label, (model_type, overrides) in list(cases(names).items())[shard::shards]:
        start = time.time()
        case = run_case(label, model_type, overrides, args.quick)
        results += case
        rows[label] = summarize(case)
        print(f"{label:32s} {time.time() - start:5.1f}s {rows[label][0]}: {rows[label][1][:200]}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
    if args.table:
        write_table(args.table, model_table(rows))
    return 1 if any(r.verdict in ("WRONG", "CRASH") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
