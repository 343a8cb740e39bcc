"""The ``tandem`` command line: one module per subcommand."""
