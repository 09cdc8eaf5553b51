#!/usr/bin/env python3
"""Point the ROS 2 wheels' CMake exports at this interpreter's headers.

The PyPI wheels of ROS 2 Jazzy (`ros-jazzy-*`) were built in a manylinux container, and each
message package's `share/<pkg>/cmake/export_<pkg>__rosidl_generator_pyExport.cmake` still names
that container's include directories as INTERFACE_INCLUDE_DIRECTORIES of the imported
`<pkg>::<pkg>__rosidl_generator_py` target:

    /opt/python/cp311-cp311/include/python3.11
    /opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include

CMake refuses an imported target whose include directory does not exist, so building our own
messages (which depend on std_msgs, builtin_interfaces, ...) fails until those two paths are
rewritten to this interpreter's include directory (`sysconfig`) and `numpy.get_include()`.

Run it with the virtualenv's interpreter, after installing the wheels and before `colcon build`:

    .venv/bin/python tools/ros/fix_rosidl_exports.py

It is idempotent: a file already fixed is left alone. It exits non-zero with a message when
there is nothing to fix (wheels missing) or when the target directories are unusable.
"""

from __future__ import annotations

import argparse
import re
import sys
import sysconfig
from pathlib import Path

EXPORT_GLOB = "share/*/cmake/export_*__rosidl_generator_pyExport.cmake"

# The quoted CMake list of include directories; entries are separated by ';'.
INCLUDE_LIST = re.compile(r'(INTERFACE_INCLUDE_DIRECTORIES\s+")([^"]*)(")')
NUMPY_INCLUDE = re.compile(r"/numpy/(_core|core)/include/?$")
PYTHON_INCLUDE = re.compile(r"/include/python3\.\d+/?$")


def fail(message: str) -> None:
    print(f"fix_rosidl_exports: error: {message}", file=sys.stderr)
    sys.exit(1)


def target_dirs() -> tuple[str, str]:
    """This interpreter's Python include dir and NumPy include dir, checked to exist."""
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").is_file():
        fail(f"{python_include}/Python.h not found: install the Python development headers "
             f"for {sys.executable}")
    try:
        import numpy
    except ImportError:
        fail(f"numpy is not importable from {sys.executable}: install it into this environment first")
    numpy_include = numpy.get_include()
    if not (Path(numpy_include) / "numpy" / "arrayobject.h").is_file():
        fail(f"{numpy_include}/numpy/arrayobject.h not found")
    return python_include, numpy_include


def rewrite(text: str, python_include: str, numpy_include: str) -> str:
    """Point every Python or NumPy include entry of the include lists in `text` at ours.

    Matching by shape rather than by the literal /opt/python prefix also repairs a file that an
    earlier run pointed at another interpreter (a recreated virtualenv). Entries naming
    /opt/python that are neither are an error: the wheels changed and this script must learn them.
    """

    def fix_entry(entry: str) -> str:
        if NUMPY_INCLUDE.search(entry):
            return numpy_include
        if PYTHON_INCLUDE.search(entry):
            return python_include
        if entry.startswith("/opt/python/"):
            fail(f"unrecognised wheel-builder path {entry!r}: extend tools/ros/fix_rosidl_exports.py")
        return entry

    def fix_list(match: re.Match[str]) -> str:
        entries = [fix_entry(e) for e in match.group(2).split(";")]
        return match.group(1) + ";".join(entries) + match.group(3)

    return INCLUDE_LIST.sub(fix_list, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=Path, default=Path(sys.prefix),
                        help="install prefix holding share/<pkg>/cmake (default: this interpreter's, %(default)s)")
    args = parser.parse_args()

    files = sorted(args.prefix.glob(EXPORT_GLOB))
    if not files:
        fail(f"no {EXPORT_GLOB} under {args.prefix}: are the ros-jazzy-* wheels installed there?")

    python_include, numpy_include = target_dirs()
    changed = 0
    for path in files:
        text = path.read_text()
        fixed = rewrite(text, python_include, numpy_include)
        if "/opt/python/" in fixed:
            fail(f"{path} still names /opt/python/ outside its include lists: the wheel layout changed")
        if fixed != text:
            path.write_text(fixed)
            changed += 1
    print(f"fix_rosidl_exports: {changed} of {len(files)} export files rewritten "
          f"(python include {python_include}, numpy include {numpy_include})")


if __name__ == "__main__":
    main()
