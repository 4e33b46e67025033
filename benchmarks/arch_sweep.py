"""Architecture sweep: every causal LM of transformers' auto mapping, tiny and random, tree walk vs dense.

    python benchmarks/arch_sweep.py [--only llama,mistral] [--quick] [--readme README.md] [--json out.json]
    # in parallel, then the README table from the shards:
    python benchmarks/arch_sweep.py --shard 0/2 --json s0.json &
    python benchmarks/arch_sweep.py --shard 1/2 --json s1.json; wait
    python benchmarks/arch_sweep.py --merge s0.json s1.json --readme README.md

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (and ``EXTRA_CASES``: ALiBi, windows,
length-dependent RoPE, KV sharing) a tiny config is built from the config class's defaults (2 layers,
hidden 32, 4 heads, vocab 96, small MoE/MLA sizes, windows and chunks of 16 tokens), then, per variant
(float64 and float32; eager and sdpa attention; LoRA on a few families):

* ``TreeExecutor(model)``: a ``ValueError`` here is a refusal (its message is the reason);
* log-probs and gradients of a sequence-level loss over a small trie (a shared prefix, sibling leaves whose
  packed row is longer than the window, a sequence that is a prefix of another, a duplicate), walked with
  block size 4 (chunked backward) and with one big block (packed leaves), against the model's own dense
  forward/backward per sequence;
* sequences longer than the model's attention window: refused at the call, or exact.

Verdicts: ``exact`` (float64: log-prob error <= 1e-6 and gradient error <= 1e-5, relative to the largest
value, per tensor; float32: 1e-4 / 1e-3), ``refused`` (with the reason), ``not built`` (the generic tiny
config does not make a working model of that type: composite vision/audio models too slow to build,
configs with extra constraints; it says nothing about the walk), ``n/a`` for a variant the model itself
does not run (an attention implementation it does not offer, a dtype its own forward fails in) and
``WRONG`` / ``CRASH`` (a bug: the walk ran and gave a different answer, or raised something else). HF
computes some attention internals in float32 even in a float64 model, so float64 errors of ~1e-7 are
expected; the tolerances above sit well above that and far below a structural mistake (>= 1e-3).

``--readme`` rewrites the table between the ``<!-- arch-sweep:begin/end -->`` markers of the README.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl_dta import PrefixTrie, TreeExecutor

VOCAB = 96
WINDOW = 16  # attention window / chunk given to models that have one: the trie's packed rows exceed it
TOLERANCE = {torch.float64: (1e-6, 1e-5), torch.float32: (1e-4, 1e-3)}  # (log-probs, gradients)


def tolerance(dtype, has_states: bool) -> tuple[float, float]:
    """(log-probs, gradients) tolerance; transformers' state-layer kernels compute in float32 even in a
    float64 model, so hybrid and state-space models get float32's."""
    return TOLERANCE[torch.float32 if has_states else dtype]


# Shrunk sizes; a key is set only if the config class knows it (``attribute_map`` aliases included).
TINY = dict(  # noqa: C408 - keyword style keeps the long list readable
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    # other spellings (encoder-decoder style, GPT-J style)
    d_model=32, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
    decoder_ffn_dim=48, encoder_ffn_dim=48, num_layers=2, ffn_hidden_size=48, n_positions=256, num_heads=4,
    rotary_dim=4, head_dim=8, intermediate_size=48, max_position_embeddings=256, initializer_range=0.2,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    n_shared_experts=1, shared_expert_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1,
    moe_num_experts=4, moe_topk=2, num_shared_experts=1, output_router_logits=False,
    # MLA (DeepSeek-V2/V3 style)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    # windows and chunks: small enough that the test tries exceed them
    sliding_window=WINDOW, window_size=WINDOW, attention_chunk_size=WINDOW,
    # no dropout anywhere (the walk refuses active dropout; the models run in eval mode anyway)
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    attention_types=[[["global", "local"], 1]],  # GPT-Neo: one global, one local layer
    # per-layer embeddings (Gemma 3n/4), linear attention heads, other spellings of the sizes
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, num_kv_shared_layers=0,
    activation_sparsity_pattern=None, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, ffn_dim=48, attention_heads=4,
    # state-space layers: small states and scan chunks (a 256-token chunk pads every tiny call to 256)
    state_size=16, ssm_state_size=16, mamba_d_state=16, chunk_size=8, mamba_chunk_size=8, n_groups=1,
    mamba_n_groups=1, mamba_n_heads=4, mamba_num_heads=4, mamba_d_head=16, mamba_head_dim=8, mamba_d_ssm=64,
)  # fmt: skip

