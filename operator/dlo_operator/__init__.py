"""diffusion-dlo operator: reconciles DiffusionDeployment resources into worker Pods.

Imports no torch; it validates specs with :mod:`dlo_worker.config`.
"""
