"""The ``sparserl`` command line: one module per subcommand, beside (not inside) the call path.

``cli.main`` is the entry point; each subcommand module has an ``add_cli(subparsers)`` that
registers its parser. Nothing on a product's path imports this package.
"""
