"""The tests are a package: every test module is ``tests.<dir>.test_<module>``, so a test
directory named like an installed package (``ray``, ``models``, ``server``...) never shadows
it under pytest's default (prepend) import mode."""
