"""The flash path's exactness in bf16 at a real shape: what the GPU suite checks first (``benchmarks/
flash_parity.py``), and what the CPU tests check with the stand-in kernel (:mod:`trl_dta.testing.varlen`).

In bf16 no two computations agree exactly, so each is measured against an fp32 reference on the same
weights (the bf16 weights, upcast: only the arithmetic differs), by the suite's one measure (max|a - b| /
max|b| per gradient tensor, the largest: :func:`~trl_dta.compare.relative_error`):

* ``flash``: the walk attending per segment with the flash kernel (torch's ``varlen_attn`` on CUDA; the
  stand-in on a CPU);
* ``sdpa``: the same walk, the same plan, attending per segment through sdpa (an executor given
  :data:`~trl_dta.walk.attention.sdpa.SDPA_SEGMENTS`);
* ``dense``: the model's own bf16 forward and backward, one sequence at a time.

**The bound**: ``flash <= BOUND_FACTOR x sdpa + BOUND_FLOOR`` over all gradients (1.5x + 2e-3), and per
tensor ``TENSOR_FACTOR x sdpa + TENSOR_FLOOR`` (2.5x + 5e-3: a small tensor's error is noisier). The two
walks run the same bf16 operations in the same order except the attention kernel, and both kernels
accumulate in fp32 and round their output once to bf16 (FlashAttention-2's tiles, sdpa's fused kernels, the
stand-in alike): the kernel adds about one bf16
rounding of the attention output to the several a decoder layer makes anyway (projections, norms, MLP), so
the flash path's error is of the sdpa path's order (the factor leaves room for a different rounding of the
same magnitude; the floor, for an sdpa error that happens to be tiny on a small case). A wrong layout (a
causal mask aligned top-left, a segment given another's keys, a gradient that skips the recomputed gather)
errs by O(1) relative, far above. ``dense`` is reported beside them: the walk's order of error.

Every kernel call is recorded by kind (:data:`KINDS`) with its own forward error against the fp32 kernel
on the same inputs (:func:`~trl_dta.testing.varlen.reference_varlen_attn`), and every kind must occur in
the run (a scenario set that stops exercising one fails, rather than passing on less). The scenarios
(:func:`scenarios`): a GRPO group (a long prompt read in place, its completions packed), a τ² slice (a system
prompt and multi-turn branches, chunked at a small block size: pops recomputed), and one-query segments
(completions and branch nodes of one token).

The CPU tests (``tests/test_flash_parity.py``) make the checks fail on purpose: a kernel that aligns causal
masking top-left, or a flash path that drops the gather's recompute (no gradient through the gathered keys).
"""

from __future__ import annotations

import copy
import functools
import random
from dataclasses import dataclass, field

import torch

from ..compare import relative_error
from ..trie import PrefixTrie
from ..walk.attention import check
from ..walk.attention.sdpa import SDPA_SEGMENTS
from ..walk.attention.torch_varlen import TorchVarlen, varlen_attn
from ..walk.attention.torch_varlen import _parameters as signature
from ..walk.executor import TreeExecutor
from .varlen import reference_varlen_attn, reference_varlen_attn_gqa

QWEN3_0_6B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=211,
    tie_word_embeddings=True,
)
BOUND_FACTOR, BOUND_FLOOR = 1.5, 2e-3
# per tensor, looser: a small tensor's gradient (a norm's weight: a sum over every token of bf16 products) has
# a noisier relative error than the largest one (2x the sdpa path's seen on a CPU); still far below O(1)
TENSOR_FACTOR, TENSOR_FLOOR = 2.5, 5e-3
# the kernel's calls by kind (each must occur), and "pop_recompute": the walk's own chunked backward, which
# forwards a long node's blocks without a graph and again with one when it pops (read from the plan)
KINDS = ("lone", "packed", "on_past", "recompute", "long", "one_query", "gqa", "pop_recompute")


@dataclass
class Scenario:
    name: str
    sequences: list[list[int]]
    score_from: list[int]
    budgets: dict  # the executor's (block_size, batch_tokens, subtree_tokens)


