"""The ``passrate-jax`` command line: the entry point and one module per subcommand."""
