"""The τ² SFT recipe (recipes/sft_tau2.py): its configs parse, and one optimizer step on a tiny model (no Hub,
no GGUF) trains with TreeSFTTrainer and, with --no_tree, with stock SFTTrainer to the same loss."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from recipe_utils.arguments import DOMAINS

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "sft_tau2.py"
CONFIGS = sorted((REPO / "recipes" / "configs").glob("sft_*.yaml"))


def _load_recipe():
    spec = importlib.util.spec_from_file_location("sft_tau2_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


recipe = _load_recipe()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_sft_config_parses(path, tmp_path):
    argv = ["--config", str(path), "--output_dir", str(tmp_path)]
    if not torch.cuda.is_available():
        argv += ["--bf16", "false"]
    saved = dict(os.environ)
    try:
        script, train, model = recipe.make_parser().parse_args_and_config(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert script.domain in DOMAINS and model.model_name_or_path
    assert type(train).__name__ == "TreeSFTConfig" and train.assistant_only_loss and train.max_length is None


def test_unsupported_domain_fails_at_startup():
    with pytest.raises(ValueError, match="telecom"):
        recipe.ScriptArguments(domain="telecom")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from trl_dta.testing.grpo import tiny_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny_sft_model")
    tok = copy.deepcopy(tiny_tokenizer())
    tok.model_max_length = 1 << 20  # τ² prompts are long in a 600-token vocabulary
    tiny_model(tok, seed=0, max_position_embeddings=1 << 14).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _run(model_dir, out, *extra):
    cmd = [sys.executable, str(RECIPE), "--config", str(REPO / "recipes/configs/sft_tau2_mock.yaml"),
           "--model_name_or_path", str(model_dir), "--output_dir", str(out), "--synthetic_tasks", "2",
           "--max_steps", "1", "--per_device_train_batch_size", "2", "--disable_tqdm", "true",
           *extra]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env = dict(os.environ, OMP_NUM_THREADS="1", **offline)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    state = json.loads((Path(out) / "trainer_state.json").read_text())
    (step,) = [r for r in state["log_history"] if "loss" in r]
    return step, proc


@pytest.mark.slow
def test_recipe_one_step_tree_and_stock(tiny_model_dir, tmp_path):
    tree, proc = _run(tiny_model_dir, tmp_path / "tree")
    assert "TreeSFTTrainer" in proc.stderr + proc.stdout
    assert tree["tree/dedup_ratio"] > 1.5  # per-turn samples of 2 conversations: each a prefix of the next
    assert (tmp_path / "tree" / "model.safetensors").is_file()
    stock, _ = _run(tiny_model_dir, tmp_path / "stock", "--no_tree")
    assert "tree/dedup_ratio" not in stock
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"):
        assert tree[key] == pytest.approx(stock[key], rel=1e-4), key
