"""The docs match the code: every ``tree_*`` option and every logged metric is in docs/options.md (and every
name documented there exists), no doc uses a metric's old name, the public names are listed in
docs/development.md, and the SFT snippets run as written. Static reads of the source, plus one tiny SFT step
per snippet; seconds."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ROOT / "docs" / "options.md"
# the user-facing docs: where an old metric name would mislead
USER_DOCS = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
METRIC_PREFIXES = ("tree/", "perf/", "value/", "decoupled/", "staleness/")
STEP_PREFIXES = ("tree/", "value_tree/")  # the step seam's metrics, f"{p}...": the policy's, a value model's
# old name -> pattern of the name as a whole (not a prefix of the new one)
OLD_METRICS = {
    "generation_time": r"(?<![\w/])generation_time(?!\w)",
    "tree/time": r"(?<![\w/])tree/time(?![\w/])",
    "tree/peak_memory": r"(?<![\w/])tree/peak_memory(?![\w/])",
}
RENAME_NOTE = re.compile(r"^Renamed in \d[\d.]*.*?(?:\n\n|\Z)", re.M | re.S)  # docs/options.md says what was


def _section(text: str, heading: str) -> str:
    """``text`` from ``heading`` (a ``## `` line) to the next ``## `` heading."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _first_column_names(text: str, pattern: str) -> set[str]:
    """The backticked names matching ``pattern`` in the first column of the Markdown tables of ``text``."""
    names = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(rf"`({pattern})`", line.split("|")[1]))
    return names


def _logged_metrics() -> set[str]:
    """The metric names the library logs, read from its source: string literals under
    :data:`METRIC_PREFIXES`, and the step seam's names ``f"{p}suffix"`` under each of :data:`STEP_PREFIXES`;
    the computed suffixes: ``f"{p}{name}"``, a budget of ``Budgets.metrics()``, and ``f"{p}attention_calls/
    {kernel}"``, an attention kernel's name (one name, ``<kernel>``)."""
    from trl_dta.walk.memory.budgets import Budgets, TokenBudgets

    budgets = Budgets()
    budgets.use(TokenBudgets(*range(1, len(dataclasses.fields(TokenBudgets)) + 1)))
    names, suffixes, computed = set(), set(), []
    for path in sorted((ROOT / "trl_dta").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                head = node.values[0] if node.values else None
                if isinstance(head, ast.Constant) and str(head.value).startswith(METRIC_PREFIXES):
                    computed.append(f"{path.relative_to(ROOT)}: {ast.unparse(node)}")
                elif _is_prefix(head) and len(node.values) == 2 and isinstance(node.values[1], ast.Constant):
                    suffixes.add(node.values[1].value)
                elif _is_prefix(head):
                    computed.append(f"{path.relative_to(ROOT)}: {ast.unparse(node)}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
                if re.fullmatch(r"(tree|perf|value|decoupled|staleness)/[a-z0-9_/]+", node.value):
                    names.add(node.value)
    # a new computed name fails here: say in this test where its names come from: a budget of
    # Budgets.metrics(), and an attention kernel's name (documented as one row, <kernel>)
    assert computed == [
        "trl_dta/train/step_walk.py: f'{p}attention_calls/{kernel}'",
        "trl_dta/train/step_walk.py: f'{p}{name}'",
    ], computed
    suffixes |= set(budgets.metrics()) | {"attention_calls/<kernel>"}
    return names | {prefix + suffix for prefix in STEP_PREFIXES for suffix in suffixes}


def _is_prefix(value) -> bool:
    """``{p}`` or ``{self.prefix}``: the step seam's metric prefix in an f-string."""
    if not isinstance(value, ast.FormattedValue):
        return False
    return ast.unparse(value.value) in ("p", "self.prefix")


def test_every_logged_metric_is_documented_and_every_documented_one_is_logged():
    logged = _logged_metrics()
    assert {"tree/time_s", "tree/peak_memory_gib", "tree/check_error", "tree/block_size"} <= logged
    assert "perf/generation_s" in logged
    metrics = _section(OPTIONS.read_text(), "## Metrics")
    documented = _first_column_names(metrics, r"(?:tree|perf|value|decoupled|staleness)/[a-z0-9_/<>]+")
    assert "| `value_tree/*` |" in metrics  # one row for the value model's walk: the step seam's tree/* names
    documented |= {"value_" + name for name in documented if "value_" + name in logged}
    assert not logged - documented, f"logged, not in docs/options.md's Metrics table: {logged - documented}"
    assert not documented - logged, f"in docs/options.md's Metrics table, never logged: {documented - logged}"


def test_every_tree_option_is_documented_and_every_documented_one_exists():
    from trl_dta import AsyncTreePPOConfig, TreePPOConfig, TreeSFTConfig

    fields = {
        f.name
        for config in (TreePPOConfig, TreeSFTConfig, AsyncTreePPOConfig)
        for f in dataclasses.fields(config)
        if f.name.startswith("tree_")
    }
    assert {"tree_memory_budget", "tree_token_accuracy", "tree_attn_implementation"} <= fields
    text = OPTIONS.read_text()
    documented = _first_column_names(text[: text.index("\n## Metrics\n")], r"tree_[a-z0-9_]+")
    assert not fields - documented, f"tree_* fields not in docs/options.md's tables: {fields - documented}"
    assert not documented - fields, f"in docs/options.md's tables, in no config: {documented - fields}"


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_uses_an_old_metric_name(path):
    text = path.read_text()
    if path == OPTIONS:
        assert RENAME_NOTE.search(text), "docs/options.md says which names were renamed"
        text = RENAME_NOTE.sub("", text)
    for old, pattern in OLD_METRICS.items():
        lines = [n for n, line in enumerate(text.splitlines(), 1) if re.search(pattern, line)]
        assert not lines, f"{path.relative_to(ROOT)} uses the old metric name {old!r} (lines {lines})"


def test_the_public_names_are_listed_in_development_md():
    import trl_dta

    text = (ROOT / "docs" / "development.md").read_text()
    missing = [name for name in trl_dta.__all__ if f"`{name}`" not in text]
    assert not missing, f"docs/development.md does not list the public names {missing}"


@pytest.mark.parametrize("doc", ["docs/sft.md"])  # (the README links to it)
def test_the_sft_snippet_runs_as_written(doc, tmp_path):
    """The snippet with only its Hub model swapped for the offline tiny Qwen3 (and one step, on CPU)."""
    from trl_dta.testing.grpo import tiny_model, tiny_tokenizer

    text = (ROOT / doc).read_text()
    snippets = [s for s in re.findall(r"```python\n(.*?)```", text, re.S) if "TreeSFTTrainer(" in s]
    assert len(snippets) == 1, doc
    model_dir = tmp_path / "model"
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    code = snippets[0]
    one_step = f'output_dir={str(tmp_path / "out")!r}, max_steps=1, report_to="none", bf16=False'
    one_step += ', tree_dense_fallback="never"'  # (walked: the tiny model's step would take the dense path)
    for old, new in (('"Qwen/Qwen3-0.6B"', repr(str(model_dir))), ('output_dir="out"', one_step)):
        assert code.count(old) == 1, (doc, old)
        code = code.replace(old, new)
    namespace: dict = {}
    exec(compile(code, doc, "exec"), namespace)
    logged = namespace["trainer"].state.log_history
    assert logged[0]["tree/dedup_ratio"] > 1  # the rows share their system turn
