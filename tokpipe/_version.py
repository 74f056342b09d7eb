"""The version, apart from the package so that modules that record it import nothing else."""

__version__ = "0.1.0"
