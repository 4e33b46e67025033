"""Is the tree walk exact on a model? Log-probs and gradients of the walk against the model's own dense
forward/backward, on a tiny model of ``trl_dta.testing.architectures``.

``check(model_type, dtype, attn, lora=False, **overrides)`` builds the model and runs, per variant:

* ``TreeExecutor(model)``: an :class:`~trl_dta.UnsupportedModelError` here is a refusal (its message is the
  reason); any other exception is a crash, except running out of memory, which is raised (the machine's
  limit, not a verdict on the model);
* log-probs and gradients of a sequence-level loss over a small trie (a shared prefix, sibling leaves whose
  packed row is longer than the window, a sequence that is a prefix of another, a duplicate), walked with
  block size 4 (chunked backward) and with one big block (packed leaves), against the model's own dense
  forward/backward per sequence;
* sequences longer than the model's attention window: refused at the call, or exact.

Verdicts: ``exact`` (float64: log-prob error <= 1e-6 and gradient error <= 1e-5, ``relative_error`` with
``tiny=1e-6``; float32: 1e-4 / 1e-3), ``refused`` (with the reason), ``no tiny build`` (the generic tiny
config does not make a working model of that type: composite vision/audio models too slow to build,
configs with extra constraints; it says nothing about the walk), ``n/a`` for a variant the model itself
does not run (an attention implementation it does not offer, a dtype its own forward fails in) and
``WRONG`` / ``CRASH`` (a bug: the walk ran and gave a different answer, or raised something else). HF
computes some attention internals in float32 even in a float64 model, so float64 errors of ~1e-7 are
expected; the tolerances above sit well above that and far below a structural mistake (>= 1e-3).

``run_case`` runs the variants of one case (``variants``: float64 and float32 x eager and sdpa, LoRA on a
few families) under a time limit. Used by ``tests/test_architectures.py`` and ``benchmarks/arch_sweep.py``.
"""

from __future__ import annotations

import contextlib
import re
import signal
from dataclasses import dataclass, field

import torch

from trl_dta import PrefixTrie, TreeExecutor, UnsupportedModelError
from trl_dta.compare import relative_error
from trl_dta.walk.errors import MEMORY_ERRORS

from .architectures import VOCAB, WINDOW, build

TOLERANCE = {torch.float64: (1e-6, 1e-5), torch.float32: (1e-4, 1e-3)}  # (log-probs, gradients)
# relative_error: a tensor whose reference is at most this fraction of the largest is measured against it
_TINY_REFERENCE = 1e-6
LORA = {"llama", "qwen3", "mistral", "gpt2", "mpt", "gemma2"}
SECONDS_PER_CHECK = 30  # a model whose tiny build or check takes longer is reported as not built


def tolerance(dtype, has_states: bool) -> tuple[float, float]:
    """(log-probs, gradients) tolerance; transformers' state-layer kernels compute in float32 even in a
    float64 model, so hybrid and state-space models get float32's."""
    return TOLERANCE[torch.float32 if has_states else dtype]


@dataclass
class Result:
    model_type: str
    variant: str  # e.g. "fp64 sdpa", "fp32 eager lora"
    verdict: str  # exact / refused / no tiny build / WRONG / CRASH
    detail: str = ""
    logp_err: float | None = None
    grad_err: float | None = None
    long: str = ""  # what happens to sequences longer than the window
    extra: dict = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        return self.variant.split()[0] if self.variant else ""


