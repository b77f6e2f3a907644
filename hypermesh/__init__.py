"""hypermesh: batch deep-learning work on a mesh of on-prem and preemptible cloud machines."""

__version__ = "0.1.0"
