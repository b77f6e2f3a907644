"""Recipe parsing and validation: the paper's Figure 1, every field, every error path."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from hypermesh.errors import NotFound, Problem, RecipeError
from hypermesh.recipe.recipe import (
    Experiment,
    Hardware,
    Parameter,
    Recipe,
    load_recipe,
    parse_recipe,
)

ROOT = Path(__file__).resolve().parents[2]
FIGURE1 = ROOT / "examples" / "figure1.yaml"


def doc(text: str) -> str:
    """``text`` dedented, with line 1 being the first line after the opening quotes."""
    return textwrap.dedent(text).lstrip("\n")


def problems(text: str, overrides: Sequence[str] = ()) -> list[Problem]:
    with pytest.raises(RecipeError) as info:
        parse_recipe(doc(text), "r.yaml", overrides)
    assert info.value.problems, "a RecipeError must carry problems"
    return info.value.problems


def located(text: str, overrides: Sequence[str] = ()) -> set[tuple[int | None, str]]:
    return {(p.line, p.path) for p in problems(text, overrides)}


def one_experiment(body: str) -> Experiment:
    text = "experiments:\n  e:\n" + textwrap.indent(doc(body), "    ")
    (exp,) = parse_recipe(text).experiments
    return exp


def param_problem(spec: str) -> set[tuple[int | None, str]]:
    return located(
        f"""
        experiments:
          e:
            command: run {{{{x}}}}
            samples: 3
            parameters:
              x: {spec}
        """
    )


# ------------------------------------------------------------------ Figure 1


PAPER_FIGURE1 = """\
experiments:
  mnist:
    framework: pytorch
    parameters:
      lr:
        range: 0.1-0.3
        sampling: uniform
    samples: 1000
    workers: 100
    hardware:
      gpu: k80
    command:
      - python train.py --lr {{lr}}
