"""The package version (its own module: any layer may read it without importing the package facade)."""
__version__ = "0.1.0"
