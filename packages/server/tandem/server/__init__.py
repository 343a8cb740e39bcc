"""Tandem's user-facing layer: the ``tandem`` command line (and, later, the HTTP server)."""
