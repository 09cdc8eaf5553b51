"""Muscle-memory cache (DESIGN.md §5-§7): Context and Action Cache reuse, the on-disk
reference repository, reference retrieval, and the sliding working set of prepared references."""
