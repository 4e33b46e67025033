# GPU image for trl-dta training runs. Build: docker build -t trl-dta .
# The base image provides CUDA and torch 2.6.0 (satisfies torch>=2.6), so pip keeps that torch.
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-devel

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /workspace/trl-dta
COPY . .

# flash-attn (the `gpu` extra) builds against the installed torch, so it needs --no-build-isolation, which
# in turn needs the build tools present in the environment (setuptools>=77 also builds trl-dta itself).
# MAX_JOBS bounds compile memory when no prebuilt flash-attn wheel matches.
RUN pip install --upgrade "setuptools>=77" wheel packaging ninja psutil \
 && MAX_JOBS=4 pip install --no-build-isolation -e ".[gpu]"

CMD ["accelerate", "launch", "recipes/ppo_tau2.py", "--help"]
