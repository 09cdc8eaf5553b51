"""Reading and writing recorded robot episodes (rosbag2 via the pure-Python ``rosbags`` package, no ROS needed)."""
