"""The asynchronous trainer's install, checked where a user starts: a fresh venv holding only torch and the
project installed with the README's line for :class:`~trl_dta.AsyncTreePPOTrainer` (``make test-install``
builds it and runs this script; ``.ci/run`` runs that target).

What it checks, with no network, no vLLM and no server:

1. the HTTP clients TRL's asynchronous trainer and its rollout worker import (``requests``, ``aiohttp``)
   are installed;
2. ``AsyncTreePPOTrainer`` is built against a model directory (a tiny Qwen3 saved here) with TRL's two
   extension points filled by the project's offline fixtures (a rollout worker over a queue, no weight
   sync): no ImportError, and TRL's ``__init__`` reaches no server;
3. without vLLM in the venv, the one thing TRL's own rollout worker asks for is vLLM (the ``vllm`` extra on
   CUDA, ``make venv-vllm`` on a CPU), named in its message.

Exits non-zero with the reason on the first failure.
"""

from __future__ import annotations

import sys
import tempfile
import time


def main() -> None:
    started = time.time()
    from trl.import_utils import is_aiohttp_available, is_requests_available, is_vllm_available

    clients = {"requests": is_requests_available(), "aiohttp": is_aiohttp_available()}
    missing = [name for name, installed in clients.items() if not installed]
    if missing:
        sys.exit(f"not installed by the async install line: {', '.join(missing)}")

    from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer
    from trl_dta.testing.async_grpo import NoWeightTransfer, QueueWorker
    from trl_dta.testing.grpo import make_dataset, tiny_model, tiny_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = f"{tmp}/tiny_qwen3"
        tiny_model(seed=0).save_pretrained(model_dir)
        args = AsyncTreePPOConfig(
            output_dir=f"{tmp}/out", use_cpu=True, bf16=False, report_to=[], save_strategy="no",
            per_device_train_batch_size=2, max_steps=1,
        )  # fmt: skip

        def build(**extension_points):
            return AsyncTreePPOTrainer(
                model_dir, args=args, processing_class=tiny_tokenizer(), train_dataset=make_dataset(2),
                **extension_points,
            )  # fmt: skip

        trainer = build(rollout_worker=QueueWorker([]), weight_transfer=NoWeightTransfer())
        print(f"built {type(trainer).__name__} from {model_dir} in {time.time() - started:.1f} s")

        if is_vllm_available():
            print("vLLM is installed: TRL's own rollout worker not checked here (make test-vllm runs it)")
            return
        try:
            build(weight_transfer=NoWeightTransfer())
        except ImportError as error:
            if "vllm" not in str(error).lower():
                sys.exit(f"TRL's rollout worker needs something besides vLLM: {error}")
            print(f"without vLLM, TRL's own rollout worker asks for it: {error}")
        else:
            sys.exit("TRL's rollout worker was built without vLLM: the check's premise changed, update it")


if __name__ == "__main__":
    main()