# Cases beyond each model type's defaults: the settings that change what the walk must do.
_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
_LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": WINDOW,
    "short_factor": [1.0] * 4, "long_factor": [2.0, 3.0, 4.0, 5.0],
}  # fmt: skip
EXTRA_CASES = {
    "falcon (alibi)": ("falcon", {"alibi": True}),
    "qwen2 (sliding window)": (
        "qwen2",
        {"use_sliding_window": True, "max_window_layers": 1, "layer_types": None},
    ),
    "llama (dynamic RoPE)": ("llama", {"rope_parameters": _DYNAMIC, "max_position_embeddings": WINDOW}),
    "phi3 (longrope)": (
        "phi3",
        {
            "rope_parameters": _LONGROPE,
            "max_position_embeddings": 4 * WINDOW,
            "sliding_window": None,
            "original_max_position_embeddings": WINDOW,
        },
    ),
    "lfm2 (conv layers)": ("lfm2", {"layer_types": ["conv", "full_attention"]}),
    "gemma3n_text (KV sharing)": (
        "gemma3n_text",
        {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "layer_types": None},
    ),
}
# the quick subset of the default test run: one of each kind of behaviour
QUICK = [
    "llama", "mistral", "starcoder2", "phi3", "mixtral", "qwen2 (sliding window)", "gemma2", "gpt_neo", "mpt",
    "bloom", "falcon (alibi)", "gpt2", "llama4_text", "qwen3_5_text", "deepseek_v3", "bart", "bert",
    "llama (dynamic RoPE)", "phi3 (longrope)", "lfm2 (conv layers)",
]  # fmt: skip
LORA = {"llama", "qwen3", "mistral", "gpt2", "mpt", "gemma2"}
SECONDS_PER_CHECK = 30  # a model whose tiny build or check takes longer is reported as not built
# model types whose default config does not build a model without a few more settings
TYPE_OVERRIDES = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "mamba2": {"num_heads": 8, "head_dim": 8},  # heads x head_dim = expand x hidden
}


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


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, **overrides):
    """The config class's defaults with the sizes of ``TINY`` (only keys it knows) and ``overrides``."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    default = AutoConfig.for_model(model_type)
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    if not isinstance(default, model_cls.config_class):  # a composite config: the LM takes its text part
        default = default.get_text_config(decoder=True)
    cls = type(default)
    kwargs = {k: v for k, v in {**TINY, **overrides}.items() if _knows(default, k)}
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:  # MLA: the rotary part is head_dim wide
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    if "kv_lora_rank" in kwargs and "num_key_value_heads" in kwargs:  # MLA has no grouped K/V heads
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or []))
    if kinds and "layer_types" not in overrides:  # keep two different kinds if the model mixes them
        kwargs["layer_types"] = [kinds[0], kinds[-1]] if len(kinds) > 1 else [kinds[0]] * 2
    if "rope_parameters" in overrides:
        kwargs["rope_parameters"] = overrides["rope_parameters"]
    for _ in range(len(kwargs) + 1):  # drop the keys a config refuses to take (derived properties, ...)
        try:
            config = cls(**kwargs)
            break
        except Exception as e:
            culprit = next((k for k in kwargs if re.search(rf"\b{k}\b", str(e))), None)
            if culprit is None and "layer_types" not in kwargs:
                raise
            kwargs.pop(culprit or "layer_types")
    if (
        getattr(config, "layer_types", None) is not None
        and len(config.layer_types) != config.num_hidden_layers
    ):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    return config


def _knows(config, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - a property that cannot be computed on a default config
        return False


def build(model_type: str, dtype, attn: str, seed: int = 0, **overrides):
    """The auto mapping's causal-LM class for ``model_type`` on its tiny config, in ``dtype``, eval mode."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type, **{**TYPE_OVERRIDES.get(model_type, {}), **overrides})
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # float64 needs eager MoE experts (torch's grouped_mm takes no float64)
        experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
        try:
            model = cls._from_config(config, attn_implementation=attn, **experts)
        except (ValueError, TypeError) as e:
            if not experts or "expert" not in str(e):
                raise
            model = cls._from_config(config, attn_implementation=attn)
    return model.to(dtype).eval()


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


