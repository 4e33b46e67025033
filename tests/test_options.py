"""Options as users type them: ``tree_memory_budget`` in every accepted form (Python, YAML, the command line
of each recipe), one bad value per ``tree_*`` option refused naming the option, and the recipes' ``--help``
(one default per option, accurate tree_* texts). No model is built."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from trl_dta import AsyncTreePPOConfig, TreePPOConfig, TreeSFTConfig
from trl_dta.walk.memory.budgets import AUTO_FRACTION, Budgets
from trl_dta.walk.memory.memory_budget import memory_share, parse_memory_budget

REPO = Path(__file__).resolve().parent.parent
CPU = () if torch.cuda.is_available() else ("--bf16", "false")

# (as typed, parsed): every accepted form
FORMS = [
    ("auto", "auto"),
    ("AUTO", "auto"),
    ("None", None),
    ("none", None),
    ("null", None),
    ("NULL", None),
    ("6e10", 6e10),
    ("8000000000", 8e9),
    ("8GB", 8e9),
    ("8gb", 8e9),
    ("1.5TB", 1.5e12),
    ("512 MB", 512e6),
    ("8GiB", 8 * 2**30),
    ("8gib", 8 * 2**30),
    ("512MiB", 512 * 2**20),
    ("4 KiB", 4096),
    ("80%", "80%"),
    ("12.5 %", "12.5%"),
    ("100%", "100%"),
]
BAD_BUDGETS = ["8G", "lots", "0", "-1GB", "0%", "101%", "inf", "nan", ""]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"options_{name}", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


RECIPES = {name: _load(name) for name in ("ppo_tau2", "ppo_tau2_async", "sft_tau2")}
CONFIGS = {"ppo_tau2": TreePPOConfig, "ppo_tau2_async": AsyncTreePPOConfig, "sft_tau2": TreeSFTConfig}

# one bad value per tree_* option of each recipe's config: (option, value as typed)
SHARED_BAD = [
    ("tree_memory_budget", "8G"),
    ("tree_block_size", "abc"),  # argparse: invalid int value
    ("tree_block_size", "0"),  # the config: must be >= 1
    ("tree_batch_tokens", "-1"),
    ("tree_subtree_tokens", "1.5"),
    ("tree_oom_retries", "-1"),
    ("tree_check_gradients", "maybe"),
    ("tree_check_tolerance", "-1"),
    ("tree_check_tolerance", "tight"),
]
OWN_BAD = {
    "ppo_tau2": [("tree_lexicographic_steps", "maybe"), ("tree_gather_per_layer", "maybe")],
    "ppo_tau2_async": [("tree_attn_implementation", "paged")],
    "sft_tau2": [("tree_token_accuracy", "maybe")],
}


def _parse(recipe, *argv, output_dir="outputs/test_options"):
    saved = dict(os.environ)  # TrlParser exports a YAML's `env:` block
    try:
        return RECIPES[recipe].make_parser().parse_args_and_config([*argv, *CPU, "--output_dir", output_dir])
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _config(recipe, tmp_path, **options):
    cpu = {} if torch.cuda.is_available() else {"bf16": False}
    return CONFIGS[recipe](output_dir=str(tmp_path), report_to="none", **cpu, **options)


# ------------------------------------------------------------------------------------------------------------
# The parser
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("typed, parsed", FORMS + [(None, None), (6e10, 6e10), (8_000_000_000, 8e9)])
def test_memory_budget_forms(typed, parsed):
    assert parse_memory_budget(typed, "tree_memory_budget") == parsed
    assert parse_memory_budget(parsed) == parsed  # canonical values read back as themselves


@pytest.mark.parametrize("typed", BAD_BUDGETS + [True, float("nan"), -1, [8]])
def test_memory_budget_refusals_name_the_option_and_the_forms(typed):
    with pytest.raises(ValueError) as error:  # (a wrong type: ArgumentTypeError, a ValueError too)
        parse_memory_budget(typed, "tree_memory_budget")
    message = str(error.value)
    assert message.startswith("tree_memory_budget must be")
    for form in ('"auto"', "None", '"none"', "8GB", "8GiB", "512MiB", "6e10", '"80%"'):
        assert form in message
    assert repr(typed) in message


def test_a_percentage_is_auto_with_another_share(monkeypatch):
    """ "80%" on CUDA: 0.8 x (free - reserved) - the first step's gradients and Adam states, as "auto" with
    0.9; off CUDA, as "auto", the fixed budgets. (The CUDA memory query is mocked: no GPU needed.)"""
    assert memory_share("80%") == 0.8 and memory_share("auto") is None and memory_share(8e9) is None
    model = torch.nn.Linear(64, 64)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    gib = float(1 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0.0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0.0)
    cuda = torch.device("cuda")
    later = 3 * params  # (no gradients yet: gradients and two Adam states)
    share = Budgets("80%", reserved_bytes=gib).memory_bytes(model, cuda)
    assert share == pytest.approx(0.8 * (4 * gib - gib) - later)
    assert Budgets("auto").memory_bytes(model, cuda) == pytest.approx(AUTO_FRACTION * 4 * gib - later)
    assert Budgets("90%").memory_bytes(model, cuda) == pytest.approx(AUTO_FRACTION * 4 * gib - later)
    assert Budgets("8GiB").memory_bytes(model, cuda) == 8 * gib
    assert Budgets("80%").memory_bytes(model, torch.device("cpu")) is None  # the fixed budgets
    assert Budgets("none").memory_budget is None and Budgets("Auto").memory_budget == "auto"


# ------------------------------------------------------------------------------------------------------------
# The configs, in Python
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", CONFIGS)
def test_configs_take_every_form(recipe, tmp_path):
    for typed, parsed in FORMS:
        config = _config(recipe, tmp_path, tree_memory_budget=typed)
        assert config.tree_memory_budget == parsed, typed
    assert _config(recipe, tmp_path, tree_memory_budget=None).tree_memory_budget is None
    config = _config(recipe, tmp_path, tree_memory_budget=6e10)
    assert config.tree_memory_budget == 6e10
    saved = _config(recipe, tmp_path, tree_memory_budget="80%").to_json_string()
    assert '"tree_memory_budget": "80%"' in saved  # (kept as typed: a saved config reads back the same)


@pytest.mark.parametrize("recipe", CONFIGS)
def test_configs_refuse_bad_values_naming_the_option(recipe, tmp_path):
    bad = {
        "tree_memory_budget": ["8G", True],
        "tree_block_size": ["abc", 0, 2.5],
        "tree_batch_tokens": [-1, "8"],
        "tree_subtree_tokens": [1.5],
        "tree_oom_retries": [-1, None],
        "tree_check_gradients": ["false", 1],
        "tree_check_tolerance": [-1.0, float("nan"), "tight"],
    }
    for name, value in OWN_BAD[recipe]:
        bad[name] = [value]
    for name, values in bad.items():
        for value in values:
            with pytest.raises(ValueError, match=name):  # (ArgumentTypeError: a ValueError too)
                _config(recipe, tmp_path, **{name: value})


# ------------------------------------------------------------------------------------------------------------
# The recipes' command lines
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_parse_every_form(recipe):
    for typed, parsed in FORMS:
        _, train, _ = _parse(recipe, "--tree_memory_budget", typed)
        assert train.tree_memory_budget == parsed, typed
    _, train, _ = _parse(recipe)
    assert train.tree_memory_budget == "auto"


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_take_the_budget_from_a_yaml_file(recipe, tmp_path):
    path = tmp_path / "config.yaml"
    yaml = [("8GiB", 8 * 2**30), ("null", None), ("None", None), ("'80%'", "80%"), ("6e10", 6e10)]
    for typed, parsed in yaml:
        path.write_text(f"tree_memory_budget: {typed}\n")
        _, train, _ = _parse(recipe, "--config", str(path))
        assert train.tree_memory_budget == parsed, typed


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_refuse_one_bad_value_per_option_naming_it(recipe, capsys):
    for name, value in SHARED_BAD + OWN_BAD[recipe]:
        try:
            _parse(recipe, f"--{name}", value)
        except SystemExit:  # argparse's own message ("argument --tree_block_size: invalid int value")
            assert f"--{name}" in capsys.readouterr().err, (name, value)
        except ValueError as error:  # the config's __post_init__
            assert name in str(error), (name, value)
        else:
            pytest.fail(f"--{name} {value} was accepted")


def test_async_recipe_takes_attn_implementation_as_the_walks():
    recipe = RECIPES["ppo_tau2_async"]
    _, train, model = _parse("ppo_tau2_async", "--attn_implementation", "eager")
    recipe.use_attention(train, model)
    assert train.tree_attn_implementation == "eager" and not train.model_init_kwargs
    _, train, model = _parse("ppo_tau2_async")
    recipe.use_attention(train, model)
    assert model.attn_implementation is None and train.tree_attn_implementation == "sdpa"
    _, train, model = _parse("ppo_tau2_async", "--attn_implementation", "paged")
    with pytest.raises(ValueError, match="--attn_implementation 'paged'"):
        recipe.use_attention(train, model)
    argv = ("--attn_implementation", "eager", "--tree_attn_implementation", "flex_attention")
    _, train, model = _parse("ppo_tau2_async", *argv)
    with pytest.raises(ValueError, match="give one"):
        recipe.use_attention(train, model)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_help_gives_one_default_per_option(recipe):
    text = RECIPES[recipe].make_parser().format_help()  # (a bare % in a help text would fail here)
    options = re.split(r"\n  (?=-)", text)
    doubled = [o.split()[0] for o in options if len(re.findall(r"\(default:", o)) > 1]
    assert not doubled, doubled
    help_of = {o.split()[0]: " ".join(o.split()) for o in options}
    assert "differ" in help_of["--tree_check_gradients"] and "if off" not in help_of["--tree_check_gradients"]
    for form in ("None", "8GB", "8GiB", "80%"):
        assert form in help_of["--tree_memory_budget"]
    if "--warm_start_steps" in help_of and recipe == "ppo_tau2":
        assert "TreeSFTTrainer" in help_of["--warm_start_steps"]
    assert "--attn_implementation" in help_of
