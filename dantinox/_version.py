"""The dantinox version, a leaf module: run directories, profiles and plans record it."""

__version__ = "0.1.0"
