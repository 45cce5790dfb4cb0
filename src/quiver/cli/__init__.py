"""The `quiver` command line: parses and prints; the library under it does the work."""
