"""The asynchronous τ² recipe (recipes/ppo_tau2_async.py): its configs parse, the commands in their headers
agree with their keys (the server serves the trained model, holds enough adapters, the GPUs of the server and
of the trainers are disjoint), and bad settings are refused before anything is loaded. No network, no
server, no model."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "ppo_tau2_async.py"
CONFIGS = REPO / "recipes" / "configs"
GPU_CONFIG = CONFIGS / "ppo_tau2_async_qwen3_gpu.yaml"
CPU_CONFIG = CONFIGS / "ppo_tau2_async_mock_cpu.yaml"


def _load_recipe():
    spec = importlib.util.spec_from_file_location("ppo_tau2_async_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


recipe = _load_recipe()


def _parse(*argv):
    saved = dict(os.environ)  # TrlParser exports the YAML's `env:` block
    try:
        return recipe.make_parser().parse_args_and_config(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _cpu(*argv):
    return (*argv, "--bf16", "false") if not torch.cuda.is_available() else argv


def _header(path: Path) -> str:
    """The YAML's leading comment block, continuation lines joined."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return re.sub(r"\s+", " ", " ".join(lines).replace("\\", " "))


def test_gpu_config_parses_and_its_commands_split_the_gpus(tmp_path):
    script, train, model = _parse(*_cpu("--config", str(GPU_CONFIG), "--output_dir", str(tmp_path)))
    assert type(train).__name__ == "AsyncTreePPOConfig"
    assert model.model_name_or_path == "Qwen/Qwen3-1.7B" and not hasattr(model, "dtype")
    assert script.domain == "retail" and not script.warm_start_steps and script.tool_latency == 0
    assert train.max_staleness == 4 and train.tree_attn_implementation == "sdpa" and train.dtype == "float32"
    assert train.vllm_server_base_url == "http://127.0.0.1:8000" and train.output_dir == str(tmp_path)
    header = _header(GPU_CONFIG)
    server = re.search(r"CUDA_VISIBLE_DEVICES=(\S+) trl vllm-serve --model (\S+) --port (\d+)", header)
    trainer = re.search(
        r"CUDA_VISIBLE_DEVICES=(\S+) accelerate launch .*?--num_processes (\d+) recipes/", header
    )
    assert server and trainer, header
    serving, training = set(server[1].split(",")), set(trainer[1].split(","))
    assert not serving & training and len(training) == int(trainer[2])  # one process per training GPU
    assert server[2] == model.model_name_or_path and train.vllm_server_base_url.endswith(":" + server[3])
    assert f"--config {GPU_CONFIG.relative_to(REPO)}" in header
    lora = re.search(r"--max-lora-rank (\d+) --max-loras (\d+).*?--lora_r (\d+)", header)
    assert lora and int(lora[1]) >= int(lora[3]) and int(lora[2]) >= train.max_staleness + 2


def test_cpu_config_parses_and_its_server_serves_the_trained_model(tmp_path):
    script, train, model = _parse(*_cpu("--config", str(CPU_CONFIG), "--output_dir", str(tmp_path)))
    assert script.domain == "mock" and script.synthetic_tasks == 32 and script.tool_latency == 0.2
    assert script.greedy_eval and not script.greedy_eval_steps
    assert model.use_peft and model.lora_dropout == 0.0 and train.bf16 is False
    assert train.num_generations == 4 and train.per_device_train_batch_size == 8
    header = _header(CPU_CONFIG)
    server = re.search(r"api_server --model (\S+) --host (\S+) --port (\d+)", header)
    assert server and server[1] == model.model_name_or_path
    assert train.vllm_server_base_url == f"http://{server[2]}:{server[3]}"
    assert int(re.search(r"--max-lora-rank (\d+)", header)[1]) >= model.lora_r
    assert int(re.search(r"--max-loras (\d+)", header)[1]) >= train.max_staleness + 2  # TRL's check
    assert "--enable-lora" in header and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in header
    assert f"--config {CPU_CONFIG.relative_to(REPO)}" in header
    recipe.check_settings(script, train, model)  # the CPU config passes the startup checks here


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--warm_start_steps", "1"], "cannot be warm-started here"),
        (["--no_tree"], "FA3 kernel"),
        (["--greedy_eval", "--greedy_eval_steps", "2"], "once, after training"),
        (["--tool_latency", "-0.5"], "--tool_latency is seconds >= 0"),
        (["--domain", "retail", "--synthetic_tasks", "4"], "use it with --domain mock"),
        (["--token_budget", "4096"], "token_budget"),
    ],
)
def test_bad_settings_are_refused_at_parsing(argv, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        _parse(*_cpu("--config", str(CPU_CONFIG), "--output_dir", str(tmp_path), *argv))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--vllm_server_base_url", "127.0.0.1:8000"], "http\\(s\\) address"),
        (["--max_staleness", "-1"], "max_staleness must be >= 0"),
        (["--lora_target_modules", "lm_head"], "lm_head"),
    ],
)
def test_bad_settings_are_refused_before_anything_loads(argv, match, tmp_path, monkeypatch):
    args = _parse(*_cpu("--config", str(CPU_CONFIG), "--output_dir", str(tmp_path), *argv))
    loaded = []
    monkeypatch.setattr(recipe, "setup_logging", loaded.append)  # the first thing main does after the checks
    with pytest.raises(ValueError, match=match):
        recipe.main(*args)
    assert loaded == [] and not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="full-weight sync is refused only without CUDA")
def test_full_weight_sync_is_refused_without_cuda(tmp_path):
    args = _parse(*_cpu("--config", str(CPU_CONFIG), "--output_dir", str(tmp_path), "--use_peft", "false"))
    with pytest.raises(ValueError, match="NCCL \\(GPU only"):
        recipe.check_settings(*args)


def test_overlap_paper_model_by_hand(tmp_path):
    """benchmarks/async_overlap.py's GPU split on paper, against the arithmetic done by hand for one case."""
    import argparse
    import json

    import async_overlap

    launch = {"assumptions": {"launch_us": 5.0}, "shapes": [{"scale": 1.0, "walk": [
        {"kernel": "sdpa", "memory": "80 GB GPU", "predicted_speedup": 2.5}]}]}  # fmt: skip
    path = tmp_path / "launch_model.json"
    path.write_text(json.dumps(launch))
    out = async_overlap.paper(
        argparse.Namespace(
            launch_json=str(path), walk_speedup="", gpus=8, utilisation=[1.0, 0.5], proximal_pass=1 / 3
        )
    )
    rows = {(r["model"], r["u_sync"]): r for r in out["rows"]}
    assert len(rows) == 4
    r = rows["Qwen3-1.7B", 1.0]  # generation 1 GPU-s per step, dense training 1.28, the walk 1.28 / 2.5
    assert r["sync_walk"] == pytest.approx((1 + 1.28) / (1 + 0.512))
    assert r["split"] == "5 gen + 3 train" and r["async_walk"] == pytest.approx((1 + 1.28) / 8 / (1 / 5))
    assert r["async_trainer_wait_share"] == pytest.approx(1 - (0.512 / 3) / (1 / 5))
    # a separate proximal forward (a third of the walk) on the training side: 5 + 3 still, training-bound
    assert r["proximal_split"] == "5 gen + 3 train"
    assert r["async_walk_proximal"] == pytest.approx((1 + 1.28) / 8 / (0.512 * 4 / 3 / 3))
    half = rows["Qwen3-1.7B", 0.5]  # the synchronous engine idle half its phase: async is not
    assert (
        half["async_walk"] == pytest.approx((2 + 1.28) / 8 / (1 / 5))
        and half["async_walk"] > half["sync_walk"]
    )
