"""The test suite: folders by subject over tests/support (see README.md, Layout)."""
