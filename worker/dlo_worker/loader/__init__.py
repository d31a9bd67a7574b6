"""Loader-owned host storage: a diffusers-format directory becomes a pipeline plus, when
preflight proves it, a MappedCheckpoint for the DiT.

This package's top level stays torch-free (the CLI checks a directory before importing
torch); the loader itself is :mod:`dlo_worker.loader.diffusers_loader`.
"""

from dlo_worker.loader.model_directory import ModelDirectoryError, check_model_directory

__all__ = ["ModelDirectoryError", "check_model_directory"]
