"""The stages: one module per ``workflow/rules/*.smk``, the only layer that reads CLI arguments and paths.

Each module's ``register(subparsers)`` adds its subcommands; every command parses its arguments, loads the config
and calls the libraries below (data, models, traces, predictors, runtime, render). Nothing below imports a stage.
"""

STAGES = ("data", "models", "traces", "predictors", "device", "render")
