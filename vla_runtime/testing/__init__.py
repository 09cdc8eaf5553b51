"""Helpers shared by the test suite and tools (private network namespaces, ROS 2 environment)."""
