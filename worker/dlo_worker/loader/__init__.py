"""Loader-owned host storage: turn a diffusers-format directory into a pipeline on a device."""

from dlo_worker.loader.pipeline import ModelDirectoryError, check_model_directory, load_pipeline

__all__ = ["ModelDirectoryError", "check_model_directory", "load_pipeline"]