def scenarios(vocab: int, scale: float = 1.0, seed: int = 0) -> list[Scenario]:
    """The three scenarios (module docstring); ``scale`` multiplies their lengths (1: ~3k tokens each)."""
    rng = random.Random(seed)

    def tokens(n: float) -> list[int]:
        return [rng.randrange(vocab) for _ in range(max(1, int(n * scale)))]

    prompt = tokens(1536)
    grpo = [prompt + tokens(rng.randint(64, 256)) for _ in range(8)]
    system = tokens(1024)
    tau2, froms = [], []
    for _ in range(2):  # two tasks, each a prompt and 4 samples of 2-3 turns branching after the first
        task = system + tokens(128)
        turn = tokens(96)
        for _ in range(4):
            seq = task + turn + tokens(rng.randint(32, 160)) + tokens(64)
            tau2.append(seq)
            froms.append(len(task) - 1)
    short = tokens(64)
    one = [short + [rng.randrange(vocab)] for _ in range(4)]  # one-token completions (packed siblings)
    one += [short + [t] + tokens(8) for t in (one[0][-1], one[1][-1])]  # one-token nodes with children

    def budgets(block: int, batch: int, subtree: int) -> dict:  # (given: the same plan, whatever the kernel)
        return {
            "block_size": max(8, int(block * scale)),
            "batch_tokens": max(8, int(batch * scale)),
            "subtree_tokens": max(8, int(subtree * scale)),
        }

    return [
        Scenario("grpo", grpo, [len(prompt) - 1] * len(grpo), budgets(4096, 4096, 4096)),
        Scenario("tau2", tau2, froms, budgets(256, 1024, 512)),
        Scenario("one-query", one, [len(short) - 1] * len(one), budgets(256, 256, 256)),
    ]


@dataclass
class Calls:
    """The kernel's calls by kind, and the largest forward error of each kind against the fp32 kernel."""

    long_tokens: int
    tolerance: float
    count: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    error: dict = field(default_factory=lambda: dict.fromkeys(KINDS))  # (None: no call of it returned)
    total: int = 0
    active: bool = False  # (off while the kernel is checked and the executors probe the model)

    def kinds(self, q, k, cu_q, cu_k) -> list[str]:
        """The kinds of a call (counted before the kernel runs: a checkpoint's recompute stops inside it
        once it has what the backward needs)."""
        q_lens, k_lens = cu_q.diff().tolist(), cu_k.diff().tolist()
        kinds = {
            "lone": len(q_lens) == 1,
            "packed": len(q_lens) > 1,
            "on_past": any(m > n for n, m in zip(q_lens, k_lens, strict=True)),
            "recompute": torch._C._current_graph_task_id() != -1,  # (run by autograd: the checkpoint's)
            "long": sum(q_lens) >= self.long_tokens,
            "one_query": min(q_lens) == 1,
            "gqa": q.shape[1] != k.shape[1],
        }
        self.total += 1
        present = [kind for kind, there in kinds.items() if there]
        for kind in present:
            self.count[kind] += 1
        return present

    def error_of(self, kinds, q, k, v, cu_q, cu_k, out, kwargs) -> None:
        """The call's output against the fp32 kernel on the same inputs, per kind."""
        with torch.no_grad():
            ref = reference_varlen_attn(
                *(t.float() for t in (q, k, v)),
                cu_q,
                cu_k,
                int(cu_q.diff().max()),
                int(cu_k.diff().max()),
                scale=kwargs.get("scale"),
                window_size=kwargs.get("window_size", (-1, -1)),
            )
            err = relative_error(out.float(), ref)
        for kind in kinds:
            self.error[kind] = max(self.error[kind] or 0.0, err)

    def recording(self, kernel, probed_with=None):
        """``kernel`` (the varlen signature) recording each call here; while not :attr:`active` (the
        executors' construction probe), ``probed_with`` runs instead where given (a stand-in broken on
        purpose is measured by this item's walks, not refused by the probe)."""

        @functools.wraps(kernel)  # (torch_varlen.py reads its signature: enable_gqa or not)
        def recorded(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
            if not self.active:
                run = probed_with or kernel
                return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)
            kinds = self.kinds(query, key, cu_seq_q, cu_seq_k)
            out = kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)
            self.error_of(kinds, query, key, value, cu_seq_q, cu_seq_k, out, kwargs)
            return out

        return recorded


