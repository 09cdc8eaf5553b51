"""pip-installable package for the ROS-free tools (bench, inspect, replay, build-cache).

The ROS 2 build (messages in msg/, node executables) goes through CMakeLists.txt with colcon;
both install the same `vla_runtime` Python package.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
requirements = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]

setup(
    name="vla_runtime",
    version="0.1.0",
    description="Real-time inference runtime for flow-matching VLA policies (pi0.5) under ROS 2",
    python_requires=">=3.10",
    packages=find_packages(include=["vla_runtime", "vla_runtime.*"]),
    install_requires=["torch>=2.4"] + [r for r in requirements if r],
    data_files=[
        ("share/ament_index/resource_index/packages", []),
        ("share/vla_runtime", ["package.xml"]),
        ("share/vla_runtime/config", [str(p) for p in sorted((ROOT / "config").glob("*.yaml"))]),
        ("share/vla_runtime/msg", [str(p) for p in sorted((ROOT / "msg").glob("*.msg"))]),
        ("share/vla_runtime/cuda", [str(p) for p in sorted((ROOT / "cuda").glob("*.cu*"))]),
    ],
    entry_points={"console_scripts": ["vla-runtime = vla_runtime.cli:main",
                                      "vla-vision-node = vla_runtime.nodes.vision_node:main",
                                      "vla-policy-node = vla_runtime.nodes.policy_node:main",
                                      "vla-cache-manager-node = vla_runtime.nodes.cache_manager_node:main"]},
)
