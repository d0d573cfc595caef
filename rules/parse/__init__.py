"""TL9xx: problems that stop a file from being linted at all (reported by the engine itself)."""