def rel_err(got: list | dict, ref: list | dict) -> float:
    """max over tensors of max|got - ref| / max|ref| (a tensor whose reference is ~0 against the largest)."""
    if isinstance(ref, dict):
        assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())
        got, ref = list(got.values()), [ref[k] for k in got]
    overall = max(r.abs().max().item() for r in ref)
    errs = []
    for g, r in zip(got, ref, strict=True):
        scale = r.abs().max().item()
        errs.append((g - r).abs().max().item() / (scale if scale > 1e-6 * overall else overall))
    return max(errs)


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
    except Exception as e:  # noqa: BLE001 - any failure to build means "not in the sweep"
        unsupported = "does not support an attention implementation" in str(e)
        result.verdict = "n/a" if unsupported else "no tiny build"
        result.detail = (
            f"{attn} not supported by the model" if unsupported else f"{type(e).__name__}: {_short(e)}"
        )
        return result
    seqs = trie_sequences()
    loss_fn = _loss_fn(seqs)
    try:
        executors = [
            TreeExecutor(model, block_size=4),
            TreeExecutor(model, block_size=1000, batch_tokens=1000),
        ]
    except ValueError as e:
        result.verdict, result.detail = "refused", _short(e)
        return result
    except Exception as e:  # noqa: BLE001
        result.verdict, result.detail = "CRASH", f"at construction: {type(e).__name__}: {_short(e)}"
    try:  # a model that fails its own dense forward is not the walk's business
        ref_lp, ref_grads = dense(model, seqs, loss_fn)
    except Exception as e:  # noqa: BLE001
        result.verdict, result.detail = (
            "n/a",
            f"the model's own forward fails: {type(e).__name__}: {_short(e)}",
        )
        return result
    if result.verdict == "CRASH":
        return result
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
            result.logp_err = max(result.logp_err, rel_err(got_lp, ref_lp))
            result.grad_err = max(result.grad_err, rel_err(got_grads, ref_grads))
    except Exception as e:  # noqa: BLE001
        result.verdict, result.detail = "CRASH", f"{type(e).__name__}: {_short(e)}"
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
    except ValueError as e:
        return f"refused: {_short(e)}"
    with torch.no_grad():
        ref, _ = [], None
        for seq in seqs:
            ids = torch.tensor(seq)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
            ref.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
    err = rel_err(got, ref)
    return "exact" if err <= tolerance(dtype, executor.lm.has_states)[0] else f"WRONG ({err:.1e})"


def _short(e: Exception, n: int = 300) -> str:
    text = re.sub(r"\s+", " ", str(e)).strip()
    return text[:n] + ("..." if len(text) > n else "")


def cases(names: list[str] | None = None) -> dict[str, tuple[str, dict]]:
    """label -> (model_type, config overrides): every causal-LM model type, then ``EXTRA_CASES``."""
    everything = {t: (t, {}) for t in causal_lm_types()} | EXTRA_CASES
    return everything if not names else {n: everything[n] for n in names}


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


def summarize(results: list[Result]) -> tuple[str, str]:
    """One verdict for a case and the reason or the worst errors, for the README table."""
    own = [r for r in results if r.verdict == "refused" and "own forward fails on a plain input" in r.detail]
    if own and len(own) < len([r for r in results if r.verdict != "n/a"]):  # e.g. only float64 fails
        for r in own:
            r.verdict, r.detail = "n/a", "the model's own forward fails"
    verdicts = {r.verdict for r in results} - {"n/a"}
    if verdicts & {"WRONG", "CRASH"}:
        bad = next(r for r in results if r.verdict in ("WRONG", "CRASH"))
        return bad.verdict, f"{bad.variant}: {bad.detail or ''} {bad.long}".strip()
    if verdicts <= {"no tiny build"}:
        return "not built", _short(results[0].detail.replace("_Timeout: ", "too slow for a tiny build: "), 90)
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


def readme_table(rows: dict[str, tuple[str, str]]) -> str:
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
        f"Generated by `python benchmarks/arch_sweep.py --readme README.md` (transformers "
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


def write_readme(path: str, table: str) -> None:
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
    parser.add_argument("--readme", default="", help="rewrite the Supported models table in this README")
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
        write_readme(args.readme, readme_table(rows))
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
    if args.readme:
        write_readme(args.readme, readme_table(rows))
    return 1 if any(r.verdict in ("WRONG", "CRASH") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
