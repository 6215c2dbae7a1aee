"""Compatibility layers for other clouds' APIs."""
