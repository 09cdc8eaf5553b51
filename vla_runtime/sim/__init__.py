"""Synthetic episodes (no physics) for tests, benchmarks and the similarity structure of repeated tasks."""
