"""The ``constrained-serve`` command line: ``command.py`` parses and runs the subcommands
(generate, extract, serve, info), ``extract_command.py`` runs the extract job (locally or on
Ray), ``engine_setup.py`` builds what they share (spec, sampling parameters, Engine),
``specs.py`` turns the output-spec flags into a spec, ``info.py`` describes the installation."""

from .command import main

__all__ = ["main"]
