"""The recipe language.

YAML parsed into frozen dataclasses, parameters sampled, commands templated.
"""