"""


def test_figure1_file_is_the_paper_verbatim() -> None:
    assert FIGURE1.read_text() == PAPER_FIGURE1


def test_figure1_parses_with_expected_fields() -> None:
    recipe = load_recipe(FIGURE1)
    assert [e.name for e in recipe.experiments] == ["mnist"]
    mnist = recipe.experiment("mnist")
    assert mnist.framework == "pytorch"
    assert mnist.parameters == (Parameter("lr", "range", low=0.1, high=0.3, sampling="uniform"),)
    assert mnist.samples == 1000
    assert mnist.workers == 100
    assert mnist.hardware == Hardware(gpu="k80", gpus=1.0)
    assert mnist.command == ("python train.py --lr {{lr}}",)
    assert (mnist.after, mnist.retries, mnist.timeout, dict(mnist.env)) == ((), 0, None, {})
    assert (recipe.name, recipe.seed, recipe.workdir) == (None, None, None)


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize(
    ("spec", "low", "high"),
    [
        ("{range: 0.1-0.3}", 0.1, 0.3),
        ("{range: '0.1-0.3'}", 0.1, 0.3),
        ("{range: 0.1 - 0.3}", 0.1, 0.3),
        ("{range: [0.1, 0.3]}", 0.1, 0.3),
        ("{range: -1--0.5}", -1.0, -0.5),
        ("{range: -3-5}", -3.0, 5.0),
        ("{range: 1e-4-1e-1}", 1e-4, 1e-1),
        ("{range: 1E-4-2.5E+1}", 1e-4, 25.0),
        ("{range: [1e-4, 1e-1]}", 1e-4, 1e-1),
        ("{range: [-2, 7]}", -2.0, 7.0),
        ("{range: .5-1.}", 0.5, 1.0),
    ],
)
def test_range_forms(spec: str, low: float, high: float) -> None:
    exp = one_experiment(f"command: run {{{{x}}}}\nsamples: 3\nparameters:\n  x: {spec}\n")
    (p,) = exp.parameters
    assert (p.kind, p.low, p.high, p.sampling) == ("range", low, high, "uniform")
    assert isinstance(p.low, float) and isinstance(p.high, float)


@pytest.mark.parametrize(
    "spec",
    [
        "{range: 0.3-0.1}",
        "{range: 0.2-0.2}",
        "{range: abc}",
        "{range: 1-}",
        "{range: -5}",
        "{range: [1]}",
        "{range: [1, 2, 3]}",
        "{range: [a, 2]}",
        "{range: [.inf, 2]}",
        "{range: ~}",
        "{range: 0-1, sampling: loguniform}",
        "{range: -1-1, sampling: loguniform}",
        "{range: 1.5-4, sampling: int}",
        "{range: 5-4, sampling: int}",
    ],
)
def test_bad_ranges_name_the_field_and_line(spec: str) -> None:
    assert param_problem(spec) == {(6, "experiments.e.parameters.x.range")}


def test_bad_range_message_quotes_the_input() -> None:
    (p,) = problems(
        """
        experiments:
          e:
            command: run {{x}}
            samples: 3
            parameters:
              x:
                range: "abc"
        """
    )
    assert (p.line, p.path, p.source) == (7, "experiments.e.parameters.x.range", "r.yaml")
    assert "abc" in p.message and "min-max" in p.message


def test_sampling_kinds() -> None:
    exp = one_experiment(
        """
        command: run {{a}} {{b}} {{c}}
        samples: 2
        parameters:
          a: {range: 1e-5-1e-1, sampling: loguniform}
          b: {range: 1-10, sampling: int}
          c: {range: 3-3, sampling: int}
        """
    )
    assert [(p.name, p.sampling, p.low, p.high) for p in exp.parameters] == [
        ("a", "loguniform", 1e-5, 1e-1),
        ("b", "int", 1.0, 10.0),
        ("c", "int", 3.0, 3.0),
    ]


def test_unknown_sampling_suggests() -> None:
    (p,) = problems(
        """
        experiments:
          e:
            command: run {{x}}
            samples: 3
            parameters:
              x: {range: 0-1, sampling: loguniforn}
        """
    )
    assert p.path == "experiments.e.parameters.x.sampling" and p.line == 6
    assert "did you mean 'loguniform'?" in p.message


def test_values_keep_their_types_and_order() -> None:
    exp = one_experiment(
        """
        command: run {{opt}} {{bs}} {{bn}} {{m}}
        parameters:
          opt: {values: [adam, sgd]}
          bs: {values: [32, 64]}
          bn: {values: [true, false]}
          m: {values: [0.9, "0.99"]}
        """
    )
    assert [p.name for p in exp.parameters] == ["opt", "bs", "bn", "m"]
    assert [p.values for p in exp.parameters] == [
        ("adam", "sgd"), (32, 64), (True, False), (0.9, "0.99")
    ]
    assert [type(v) for v in exp.parameters[3].values] == [float, str]
    assert exp.samples is None


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ("{values: []}", (6, "experiments.e.parameters.x.values")),
        ("{values: 3}", (6, "experiments.e.parameters.x.values")),
        ("{values: [1, [2]]}", (6, "experiments.e.parameters.x.values[1]")),
        ("{values: [1, ~]}", (6, "experiments.e.parameters.x.values[1]")),
        ("{values: [a, b, a]}", (6, "experiments.e.parameters.x.values[2]")),
        ("{values: [1], range: 0-1}", (6, "experiments.e.parameters.x")),
        ("{values: [1], sampling: int}", (6, "experiments.e.parameters.x.sampling")),
        ("{sampling: int}", (6, "experiments.e.parameters.x")),
        ("{}", (6, "experiments.e.parameters.x")),
        ("[0.1, 0.2]", (6, "experiments.e.parameters.x")),
        ("{valuse: [1]}", (6, "experiments.e.parameters.x.valuse")),
    ],
)
def test_bad_parameter_specs(spec: str, where: tuple[int, str]) -> None:
    assert where in param_problem(spec)


def test_parameter_name_rules() -> None:
    found = located(
        """
        experiments:
          e:
            command: run
            parameters:
              9lives: {values: [1]}
              task_id: {values: [1]}
              lr: {values: [1]}
              LR: {values: [2]}
        """
    )
    assert found == {
        (5, "experiments.e.parameters.9lives"),
        (6, "experiments.e.parameters.task_id"),
        (8, "experiments.e.parameters.LR"),
    }


# ------------------------------------------------------------------ expansion rules


def test_range_without_samples_is_an_error_on_samples() -> None:
    (p,) = problems(
        """
        experiments:
          first:
            command: run
          e:
            command: run {{x}}
            parameters:
              x: {range: 0-1}
        """
    )
    assert (p.line, p.path) == (4, "experiments.e.samples")


def test_discrete_without_samples_is_a_grid_and_no_parameters_default_to_none() -> None:
    exp = one_experiment("command: run {{x}}\nparameters:\n  x: {values: [1, 2]}\n")
    assert exp.samples is None
    assert one_experiment("command: run\n").samples is None


# ------------------------------------------------------------------ the other fields


def test_every_field() -> None:
    recipe = parse_recipe(
        doc(
            """
            name: study
            seed: 17
            workdir: ./runs
            env: {SHARED: "1", MODE: top}
            experiments:
              prep:
                command: python prep.py
              train:
                after: prep
                command:
                  - python train.py --lr {{lr}} --out out-{{task_index}}-{{attempt}}
                  - echo done {{workflow_id}} {{experiment}} {{task_id}}
                parameters:
                  lr: {range: [0.001, 0.1], sampling: loguniform}
                samples: 8
                workers: 2
                hardware: {gpu: v100, gpus: 0.25, cpus: 4, memory: 16GiB}
                env: {MODE: exp, DEBUG: true, N: 3}
                retries: 2
                timeout: 1h30m
                framework: pytorch
                image: pytorch/pytorch:2.3
                seed: 5
            """
        )
    )
    assert (recipe.name, recipe.seed, recipe.workdir) == ("study", 17, "./runs")
    assert dict(recipe.env) == {"SHARED": "1", "MODE": "top"}
    prep, train = recipe.experiments
    assert prep.command == ("python prep.py",)
    assert dict(prep.env) == {"SHARED": "1", "MODE": "top"}
    assert train.after == ("prep",)
    assert len(train.command) == 2
    assert train.hardware == Hardware(gpu="v100", gpus=0.25, cpus=4.0, memory=16 * 2**30)
    assert dict(train.env) == {"SHARED": "1", "MODE": "exp", "DEBUG": "true", "N": "3"}
    assert (train.retries, train.timeout, train.seed) == (2, 5400.0, 5)
    assert (train.framework, train.image, train.samples, train.workers) == (
        "pytorch", "pytorch/pytorch:2.3", 8, 2
    )


def test_hardware_defaults_and_gpu_count() -> None:
    assert one_experiment("command: x\n").hardware == Hardware(gpu=None, gpus=0.0, cpus=1.0)
    assert one_experiment("command: x\nhardware: {gpus: 2}\n").hardware.gpus == 2.0
    assert one_experiment("command: x\nhardware: {memory: 512MiB}\n").hardware.memory == 2**29
    assert one_experiment("command: x\nhardware: {memory: 1000}\n").hardware.memory == 1000


@pytest.mark.parametrize(
    ("hardware", "path"),
    [
        ("{gpu: 2}", "experiments.e.hardware.gpu"),
        ("{gpus: -1}", "experiments.e.hardware.gpus"),
        ("{gpus: many}", "experiments.e.hardware.gpus"),
        ("{cpus: 0}", "experiments.e.hardware.cpus"),
        ("{memory: 16 gigs}", "experiments.e.hardware.memory"),
        ("{memory: 0}", "experiments.e.hardware.memory"),
        ("{gpu: k80, gpus: 0}", "experiments.e.hardware.gpus"),
        ("{gpu_type: k80}", "experiments.e.hardware.gpu_type"),
        ("k80", "experiments.e.hardware"),
    ],
)
def test_bad_hardware(hardware: str, path: str) -> None:
    assert located(f"experiments:\n  e:\n    command: x\n    hardware: {hardware}\n") == {
        (4, path)
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("samples", "0"),
        ("samples", "ten"),
        ("samples", "2.5"),
        ("samples", "true"),
        ("workers", "0"),
        ("retries", "-1"),
        ("timeout", "0s"),
        ("timeout", "soon"),
        ("timeout", "[1]"),
        ("seed", "x"),
        ("framework", "[a]"),
        ("image", "''"),
        ("env", "[A]"),
        ("after", "{a: b}"),
    ],
)
def test_bad_scalar_fields(field: str, value: str) -> None:
    assert (3, f"experiments.e.{field}") in located(
        f"experiments:\n  e:\n    {field}: {value}\n    command: x\n"
    )


def test_command_forms() -> None:
    assert one_experiment("command: python a.py\n").command == ("python a.py",)
    assert one_experiment("command: [a, b]\n").command == ("a", "b")
    assert located("experiments:\n  e:\n    command: []\n") == {(3, "experiments.e.command")}
    assert located("experiments:\n  e:\n    command: ['']\n") == {(3, "experiments.e.command[0]")}
    assert located("experiments:\n  e:\n    command:\n      - ok\n      - 42\n") == {
        (5, "experiments.e.command[1]")
    }


def test_quoted_placeholder_is_rejected() -> None:
    (p,) = problems(
        """
        experiments:
          e:
            parameters:
              x: {values: [1]}
            command:
              - echo '{{x}}'
        """
    )
    assert (p.line, p.path) == (6, "experiments.e.command[0]")
    assert "quotes" in p.message


def test_unknown_template_variable_suggests_a_parameter() -> None:
    (p,) = problems(
        """
        experiments:
          e:
            parameters:
              lr: {values: [1]}
            command:
              - ok {{lr}} {{task_index}}
              - train --lr {{lrr}}
        """
    )
    assert (p.line, p.path) == (7, "experiments.e.command[1]")
    assert "'lrr'" in p.message and "did you mean 'lr'?" in p.message


def test_file_and_override_problems_are_reported_together() -> None:
    found = problems("experiments:\n  e:\n    command: x\n    workers: 0\n", ["f.samples=1"])
    assert [(p.line, p.path) for p in found] == [
        (None, "--set f.samples"),
        (4, "experiments.e.workers"),
    ]


def test_env_names_and_values() -> None:
    found = located(
        """
        env:
          1BAD: x
        experiments:
          e:
            command: x
            env:
              GOOD: [1]
              "A-B": y
        """
    )
    assert found == {(2, "env.1BAD"), (7, "experiments.e.env.GOOD"), (8, "experiments.e.env.A-B")}


def test_after_and_topological_order() -> None:
    recipe = parse_recipe(
        doc(
            """
            experiments:
              report:
                command: x
                after: [train, eval]
              train:
                command: x
                after: prep
              eval:
                command: x
                after: [train]
              prep:
                command: x
              other:
                command: x
            """
        )
    )
    assert recipe.experiment("report").after == ("train", "eval")
    assert recipe.topological_order() == ["prep", "train", "eval", "report", "other"]


def test_self_dependency_and_cycle_messages() -> None:
    found = problems(
        """
        experiments:
          a:
            command: x
            after: a
          b:
            command: x
            after: [c]
          c:
            command: x
            after: [d]
          d:
            command: x
            after: [b]
        """
    )
    assert [(p.line, p.path) for p in found] == [
        (4, "experiments.a.after"),
        (7, "experiments.b.after"),
    ]
    assert "itself" in found[0].message
    assert "b -> c -> d -> b" in found[1].message


# ------------------------------------------------------------------ collecting every problem


MANY_PROBLEMS = """
name: several problems
experiments:
  prep:
    command:
      - python prep.py
    wokers: 4
  train:
    parameters:
      lr:
        range: 0.1-0.3
    samples: 10
    workers: -2
    after: [prep, evaluate]
    command:
      - python train.py --lr {{lr}} --bs {{batch}}
  eval:
    after: report
  report:
    command: echo
    after: [eval]
  bad name!:
    command: x
