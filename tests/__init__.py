"""The test suite: folders by subject over tests/support (see docs/layout.md)."""
