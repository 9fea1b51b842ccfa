"""The repository as a whole: examples, the README commands, the shape of the code."""
