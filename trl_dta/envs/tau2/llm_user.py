"""A τ²-bench user played by an LLM behind any OpenAI-compatible chat endpoint, through plain ``urllib`` (no
extra dependency). The tests never reach a network with it. The interface is described in :mod:`.users`."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from .users import AGENT_GREETING, scenario_fields

_GUIDELINES_FALLBACK = """# User Simulation Guidelines
You are playing the role of a customer contacting a customer service representative.
Your goal is to simulate realistic customer interactions while following specific scenario instructions.
- Generate one message at a time, maintaining natural conversation flow.
- Strictly follow the scenario instructions you have received.
- Never make up or hallucinate information not provided in the scenario instructions.
- Disclose information progressively. Wait for the agent to ask for specific information before providing it.
- If the instruction goal is satisfied, generate the '###STOP###' token to end the conversation.
- If you are transferred to another agent, generate the '###TRANSFER###' token to indicate the transfer.
- If the scenario does not provide enough information to continue, generate the '###OUT-OF-SCOPE###' token."""


def _tau2_guidelines() -> str:
    try:
        import tau2

        path = Path(tau2.__file__).parent / "data" / "tau2" / "user_simulator" / "simulation_guidelines.md"
        return path.read_text(encoding="utf-8")
    except Exception:  # noqa: BLE001 - tau2 missing or laid out differently: a condensed copy of them
        return _GUIDELINES_FALLBACK


def _scenario_text(instructions) -> str:
    if isinstance(instructions, str):
        return instructions
    obj = getattr(instructions, "user_scenario", None) or instructions
    if not isinstance(obj, dict) and hasattr(obj, "instructions"):
        return str(obj)  # τ²'s own rendering of the scenario
    f = scenario_fields(instructions)
    names = {
        "reason_for_call": "Reason for call",
        "known_info": "Known info",
        "unknown_info": "Unknown info",
        "task_instructions": "Task instructions",
    }
    return "\n".join(f"{names[k]}:\n\t{v}" for k, v in f.items() if v)


class LLMUser:
    """τ²'s user simulator prompt (simulation guidelines + ``<scenario>``) played by an LLM behind any
    OpenAI-compatible ``/chat/completions`` endpoint (vLLM, SGLang, llama.cpp server, OpenAI...), called with
    ``urllib`` (no extra dependency). Roles are flipped as in τ²: the agent's messages are sent as ``user``
    messages, the simulated user's as ``assistant`` messages. Network errors raise (the environment then ends
    the episode abnormally, reward 0).

    Args:
        base_url: Endpoint root, e.g. ``http://localhost:8000/v1``.
        model: Model name sent in the request.
        api_key: Sent as ``Authorization: Bearer <api_key>`` when given.
        temperature: Sampling temperature (τ² uses 0).
        max_tokens: Most tokens per user reply.
        timeout: Seconds per request.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 512,
        timeout: float = 120.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.messages: list[dict] = []
        self.opening = ""

    def reset(self, instructions, opening: str | None = None) -> str:
        system = f"{_tau2_guidelines()}\n\n<scenario>\n{_scenario_text(instructions)}\n</scenario>"
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": AGENT_GREETING}]
        self.opening = opening if opening is not None else self._complete()
        self.messages.append({"role": "assistant", "content": self.opening})
        return self.opening

    def respond(self, message: str) -> str:
        self.messages.append({"role": "user", "content": str(message)})
        reply = self._complete()
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def _complete(self) -> str:
        body = {
            "model": self.model,
            "messages": self.messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            f"{self.base_url}/chat/completions",
            data=json.dumps(body).encode(),
            headers=headers,
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            payload = json.loads(response.read().decode())
        return (payload["choices"][0]["message"].get("content") or "").strip()
