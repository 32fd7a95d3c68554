"""The package version: the one place it is written.

pyproject.toml reads it (``dynamic = ["version"]``), and so do ``spotguard.__version__`` and
``spotguard --version``. Bump it together with a new section in CHANGELOG.md.
"""

__version__ = "0.1.0"
