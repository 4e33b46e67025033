"""Tiny random models of every causal-LM architecture of transformers' auto mapping.

``build(model_type, dtype, attn, **overrides)`` makes the auto mapping's causal-LM class for a model type on
a tiny config: the config class's defaults with the sizes of ``TINY`` (2 layers, hidden 32, 4 heads, vocab
96, small MoE/MLA/state sizes, windows and chunks of ``WINDOW`` tokens), then the case's overrides.
``cases()`` lists every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` plus ``EXTRA_CASES`` (ALiBi,
windows, length-dependent RoPE, KV sharing); ``QUICK`` is one case per behaviour the walk must get right.

Used by ``trl_dta.testing.exactness`` (the walk against each model's own dense forward/backward), by
``tests/test_architectures.py`` and by ``benchmarks/arch_sweep.py`` (the sweep over every case and the
model table in docs/supported-models.md). transformers is imported only when a model is built.
"""

from __future__ import annotations

import re
import warnings

import torch

VOCAB = 96
WINDOW = 16  # attention window / chunk given to models that have one: the trie's packed rows exceed it
# a tiny model has ~0.1M parameters, a few multimodal configs keep a full-size part the tiny sizes miss:
# up to 1B (8 GB in float64) they are tried, larger ones would fill a 24 GB machine before the time limit
MAX_PARAMETERS = 1_000_000_000


# Shrunk sizes; a key is set only if the config class knows it (``attribute_map`` aliases included).
TINY = dict(  # noqa: C408 - keyword style keeps the long list readable
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    # other spellings (encoder-decoder style, GPT-J style)
    d_model=32,
    decoder_layers=2,
    encoder_layers=2,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    decoder_ffn_dim=48,
    encoder_ffn_dim=48,
    num_layers=2,
    ffn_hidden_size=48,
    n_positions=256,
    num_heads=4,
    rotary_dim=4,
    head_dim=8,
    intermediate_size=48,
    max_position_embeddings=256,
    initializer_range=0.2,
    # MoE
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    shared_expert_intermediate_size=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    moe_num_experts=4,
    moe_topk=2,
    num_shared_experts=1,
    output_router_logits=False,
    # MLA (DeepSeek-V2/V3 style)
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    # windows and chunks: small enough that the test tries exceed them
    sliding_window=WINDOW,
    window_size=WINDOW,
    attention_chunk_size=WINDOW,
    # no dropout anywhere (the walk refuses active dropout; the models run in eval mode anyway)
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attention_types=[[["global", "local"], 1]],  # GPT-Neo: one global, one local layer
    # per-layer embeddings (Gemma 3n/4), linear attention heads, other spellings of the sizes
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
    num_kv_shared_layers=0,
    activation_sparsity_pattern=None,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    ffn_dim=48,
    attention_heads=4,
    # state-space layers: small states and scan chunks (a 256-token chunk pads every tiny call to 256)
    state_size=16,
    ssm_state_size=16,
    mamba_d_state=16,
    chunk_size=8,
    mamba_chunk_size=8,
    n_groups=1,
    mamba_n_groups=1,
    mamba_n_heads=4,
    mamba_num_heads=4,
    mamba_d_head=16,
    mamba_head_dim=8,
    mamba_d_ssm=64,
)

# Cases beyond each model type's defaults: the settings that change what the walk must do.
_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": WINDOW,
    "short_factor": [1.0] * 4,
    "long_factor": [2.0, 3.0, 4.0, 5.0],
}
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
    "llama",
    "mistral",
    "starcoder2",
    "phi3",
    "mixtral",
    "qwen2 (sliding window)",
    "gemma2",
    "gpt_neo",
    "mpt",
    "bloom",
    "falcon (alibi)",
    "gpt2",
    "llama4_text",
    "qwen3_5_text",
    "deepseek_v3",
    "bart",
    "bert",
    "llama (dynamic RoPE)",
    "phi3 (longrope)",
    "lfm2 (conv layers)",
]
# model types whose default config does not build a model without a few more settings
TYPE_OVERRIDES = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "mamba2": {"num_heads": 8, "head_dim": 8},  # heads x head_dim = expand x hidden
}


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
        _check_size(cls, config, attn)
        # float64 needs eager MoE experts (torch's grouped_mm takes no float64)
        experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
        try:
            model = cls._from_config(config, attn_implementation=attn, **experts)
        except (ValueError, TypeError) as e:
            if not experts or "expert" not in str(e):
                raise
            model = cls._from_config(config, attn_implementation=attn)
    return model.to(dtype).eval()


def _check_size(cls, config, attn: str) -> None:
    """Refuse a config the tiny sizes did not reach (e.g. a nested text or vision config of full size, as
    Fuyu's): counted on the meta device, before a real build could fill the machine's memory."""
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in cls._from_config(config, attn_implementation=attn).parameters())
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: the real build decides
        return
    if params > MAX_PARAMETERS:
        raise ValueError(
            f"the tiny config still has {params / 1e9:.1f}B parameters (a part the tiny sizes do not reach); "
            f"the sweep builds models of at most {MAX_PARAMETERS / 1e9:.0f}B"
        )


def cases(names: list[str] | None = None) -> dict[str, tuple[str, dict]]:
    """label -> (model_type, config overrides): every causal-LM model type, then ``EXTRA_CASES``."""
    everything = {t: (t, {}) for t in causal_lm_types()} | EXTRA_CASES
    return everything if not names else {n: everything[n] for n in names}
