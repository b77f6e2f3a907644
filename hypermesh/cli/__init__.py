"""The ``hypermesh`` command line."""
