"""The ``constrained-serve`` command line: ``command.py`` parses and runs the subcommands
(generate, extract, serve, info), ``specs.py`` turns the output-spec flags into a spec,
``info.py`` describes the installation."""

from .command import main

__all__ = ["main"]
