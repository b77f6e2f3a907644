"""Templating: names, rendering with shell quoting, value formatting, parameter env."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from hypermesh.errors import FatalError
from hypermesh.recipe.templating import (
    BUILTINS,
    TemplateError,
    format_value,
    malformed_placeholders,
    param_env,
    placeholder_problems,
    quoted_placeholders,
    render,
    template_names,
)

HOSTILE = [
    "1; touch {marker}",
    "$(touch {marker})",
    "`touch {marker}`",
    "a b  c",
    "it's",
    'say "hi"',
    "line1\nline2; touch {marker}",
    "",
    "*",
    "back\\slash",
    "' ; touch {marker} ; '",
    "--flag=1 && touch {marker}",
]


def test_template_names_in_order_each_once() -> None:
    text = "run {{b}} --x {{ a }} {{b}} {{task_index}}"
    assert template_names(text) == ["b", "a", "task_index"]
    assert template_names("no placeholders { here }") == []


def test_builtins() -> None:
    assert {"workflow_id", "experiment", "task_id", "task_index", "attempt"} == BUILTINS


def test_render_replaces_names_with_spaces_inside_braces() -> None:
    assert render("python t.py --lr {{lr}} --bs {{  bs }}", {"lr": 0.25, "bs": 64}) == (
        "python t.py --lr 0.25 --bs 64"
    )
    assert render("--out=run-{{task_index}}", {"task_index": 7}) == "--out=run-7"


def test_render_unknown_name_is_a_fatal_template_error() -> None:
    with pytest.raises(TemplateError) as info:
        render("echo {{missing}}", {"lr": 1})
    assert "missing" in str(info.value)
    assert isinstance(info.value, FatalError)


def test_render_malformed_placeholder_is_an_error() -> None:
    with pytest.raises(TemplateError):
        render("echo {{ not-a-name }}", {})


@pytest.mark.parametrize("template", ["{{v}}", "--value={{v}}", "x{{v}}y"])
@pytest.mark.parametrize("raw", HOSTILE)
def test_value_is_a_single_shell_word(template: str, raw: str, tmp_path: Path) -> None:
    value = raw.format(marker=tmp_path / "pwned")
    rendered = render(template, {"v": value})
    expected = template.replace("{{v}}", value)
    assert shlex.split(f"printf %s {rendered}") == ["printf", "%s", expected]


@pytest.mark.parametrize("raw", HOSTILE)
def test_shell_prints_value_literally_and_runs_nothing(raw: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    value = raw.format(marker=marker)
    command = render("printf '%s\\n' {{lr}}", {"lr": value})
    result = subprocess.run(
        ["/bin/sh", "-c", command], capture_output=True, text=True, check=True, timeout=30
    )
    assert result.stdout == value + "\n"
    assert not marker.exists()


def test_two_placeholders_keep_two_words(tmp_path: Path) -> None:
    command = render("printf '[%s]' {{a}} {{b}}", {"a": "x y", "b": ""})
    result = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=True)
    assert result.stdout == "[x y][]"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (True, "true"),
        (False, "false"),
        (3, "3"),
        (-7, "-7"),
        (0.1, "0.1"),
        (1e-05, "1e-05"),
        (2.0, "2.0"),
        (0.30000000000000004, "0.30000000000000004"),
        ("as is", "as is"),
        (None, ""),
    ],
)
def test_format_value(value: object, text: str) -> None:
    assert format_value(value) == text


def test_float_text_reads_back_exactly() -> None:
    value = 0.1 + 0.2
    assert float(format_value(value)) == value


def test_param_env_upper_cases_names() -> None:
    assert param_env({"lr": 0.25, "batch_size": 32, "use_bn": True, "opt": "adam"}) == {
        "HM_PARAM_LR": "0.25",
        "HM_PARAM_BATCH_SIZE": "32",
        "HM_PARAM_USE_BN": "true",
        "HM_PARAM_OPT": "adam",
    }


def test_malformed_placeholders() -> None:
    found = malformed_placeholders("a {{ 1x }} {{ok}} {{a b}} {{}}")
    assert found == ["{{ 1x }}", "{{a b}}", "{{}}"]
    assert malformed_placeholders("{{ok}} {single}") == []


@pytest.mark.parametrize(
    ("template", "quoted"),
    [
        ("python t.py --lr {{lr}}", []),
        ("echo '{{lr}}'", ["{{lr}}"]),
        ('echo "--lr={{lr}}"', ["{{lr}}"]),
        ("echo 'a' {{lr}} \"b\"", []),
        ("echo \\'{{lr}}", []),
        ("echo \\{{lr}}", ["{{lr}}"]),
        ('echo "a\\"b" {{lr}}', []),
        ("python -c 'print({{lr}})'", ["{{lr}}"]),
        ("echo \"it's\" {{a}} '{{b}}'", ["{{b}}"]),
    ],
)
def test_quoted_placeholders(template: str, quoted: list[str]) -> None:
    assert quoted_placeholders(template) == quoted


def test_placeholder_problems() -> None:
    assert placeholder_problems("train --lr {{lr}} --id {{task_id}}", ["lr"]) == []
    (unknown,) = placeholder_problems("train --lr {{lr_}}", ["lr", "momentum"])
    assert "'lr_'" in unknown and "did you mean 'lr'?" in unknown
    assert "lr, momentum" in unknown
    assert len(placeholder_problems("x {{ a-b }} '{{lr}}'", ["lr"])) == 2
