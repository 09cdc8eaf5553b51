"""The runtime's node workers (plain Python) and their rclpy wrappers."""