def _flash_kernel(device: torch.device, calls: Calls, kernel=None, kind=TorchVarlen) -> TorchVarlen:
    """The walk's flash kernel recording its calls in ``calls``: torch's on CUDA (checked first: its verdict
    decides whether it runs at all), ``kernel`` or the stand-in elsewhere."""
    if device.type == "cuda" and kernel is None:
        return kind(calls.recording(varlen_attn))
    gqa = varlen_attn is not None and "enable_gqa" in signature(varlen_attn)
    reference = reference_varlen_attn_gqa if gqa else reference_varlen_attn
    probed = functools.partial(
        _either_signature, reference_varlen_attn
    )  # (whichever signature the kernel has)
    return kind(calls.recording(kernel or reference, probed_with=probed), devices=None)


def _either_signature(function, *args, enable_gqa=None, **kwargs):
    return function(*args, **kwargs)


def _loss(i: int, lp: torch.Tensor) -> torch.Tensor:
    return -(lp.float().mean() * (1.0 + 0.25 * (i % 4)))


def _walk(executor, model, scenario: Scenario) -> dict:
    model.zero_grad(set_to_none=True)
    executor.backward(
        PrefixTrie.from_sequences(scenario.sequences),
        lambda i, lp, _: _loss(i, lp),
        score_from=scenario.score_from,
        entropy_grad=False,
    )
    return _grads(model)


def _dense(model, scenario: Scenario) -> dict:
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    for i, (seq, start) in enumerate(zip(scenario.sequences, scenario.score_from, strict=True)):
        ids = torch.tensor([seq], device=device)
        logits = model(input_ids=ids, logits_to_keep=len(seq) - start).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, start + 1 :, None]).squeeze(-1)
        _loss(i, lp).backward()
    return _grads(model)


