"""The package version: its one home, a leaf that imports nothing.

``pyproject.toml`` reads it (``tool.setuptools.dynamic``), ``pat_engine.__version__`` re-exports it,
and the server's info routes and profile tables' deployment records import it from here.
"""

__version__ = "0.1.0"
