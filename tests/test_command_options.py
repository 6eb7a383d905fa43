"""Every command-line option is derived from one declaration (`dicache.settings.options.option`): a bad value is a
usage error naming the flag, every option of every command is a declared field (or a grid axis derived from the
cache settings), and the Ray Serve builder's `ReplicaOptions` are the `dicache serve` options' own declarations."""

import argparse

import pytest

from dicache.cli import SUBCOMMANDS, build_parser, main
from dicache.commands.fields import argument
from dicache.commands.serve import parse_serve_argv
from dicache.commands.sweep import GRID_AXES
from dicache.errors import ConfigError
from dicache.server.ray.options import ReplicaOptions
from dicache.settings.options import Options


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "x", "--steps", "-3"], "argument --steps: '-3' is invalid: must be an integer >= 1"),
        (["generate", "x", "--guidance", "0.5"], "argument --guidance: '0.5' is invalid: must be a finite number >= 1"),
        (["generate", "x", "--num-images", "0"], "argument --num-images: '0' is invalid: must be an integer >= 1"),
        (["generate", "x", "--cache", "maybe"], "argument --cache: invalid choice: 'maybe'"),
        (["calibrate", "--steps", "0"], "argument --steps: '0' is invalid: must be an integer >= 1"),
        (["calibrate", "--preset", "fast"], "argument --variant/--preset: invalid choice: 'fast'"),
        (["calibrate", "--guidance", "nan"], "argument --guidance: 'nan' is invalid: must be a finite number >= 1"),
        (["calibrate", "--size", "12xab"], "argument --size: expected N or WIDTHxHEIGHT in px"),
        (["sweep", "--num-prompts", "0"], "argument --num-prompts: '0' is invalid: must be an integer >= 1"),
        (["sweep", "--threads", "0"], "argument --threads: '0' is invalid: must be an integer >= 1"),
        (["serve", "--torch-threads", "0"], "argument --torch-threads: '0' is invalid: must be an integer >= 1"),
        (["serve", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("usage: dicache") and message in err


def test_a_size_off_the_checkpoints_multiple_names_the_option(capsys, tmp_path):
    code = main(
        ["generate", "x", "--height", "60", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "a.png")]
    )
    assert code == 2 and "--height=60 is invalid: must be a multiple of 8 px" in capsys.readouterr().err
    assert not (tmp_path / "a.png").exists()


def _declared() -> list[type[Options]]:
    found, todo = [], list(Options.__subclasses__())
    while todo:
        model = todo.pop()
        found.append(model)
        todo += model.__subclasses__()
    return found


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_option_is_a_declared_field(command):
    """Each option's flags and help are those its declaration derives (`fields.argument`); the sweep's grid axes
    are the cache settings' short names (`GRID_AXES`). A hand-written `add_argument` fails here."""
    parser = _subparsers()[command]  # imports every command module: each declares its options
    declared = {}
    for model in _declared():
        for field in model.model_fields.values():
            flag = (field.json_schema_extra or {}).get("flag")
            if flag:
                declared.setdefault(flag, []).append(field)
    axes = {f"--{flag.replace('_', '-')}" for flag, _, _ in GRID_AXES}
    seen = 0
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        seen += 1
        if action.dest.startswith("axis_"):
            assert command == "sweep" and set(action.option_strings) <= axes, action.option_strings
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest
        assert flag in declared, f"dicache {command} {flag}: not a declared option"
        assert any(argument(field)["help"] == action.help for field in declared[flag]), flag
    assert seen >= 3


def test_the_replica_options_are_the_serve_commands_declarations():
    """The builder's names, bounds and help are the command line's: one declaration each."""
    serve = {a.option_strings[0]: a for a in _subparsers()["serve"]._actions if a.option_strings}
    for name, field in ReplicaOptions.model_fields.items():
        flag = field.json_schema_extra["flag"]
        assert flag in serve and serve[flag].help == argument(field)["help"], name
        owners = [base for base in ReplicaOptions.__mro__[1:] if name in getattr(base, "__annotations__", {})]
        assert len(owners) == 1, (name, owners)  # declared in exactly one of the option groups it is made of
    with pytest.raises(ConfigError, match=r"^--torch-threads=0 is invalid: must be an integer >= 1$"):
        ReplicaOptions(torch_threads=0)
    with pytest.raises(ConfigError, match=r"argument --torch-threads: '0' is invalid: must be an integer >= 1"):
        parse_serve_argv(["--torch-threads", "0"])


def test_prepare_text_lengths_runs_in_the_background_by_default_and_takes_the_earlier_switch_words():
    assert parse_serve_argv([]).prepare_text_lengths == "background"
    for words, mode in ((["before-ready"], "before-ready"), (["true"], "before-ready"), (["false"], "off")):
        assert parse_serve_argv(["--prepare-text-lengths", *words]).prepare_text_lengths == mode
    assert ReplicaOptions(prepare_text_lengths=False).prepare_text_lengths == "off"  # a builder's boolean
    assert ReplicaOptions(prepare_text_lengths=True).prepare_text_lengths == "before-ready"
    with pytest.raises(ConfigError, match=r"--prepare-text-lengths='soon' is invalid: must be one of 'background'"):
        ReplicaOptions(prepare_text_lengths="soon")
    with pytest.raises(ConfigError, match=r"argument --prepare-text-lengths: invalid choice: 'soon'"):
        parse_serve_argv(["--prepare-text-lengths", "soon"])
