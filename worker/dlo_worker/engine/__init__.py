"""Requests and their execution: validation, waves of requests run together, one
pipeline call per wave, and the images they produce."""
