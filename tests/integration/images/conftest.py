"""Registry fixtures for the image tests (a real docker-registry on loopback)."""

from tests.fixtures.registry import (  # noqa: F401 - fixtures are found by name
    basic_auth_registry,
    corrupting_proxy,
    registry,
    token_auth_registry,
)