def _grads(model) -> dict:
    """Every trainable parameter's gradient in fp32 (one that got none: zeros, so that it is compared too)."""
    return {
        n: torch.zeros(p.shape, device=p.device) if p.grad is None else p.grad.detach().float()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def build(dims: dict, device, seed: int = 0):
    """A Qwen3 of ``dims`` with random weights in bf16 on ``device`` (sdpa: the dense side's attention)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**dims, attn_implementation="sdpa")
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(torch.bfloat16).train()


def run(
    dims: dict,
    device,
    scale: float = 1.0,
    long_tokens: int = 1024,
    kernel=None,
    seed: int = 0,
    on_scenario=None,
    kind=TorchVarlen,
) -> dict:
    """The parity item (module docstring) on a Qwen3 of ``dims``: a report per scenario and whether all
    passed. ``kernel``: a stand-in for the flash kernel's function (None: torch's on CUDA, the reference
    stand-in elsewhere), in a kernel of class ``kind`` (tests break it on purpose); ``on_scenario(report)``:
    called after each scenario (the suite writes its JSON then)."""
    from ..walk.plan import Push

    device = torch.device(device)
    model = build(dims, device, seed)
    reference = copy.deepcopy(model).float()  # (the same weights: only the arithmetic differs)
    calls = Calls(long_tokens, check.TOLERANCE[torch.bfloat16])
    flash = _flash_kernel(device, calls, kernel, kind)
    report = {
        "dims": dims,
        "device": str(device),
        "scale": scale,
        "scenarios": [],
        "calls": calls.count,
        "kernel_errors": calls.error,
        "bound": {"factor": BOUND_FACTOR, "floor": BOUND_FLOOR},
    }
    if flash.devices is not None:  # torch's kernel checked first (not recorded)
        shape = tuple(dims[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
        report["flash_usable"] = flash.resolve(device, torch.bfloat16, shape) is flash
    for scenario in scenarios(dims["vocab_size"], scale, seed):
        ref = _dense(reference, scenario)
        errors = {"dense": relative_error(_dense(model, scenario), ref)}
        trie = PrefixTrie.from_sequences(scenario.sequences)
        # (no memory budget: the given budgets and no cost model, so the flash and sdpa walks run one plan,
        # as on a CPU; on CUDA "auto" would plan with the device's costs and price kept keys for sdpa only)
        flash_walk, sdpa_walk = (
            TreeExecutor(model, memory_budget=None, attention_kernel=k, **scenario.budgets)
            for k in (flash, SDPA_SEGMENTS)
        )
        plan = flash_walk.plan(trie, entropy_grad=False, record=False)
        assert sdpa_walk.plan(trie, entropy_grad=False, record=False) == plan, "the two walks' plans differ"
        before, calls.active = calls.total, True
        got = _walk(flash_walk, model, scenario)
        calls.active, flash_calls = False, calls.total - before
        sdpa = _walk(sdpa_walk, model, scenario)
        errors["flash"], errors["sdpa"] = relative_error(got, ref), relative_error(sdpa, ref)
        # (per tensor too: a tensor the kernel reaches must not hide behind another's larger error)
        excess = max(
            (relative_error(got[n], r) - TENSOR_FACTOR * relative_error(sdpa[n], r) - TENSOR_FLOOR, n)
            for n, r in ref.items()
        )
        recomputed = sum(p.segment.num_tokens for p in plan if isinstance(p, Push) and not p.keep_graph)
        calls.count["pop_recompute"] += int(recomputed > 0)
        bound = BOUND_FACTOR * errors["sdpa"] + BOUND_FLOOR
        report["scenarios"].append(
            {
                "name": scenario.name,
                "tokens": trie.num_tokens,
                "unique_tokens": trie.num_unique_tokens,
                "budgets": scenario.budgets,
                "errors": errors,
                "bound": bound,
                "flash_calls": flash_calls,
                "recomputed_tokens": recomputed,
                "worst_tensor": {"name": excess[1], "over_bound": excess[0]},
                "ok": flash_calls > 0 and errors["flash"] <= bound and excess[0] <= 0,
            }
        )
        if on_scenario is not None:
            on_scenario(report)
    missing = [kind for kind in KINDS if calls.count[kind] == 0]
    loose = [kind for kind in KINDS if (calls.error[kind] or 0.0) > calls.tolerance]
    report.update(
        missing_kinds=missing,
        kernel_tolerance=calls.tolerance,
        loose_kinds=loose,
        flash_checks={str(k): v for k, v in check.VERDICTS.items()},
    )
    report["ok"] = all(s["ok"] for s in report["scenarios"]) and not missing and not loose
    return report


def lines(report: dict) -> list[str]:
    """The report, a line per scenario and one for the kernel's calls by kind."""
    out = []
    for s in report["scenarios"]:
        e, worst = s["errors"], s["worst_tensor"]
        verdict = "ok" if s["ok"] else ("FAILED: no flash call" if not s["flash_calls"] else "FAILED")
        out.append(
            f"{s['name']} ({s['tokens']:,} tokens, {s['unique_tokens']:,} unique, "
            f"{s['flash_calls']} flash calls): vs fp32 flash {e['flash']:.2e}, sdpa {e['sdpa']:.2e}, "
            f"dense {e['dense']:.2e}; bound {s['bound']:.2e}; per tensor {worst['over_bound']:+.1e} "
            f"from its bound ({worst['name']}): {verdict}"
        )
    errors = {k: "-" if e is None else f"{e:.1e}" for k, e in report["kernel_errors"].items()}
    kinds = ", ".join(f"{k} {report['calls'][k]} ({errors[k]})" for k in KINDS)
    out.append(f"kernel calls by kind (largest forward error vs fp32): {kinds}")
    if report.get("missing_kinds"):
        out.append(f"FAILED: no call of kind {', '.join(report['missing_kinds'])}")
    if report.get("loose_kinds"):
        out.append(
            f"FAILED: kernel error over {report['kernel_tolerance']:g} for {', '.join(report['loose_kinds'])}"
        )
    return out
