"""What the peer benchmark runs: random-weight Qwen3 models, and one optimizer step's rollouts per shape
(single-level GRPO groups, τ²-shaped multi-turn groups, one growing group for the memory sweep)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from trl_dta import PrefixTrie

# Random-weight Qwen3 shapes. "cpu": the shape benchmarks/executor.py uses (the 32k vocabulary makes the LM
# head and the fp32 logits dominate, as in small real models). Qwen3-0.6B/1.7B: the published configs.
MODELS = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 4096,
        "tie_word_embeddings": False,
    },
    "cpu": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 32_000,
        "tie_word_embeddings": False,
    },
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151_936,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151_936,
        "tie_word_embeddings": True,
    },
}


def approx_params(name: str) -> int:
    """Parameters of ``MODELS[name]`` (embeddings, attention and MLP weights; norms left out)."""
    p = MODELS[name]
    embeddings = p["vocab_size"] * p["hidden_size"] * (1 if p["tie_word_embeddings"] else 2)
    attention = (
        p["hidden_size"] * p["head_dim"] * (2 * p["num_attention_heads"] + 2 * p["num_key_value_heads"])
    )
    return embeddings + p["num_hidden_layers"] * (attention + 3 * p["hidden_size"] * p["intermediate_size"])


def make_model(name: str, device, dtype, attn: str) -> torch.nn.Module:
    """``MODELS[name]`` as a Qwen3 with random weights (seed 0), in eval mode."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**MODELS[name], max_position_embeddings=40_960, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()  # dropout off (the walk requires it; dense is compared with it)


@dataclass
class Workload:
    """One optimizer step's rollouts: GRPO groups of (prompt, completions). A row = prompt + completion."""

    name: str
    kind: str
    groups: list[tuple[list[int], list[list[int]]]]
    advantages: torch.Tensor = field(repr=False)

    @property
    def rows(self) -> list[tuple[list[int], int]]:  # (sequence, prompt length), group-major
        return [(p + c, len(p)) for p, cs in self.groups for c in cs]

    @property
    def num_rows(self) -> int:
        return sum(len(cs) for _, cs in self.groups)

    def stats(self) -> dict:
        trie = PrefixTrie.from_sequences([s for s, _ in self.rows])
        pg_tokens = sum(len(p) + sum(map(len, cs)) for p, cs in self.groups)
        return {
            "shape": self.name,
            "kind": self.kind,
            "groups": len(self.groups),
            "rows": self.num_rows,
            "leaves": trie.num_leaves,
            "tokens": trie.num_tokens,
            "unique": trie.num_unique_tokens,
            "dedup": trie.dedup_ratio,
            "pg_tokens": pg_tokens,
            "pg_dedup": trie.num_tokens / pg_tokens,
            "longest": trie.max_depth,
        }


def _advantages(rng, groups: int, size: int) -> torch.Tensor:
    """Random rewards standardised within each group, as GRPO does."""
    r = torch.as_tensor(rng.normal(size=(groups, size)), dtype=torch.float32)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()


def grpo_shape(name, vocab, prompt, group, completion, groups=1, seed=0) -> Workload:
    """Single-level GRPO: per group one prompt, ``group`` completions of U[c/2, 3c/2] tokens."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, vocab, size=int(n)).tolist()
    gs = [
        (rand(prompt), [rand(rng.integers(completion // 2, completion * 3 // 2 + 1)) for _ in range(group)])
        for _ in range(groups)
    ]
    return Workload(name, "grpo", gs, _advantages(rng, groups, group))


def tau2_shape(name, vocab, tasks, group, system, prompt, turn, final, seed=0) -> Workload:
    """τ²-shaped multi-turn step: a system prompt + tool schemas shared by every task; per task a user
    prompt (TRL's prompt = system + user); the completion is a first tool-call turn + tool response shared by
    half the group, a second one shared by a quarter, then each rollout's own final turns (U[f/2, 3f/2])."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, vocab, size=int(n)).tolist()
    sys_tokens, gs = rand(system), []
    for _ in range(tasks):
        halves = [rand(turn) for _ in range(2)]
        quarters = [rand(turn) for _ in range(4)]
        comps = [
            halves[2 * r // group]
            + quarters[4 * r // group]
            + rand(rng.integers(final // 2, final * 3 // 2 + 1))
            for r in range(group)
        ]
        gs.append((sys_tokens + rand(prompt), comps))
    return Workload(name, "tau2", gs, _advantages(rng, tasks, group))


_LENGTHS = ("prompt", "completion", "system", "turn", "final")


def _scaled(kwargs: dict, scale: float) -> dict:
    return {k: (max(2, int(v * scale)) if k in _LENGTHS else v) for k, v in kwargs.items()}


def shapes_for(profile: str, vocab: int, scale: float = 1.0) -> list[Workload]:
    """The profile's shapes; ``scale`` multiplies every length (a dry run of a big profile on a CPU)."""
    g, t = (
        (lambda *a, **k: grpo_shape(*a, vocab=vocab, **_scaled(k, scale))),
        (lambda *a, **k: tau2_shape(*a, vocab=vocab, **_scaled(k, scale))),
    )
    if profile == "quick":
        return [
            g("grpo-128-g4", prompt=128, group=4, completion=32),
            t("tau2-tiny", tasks=2, group=4, system=96, prompt=16, turn=16, final=24),
            g("long-512-g2", prompt=512, group=2, completion=32),
        ]
    if (
        profile == "cpu"
    ):  # scaled down for 2 shared CPU cores: prompts 0.5-3k, 4-16 completions, ~8-13k tokens
        return [
            g("grpo-512-g16", prompt=512, group=16, completion=64),
            g("grpo-1k-g8", prompt=1024, group=8, completion=128),
            g("grpo-2k-g4", prompt=2048, group=4, completion=64),
            t("tau2-2x8", tasks=2, group=8, system=384, prompt=64, turn=96, final=96),
            g("long-3k-g4", prompt=3072, group=4, completion=128),
        ]
    if profile == "gpu":  # 4k-16k contexts
        return [
            g("grpo-4k-g16", prompt=4096, group=16, completion=512),
            g("grpo-8k-g8", prompt=8192, group=8, completion=1024),
            t("tau2-2x8-10k", tasks=2, group=8, system=6144, prompt=512, turn=1024, final=2048),
            g("long-16k-g4", prompt=16384, group=4, completion=1024),
        ]
    raise ValueError(profile)


def leaves_sweep(
    profile: str, vocab: int, scale: float = 1.0, leaves: list[int] | None = None
) -> list[Workload]:
    """One GRPO group with a growing number of completions: peak memory against the number of leaves."""
    prompt, completion, sizes = {
        "quick": (128, 32, [2, 4, 8]),
        "cpu": (256, 64, [2, 4, 8, 16, 32]),
        "gpu": (4096, 512, [2, 4, 8, 16, 32]),
    }[profile]
    prompt, completion = max(2, int(prompt * scale)), max(2, int(completion * scale))
    sizes = leaves or sizes
    return [grpo_shape(f"leaves-{n}", vocab, prompt, n, completion, seed=n) for n in sizes]