"""


def test_every_problem_is_reported_with_line_and_path() -> None:
    found = problems(MANY_PROBLEMS)
    assert [(p.line, p.path) for p in found] == [
        (6, "experiments.prep.wokers"),
        (12, "experiments.train.workers"),
        (13, "experiments.train.after[1]"),
        (15, "experiments.train.command[0]"),
        (16, "experiments.eval.command"),
        (17, "experiments.eval.after"),
        (21, "experiments.bad name!"),
    ]
    by_path = {p.path: p.message for p in found}
    assert by_path["experiments.prep.wokers"] == (
        "unknown field 'wokers'; did you mean 'workers'?"
    )
    assert "at least 1" in by_path["experiments.train.workers"]
    assert "unknown experiment 'evaluate'" in by_path["experiments.train.after[1]"]
    assert "did you mean 'eval'?" in by_path["experiments.train.after[1]"]
    assert "batch" in by_path["experiments.train.command[0]"]
    assert "missing required field 'command'" in by_path["experiments.eval.command"]
    assert "eval -> report -> eval" in by_path["experiments.eval.after"]
    assert all(p.source == "r.yaml" for p in found)


def test_error_text_lists_every_problem() -> None:
    with pytest.raises(RecipeError) as info:
        parse_recipe(MANY_PROBLEMS.lstrip("\n"), "r.yaml")
    text = str(info.value)
    assert "r.yaml:6: experiments.prep.wokers: unknown field 'wokers'" in text
    assert len(text.splitlines()) == 7


def test_unknown_top_level_key_suggests() -> None:
    (p,) = problems("experiments:\n  e:\n    command: x\nsed: 3\n")
    assert (p.line, p.path) == (4, "sed")
    assert "did you mean 'seed'?" in p.message


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("- a\n- b\n", (1, "")),
        ("just text\n", (1, "")),
        ("", (1, "")),
        ("# only a comment\n", (1, "")),
        ("name: x\n", (1, "experiments")),
        ("experiments: {}\n", (1, "experiments")),
        ("experiments: [a]\n", (1, "experiments")),
        ("experiments:\n  e: run\n", (2, "experiments.e")),
    ],
)
def test_document_shape_errors(text: str, where: tuple[int, str]) -> None:
    assert where in located(text)


def test_duplicate_keys() -> None:
    found = problems(
        """
        experiments:
          e:
            command: x
            samples: 1
            samples: 2
          e:
            command: y
        """
    )
    assert [(p.line, p.path) for p in found] == [(5, "experiments.e.samples"), (6, "experiments.e")]
    assert "duplicate key 'samples' (first at line 4)" in found[0].message


def test_yaml_syntax_error_has_the_parser_line() -> None:
    (p,) = problems(
        """
        experiments:
          e:
            command: x
             samples: [1, 2
        """
    )
    assert p.line == 4 and p.path == ""
    assert "YAML" in p.message
    assert "quoted" not in p.message  # no placeholder on the line: no hint


@pytest.mark.parametrize(
    "command", ["[echo {{x}}]", "[echo {{x}}, done]", "{{x}} --fast"], ids=["list", "two", "start"]
)
def test_an_unquoted_placeholder_names_the_line_and_suggests_quotes(command: str) -> None:
    (p,) = problems(
        f"""
        experiments:
          e:
            parameters: {{x: {{values: [1]}}}}
            command: {command}
        """
    )
    assert p.line == 4 and "YAML syntax error" in p.message
    assert 'must be quoted: command: ["echo {{x}}"]' in p.message
    assert str(p).startswith("r.yaml:4: ")
    quoted = parse_recipe(doc(
        """
        experiments:
          e:
            parameters: {x: {values: [1]}}
            command: ["echo {{x}}"]
        """
    ))
    assert quoted.experiment("e").command == ("echo {{x}}",)


def test_unclosed_flow_sequence_line() -> None:
    (p,) = problems("experiments:\n  e:\n    command: [a, b\n    samples: 3\n\n\n")
    assert p.line is not None and 3 <= p.line <= 7


def test_recursive_alias_is_a_problem_not_a_hang() -> None:
    found = located("experiments:\n  e:\n    command: x\n    after: &a [*a]\n")
    assert (4, "experiments.e.after[0]") in found


def test_merge_keys_are_supported() -> None:
    recipe = parse_recipe(
        doc(
            """
            experiments:
              a: &base
                command: x
                hardware: {gpus: 1}
              b:
                <<: *base
                workers: 2
            """
        )
    )
    assert recipe.experiment("b").hardware.gpus == 1.0
    assert recipe.experiment("b").workers == 2


# ------------------------------------------------------------------ --set overrides


def test_overrides_apply_before_validation() -> None:
    recipe = load_recipe(
        FIGURE1,
        overrides=[
            "mnist.samples=10",
            "mnist.hardware.gpu=v100",
            "mnist.parameters.lr.range=[0.1, 0.2]",
            "mnist.env.MODE=fast",
            "mnist.timeout=10m",
        ],
    )
    mnist = recipe.experiment("mnist")
    assert mnist.samples == 10
    assert mnist.hardware.gpu == "v100"
    assert (mnist.parameters[0].low, mnist.parameters[0].high) == (0.1, 0.2)
    assert dict(mnist.env) == {"MODE": "fast"}
    assert mnist.timeout == 600.0


def test_override_creates_intermediate_mappings() -> None:
    recipe = parse_recipe(
        "experiments:\n  e:\n    command: x\n",
        overrides=["e.hardware.memory=2GiB", "e.parameters.k.values=[1, 2]"],
    )
    exp = recipe.experiment("e")
    assert exp.hardware.memory == 2 * 2**30
    assert exp.parameters == (Parameter("k", "values", values=(1, 2)),)


def test_bad_overrides_are_problems() -> None:
    found = problems(
        "experiments:\n  mnist:\n    command: x\n",
        overrides=[
            "samples",
            "mnist.samples",
            "mnist=3",
            "mnsit.samples=3",
            "mnist..x=1",
            "mnist.command.x=1",
            "mnist.samples=[1",
        ],
    )
    paths = [p.path for p in found]
    assert paths == sorted(
        [
            "--set samples",
            "--set mnist.samples",
            "--set mnist",
            "--set mnsit.samples",
            "--set mnist..x",
            "--set mnist.command.x",
            "--set mnist.samples",
        ]
    )
    assert all(p.line is None for p in found)
    assert any("did you mean 'mnist'?" in p.message for p in found)


def test_a_top_level_image_runs_experiments_without_their_own() -> None:
    text = (
        "image: localhost/team/base:1\n"
        "experiments:\n"
        "  plain: {command: x}\n"
        "  torch: {command: x, framework: pytorch}\n"
        "  own: {command: x, image: 'registry.local:5000/own:2'}\n"
    )
    recipe = parse_recipe(text)
    assert [e.image for e in recipe.experiments] == [
        "localhost/team/base:1", None, "registry.local:5000/own:2"]
    # --set image=REF sets the recipe's own field, as if the file said it.
    recipe = parse_recipe(text, overrides=["image=localhost/other:3", "seed=7"])
    assert recipe.experiment("plain").image == "localhost/other:3"
    assert recipe.experiment("own").image == "registry.local:5000/own:2"
    assert recipe.seed == 7
    found = problems(text, overrides=["image=--privileged"])
    assert [(p.path, "--set image" in p.message) for p in found] == [("image", True)]
    found = problems("image: 'a b'\nexperiments:\n  e: {command: x}\n")
    assert [(p.line, p.path) for p in found] == [(1, "image")]


def test_override_value_that_fails_validation_names_the_field() -> None:
    found = problems(FIGURE1.read_text(), overrides=["mnist.samples=0", "mnist.hardware.gpus=x"])
    assert {(p.line, p.path) for p in found} == {
        (None, "experiments.mnist.samples"),
        (None, "experiments.mnist.hardware.gpus"),
    }
    assert all("--set" in p.message for p in found)


def test_override_with_a_typo_field_is_an_unknown_field() -> None:
    found = problems(FIGURE1.read_text(), overrides=["mnist.wokers=3"])
    assert [(p.line, p.path) for p in found] == [(None, "experiments.mnist.wokers")]
    assert "did you mean 'workers'?" in found[0].message


# ------------------------------------------------------------------ JSON, copies, loading


def full_recipe() -> Recipe:
    return parse_recipe(
        doc(
            """
            name: roundtrip
            seed: 3
            workdir: /data/runs
            env: {A: "1"}
            experiments:
              a:
                command: ["prep {{shard}}"]
                parameters:
                  shard: {values: [0, 1, 2.5, "x", true]}
              b:
                after: [a]
                command:
                  - train {{lr}} {{k}}
                parameters:
                  lr: {range: 1e-4-1e-1, sampling: loguniform}
                  k: {range: 1-4, sampling: int}
                samples: 7
                workers: 3
                hardware: {gpu: a100, gpus: 0.5, cpus: 2, memory: 1.5G}
                env: {B: x}
                retries: 1
                timeout: 90
                framework: jax
                image: img:1
                seed: 11
            """
        )
    )


def test_json_round_trip_is_lossless() -> None:
    recipe = full_recipe()
    data = json.loads(json.dumps(recipe.to_json()))
    again = Recipe.from_json(data)
    assert again == recipe
    assert again.experiment("a").parameters[0].values == (0, 1, 2.5, "x", True)
    assert [type(v) for v in again.experiment("a").parameters[0].values] == [
        int, int, float, str, bool
    ]
    assert again.to_json() == recipe.to_json()
    assert hash(again) == hash(recipe)


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(RecipeError):
        Recipe.from_json({"version": 1, "experiments": [{"nme": "x"}]})
    with pytest.raises(RecipeError):
        Recipe.from_json({"experiments": []})


def test_with_seed_and_experiment_lookup() -> None:
    recipe = full_recipe()
    seeded = recipe.with_seed(99)
    assert seeded.seed == 99 and recipe.seed == 3
    assert seeded.experiments == recipe.experiments
    with pytest.raises(NotFound):
        recipe.experiment("nope")


def test_direct_construction_normalises_sequences_and_env() -> None:
    exp = Experiment(name="x", command=["a", "b"], after=["y"], env={"K": "v"})  # type: ignore[arg-type]
    assert exp.command == ("a", "b") and exp.after == ("y",)
    assert exp.env == {"K": "v"}
    assert hash(exp) == hash(Experiment(name="x", command=("a", "b"), after=("y",), env={"K": "v"}))


def test_dataclasses_are_frozen() -> None:
    exp = full_recipe().experiment("b")
    with pytest.raises(AttributeError):
        exp.samples = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        exp.env["B"] = "y"  # type: ignore[index]


def test_load_recipe_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as info:
        load_recipe(missing)
    (p,) = info.value.problems
    assert p.source == str(missing) and p.line is None
    assert "cannot read" in p.message


def test_load_recipe_names_the_path_as_given(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("experiments:\n  e:\n    command: x\n    samples: 0\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    assert [(p.source, p.line) for p in info.value.problems] == [(str(path), 4)]


def test_data_sets_map_aliases_to_names_and_versions() -> None:
    exp = one_experiment(
        """
        command: train
        data:
          coco: coco
          val_set: imagenet-1k@20261122T101010000000Z-0123456789ab
        """
    )
    assert dict(exp.data) == {
        "coco": "coco",
        "val_set": "imagenet-1k@20261122T101010000000Z-0123456789ab",
    }
    recipe = Recipe(experiments=(exp,))
    assert Recipe.from_json(json.loads(json.dumps(recipe.to_json()))) == recipe
    assert dict(one_experiment("command: x").data) == {}


@pytest.mark.parametrize(
    ("data", "line", "path"),
    [
        ("data: coco", 4, "experiments.e.data"),
        ("data:\n  9lives: coco", 5, "experiments.e.data.9lives"),
        ("data:\n  coco: 'my data'", 5, "experiments.e.data.coco"),
        ("data:\n  coco: coco@", 5, "experiments.e.data.coco"),
        ("data:\n  coco: [a, b]", 5, "experiments.e.data.coco"),
        ("data:\n  coco: a\n  COCO: b", 6, "experiments.e.data.COCO"),
    ],
)
def test_bad_data_sets_name_the_alias_and_line(data: str, line: int, path: str) -> None:
    text = "experiments:\n  e:\n    command: x\n" + textwrap.indent(data, "    ") + "\n"
    assert (line, path) in located(text)
