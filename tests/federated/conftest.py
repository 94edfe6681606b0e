"""Fixtures of the federated tests; the plain helpers live in fed_helpers.py."""

from fed_helpers import tiny_model  # noqa: F401  (fixture)
