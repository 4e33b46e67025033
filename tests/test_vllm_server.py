"""vLLM's server mode on CPU: what runs, and what TRL keeps for CUDA.

One server (``python -m vllm.entrypoints.openai.api_server``, :class:`trl_dta.testing.vllm_server.VLLMServer`,
127.0.0.1, a free port, LoRA enabled) serves the tiny Qwen3 saved to disk, fp32, for the whole module; it is
stopped by its process id at the end, every wait bounded.

* Generation through the server with TRL's own client (``trl.generation.vllm_client.VLLMClient``'s
  ``generate``, what GRPOTrainer's server mode calls): the sampled tokens' log-probs equal the model's.
* LoRA adapters by path (what TRL's ``AsyncGRPOTrainer`` syncs: a PEFT adapter saved to a directory, loaded
  with ``/v1/load_lora_adapter`` by its client, then requested by name): the server's log-probs follow the
  adapter, version after version.
* GPU-only: GRPOTrainer's (and so TreePPOTrainer's) server mode pushes the full weights over vLLM's NCCL
  weight-transfer engine; TRL refuses to build the trainer without a CUDA device for it.

Needs vLLM (``make venv-vllm``; ``make test-vllm``); skipped where it is not installed.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

import requests  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_dta.testing.grpo import make_config, make_dataset, reward_fn, tiny_tokenizer  # noqa: E402
from trl_dta.testing.vllm import fixed_sequence, model_logprobs, save_tiny_model  # noqa: E402
from trl_dta.testing.vllm_server import VLLMServer  # noqa: E402

TOLERANCE = 1e-4  # log-probs, server vs model (absolute; fp32 both)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("vllm_server") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    # as `trl vllm-serve` would start it (NCCL weight transfer: the server starts on CPU; only the trainer's
    # side needs CUDA), plus runtime LoRA loading
    with VLLMServer(
        model_dir, "--weight-transfer-config", '{"backend": "nccl"}', "--enable-lora", "--max-lora-rank", "8",
        "--max-model-len", "1024", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    ) as running:  # fmt: skip
        yield running
    assert running.process is None


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _server_logprobs(server, name: str, ids: list[int]) -> torch.Tensor:
    """The log-probs of ``ids[1:]`` the server computes with model (or adapter) ``name``."""
    response = requests.post(
        f"{server.base_url}/v1/completions",
        json={"model": name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0},
        timeout=60,
    )
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([entries[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], dtype=torch.float64)


def test_generation_through_trl_client(server, model):
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=server.base_url, connection_timeout=30)
    prompt = fixed_sequence()[:-12]
    out = client.generate([prompt], n=4, max_tokens=16, temperature=1.0, logprobs=0)
    assert out["prompt_ids"] == [prompt] and len(out["completion_ids"]) == 4
    assert len({tuple(c) for c in out["completion_ids"]}) > 1  # sampled
    for completion, logprobs in zip(out["completion_ids"], out["logprobs"], strict=True):
        ours = model_logprobs(model, prompt + completion)[len(prompt) - 1 :]
        theirs = torch.tensor([lp[0] for lp in logprobs], dtype=torch.float64)
        assert (ours - theirs).abs().max() <= TOLERANCE


def test_lora_adapters_by_path(server, model, model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    client = VLLMClient(server.base_url, server_timeout=30)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(base, config).eval()
    ids = fixed_sequence()
    plain = model_logprobs(model, ids)
    for version in (1, 2):
        if version == 2:  # a "training step" on the adapters
            with torch.no_grad():
                for name, p in peft_model.named_parameters():
                    if "lora_B" in name:
                        p.mul_(-1.5)
        directory = tmp_path / f"adapter-v{version}"
        peft_model.save_pretrained(directory)
        client.load_lora_adapter(f"policy-v{version}", str(directory))
        ours = model_logprobs(peft_model, ids)
        theirs = _server_logprobs(server, f"policy-v{version}", ids)
        assert (ours - theirs).abs().max() <= TOLERANCE
        assert (ours - plain).abs().max() >= 100 * TOLERANCE  # the adapter changes the model
    client.unload_lora_adapter("policy-v1")
    assert (_server_logprobs(server, server.model, ids) - plain).abs().max() <= TOLERANCE  # base unchanged


@pytest.mark.parametrize("trainer", ["stock", "tree"])
def test_trainer_server_mode_needs_cuda(server, model_dir, trainer, tmp_path):
    """GRPOTrainer's server mode syncs full weights over vLLM's NCCL weight-transfer engine: TRL refuses to
    build the trainer without a CUDA device for it, stock TRL and TreePPOTrainer alike."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_dta import TreePPOConfig, TreePPOTrainer

    trainer_cls, config_cls = (
        (GRPOTrainer, GRPOConfig) if trainer == "stock" else (TreePPOTrainer, TreePPOConfig)
    )
    config = make_config(
        tmp_path, config_cls=config_cls, use_vllm=True, vllm_mode="server",
        vllm_server_base_url=server.base_url, vllm_server_timeout=30, max_steps=1,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="NCCL weight-transfer engine, which needs a CUDA device"):
        trainer_cls(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=reward_fn,
            args=config,
            train_dataset=make_dataset(2),
            processing_class=tiny_tokenizer(),
        )
