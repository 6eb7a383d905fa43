"""CLI subcommands. Each module defines `HELP`, `add_arguments(parser)` and `run(args) -> int`; heavy imports happen
inside `run` so that `dicache --help` stays fast."""