def trie_sequences(seed: int = 0, long: bool = False) -> list[list[int]]:
    """A shared prefix, sibling leaves (packed together), a prefix of another sequence and a duplicate;
    every sequence shorter than ``WINDOW`` (unless ``long``), the packed leaf rows longer than it."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    prefix = tokens(6)
    group = prefix + tokens(3)
    seqs = [group + tokens(4), group + tokens(5), group + tokens(3), prefix + tokens(6), group[:8]]
    seqs.append(list(seqs[0]))
    if long:
        seqs += [prefix + tokens(2 * WINDOW), prefix + tokens(WINDOW + 3)]
    return seqs


def dense(model, seqs, loss_fn):
    model.zero_grad(set_to_none=True)
    logps = []
    for i, seq in enumerate(seqs):
        ids = torch.tensor(seq)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        loss_fn(i, lp, None).backward()
        logps.append(lp.detach())
    return logps, _grads(model)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_fn(seqs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(len(s) - 1, generator=gen, dtype=torch.float64) for s in seqs]

    def loss_fn(i, logps, entropies):
        return (weights[i].to(logps.dtype) * logps).sum() + 0.3 * logps.mean() ** 2

    return loss_fn


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return peft.to(next(model.parameters()).dtype).eval()


def check(
    model_type: str, dtype=torch.float64, attn: str = "sdpa", lora: bool = False, **overrides
) -> Result:
    variant = f"{'fp64' if dtype == torch.float64 else 'fp32'} {attn}" + (" lora" if lora else "")
    result = Result(model_type, variant, "")
    try:
        model = build(model_type, dtype, attn, **overrides)
        if lora:
            model = _lora(model)
    except MEMORY_ERRORS:
        raise  # the machine's limit, not the model's verdict
    except Exception as e:  # noqa: BLE001 - any failure to build means "not in the sweep"
        unsupported = "does not support an attention implementation" in str(e)
        result.verdict = "n/a" if unsupported else "no tiny build"
        result.detail = (
            f"{attn} not supported by the model" if unsupported else f"{type(e).__name__}: {one_line(e)}"
        )
        return result
    seqs = trie_sequences()
    loss_fn = _loss_fn(seqs)
    try:
        executors = [
            TreeExecutor(model, block_size=4),
            TreeExecutor(model, block_size=1000, batch_tokens=1000),
        ]
    except UnsupportedModelError as e:
        result.verdict, result.detail = "refused", one_line(e)
        return result
    except MEMORY_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001
        result.verdict, result.detail = "CRASH", f"at construction: {type(e).__name__}: {one_line(e)}"
    try:  # a model that fails its own dense forward is not the walk's business
        ref = dense(model, seqs, loss_fn)
    except MEMORY_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001
        result.verdict, result.detail = (
            "n/a",
            f"the model's own forward fails: {type(e).__name__}: {one_line(e)}",
        )
        return result
    if result.verdict == "CRASH":
        return result
    return _compare(result, model, executors, seqs, loss_fn, ref, dtype)


def _compare(result: Result, model, executors, seqs, loss_fn, ref, dtype) -> Result:
    """``check``'s verdict once the model, its executors and the dense reference (log-probs, grads) exist."""
    ref_lp, ref_grads = ref
    result.extra["packed"] = executors[1].pack_leaves
    result.extra["states"] = executors[1].lm.has_states
    trie = PrefixTrie.from_sequences(seqs)
    result.logp_err = result.grad_err = 0.0
    try:
        for executor in executors:
            got_lp = executor.logprobs(trie)
            model.zero_grad(set_to_none=True)
            executor.backward(trie, loss_fn)
            got_grads = _grads(model)
            result.logp_err = max(result.logp_err, relative_error(got_lp, ref_lp, tiny=_TINY_REFERENCE))
            result.grad_err = max(result.grad_err, relative_error(got_grads, ref_grads, tiny=_TINY_REFERENCE))
    except MEMORY_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001
        result.verdict, result.detail = "CRASH", f"{type(e).__name__}: {one_line(e)}"
        return result
    lp_tol, grad_tol = tolerance(dtype, executors[1].lm.has_states)
    ok = result.logp_err <= lp_tol and result.grad_err <= grad_tol
    result.verdict = "exact" if ok else "WRONG"
    result.long = _check_long(model, executors[1], dtype)
    if result.long.startswith("WRONG"):
        result.verdict = "WRONG"
    return result


def _check_long(model, executor, dtype) -> str:
    """Sequences longer than the window: refused at the call, or exact."""
    seqs = trie_sequences(seed=1, long=True)
    trie = PrefixTrie.from_sequences(seqs)
    try:
        got = executor.logprobs(trie)
    except UnsupportedModelError as e:
        return f"refused: {one_line(e)}"
    with torch.no_grad():
        ref = []
        for seq in seqs:
            ids = torch.tensor(seq)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
            ref.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
    err = relative_error(got, ref, tiny=_TINY_REFERENCE)
    return "exact" if err <= tolerance(dtype, executor.lm.has_states)[0] else f"WRONG ({err:.1e})"


def one_line(e: Exception | str, n: int = 300) -> str:
    """An error message on one line, at most ``n`` characters (a table cell, a verdict's detail)."""
    text = re.sub(r"\s+", " ", str(e)).strip()
    return text[:n] + ("..." if len(text) > n else "")


def variants(model_type: str, quick: bool = False) -> list[dict]:
    """float64 and float32 x eager and sdpa, plus LoRA for a few; the quick run keeps three of them."""
    out = [{"dtype": d, "attn": a} for d in (torch.float64, torch.float32) for a in ("eager", "sdpa")]
    if quick:
        out = [out[0], out[1], out[2]]  # fp64 eager, fp64 sdpa, fp32 eager
    if model_type in LORA and not quick:
        out.append({"dtype": torch.float64, "attn": "eager", "lora": True})  # every model offers eager
    return out


class _Timeout(BaseException):  # not an Exception: a check's own `except Exception` must not call it a crash
    """A check that ran past SECONDS_PER_CHECK: a slow (or loaded) machine, reported as too slow."""


@contextlib.contextmanager
def _time_limit(seconds: int):
    def alarm(*_):
        raise _Timeout(f"more than {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_case(label: str, model_type: str, overrides: dict, quick: bool = False) -> list[Result]:
    """Every variant of one case (``label``: a model type or an ``EXTRA_CASES`` label); stops at the first
    variant that does not build."""
    results = []
    for kw in variants(model_type, quick):
        try:
            with _time_limit(SECONDS_PER_CHECK):
                r = check(model_type, **kw, **overrides)
        except _Timeout as e:
            r = Result(model_type, "", "no tiny build", f"too slow for the sweep ({e})")
        r.model_type = label
        results.append(r)
        if r.verdict == "no tiny build":
            break
    return results
