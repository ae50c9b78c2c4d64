"""`python -m constrained_serve.models.prepare_default`: convert the default model once
(run by `make setup`, so the first `Engine()` does not pay the GGUF conversion)."""

from __future__ import annotations

import logging

from .loader import default_model_dir


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = default_model_dir()
    logging.getLogger(__name__).info("default model ready at %s", path)


if __name__ == "__main__":
    main()
