"""The engine's version (``engine.__version__``), in a module of its own so that lower layers
(checkpoint metadata) can read it without importing the package facade."""

__all__ = ["__version__"]

__version__ = "0.1.0"
