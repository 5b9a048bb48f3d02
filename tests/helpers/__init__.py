"""Helpers shared by the test files: reference implementations, small models, recorded runs."""
