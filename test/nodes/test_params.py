"""The nodes' start-up overrides of the profile (``device``, ``dtype``, ``cache``: what the launch
arguments set) and the checkpoint a node starts with."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from vla_runtime.nodes import params as P
from vla_runtime.nodes.profile import ProfileError

CONFIG = Path(__file__).resolve().parents[2] / "config"


def _values(**kw) -> dict:
    return {**{n: p.default for n, p in P.POLICY.items()}, **kw}


def test_every_node_takes_the_overrides():
    for table in (P.VISION, P.POLICY, P.CACHE_MANAGER):
        assert {"profile", "checkpoint", "device", "dtype", "cache"} <= set(table)
        assert all(not table[n].dynamic for n in ("device", "dtype", "cache"))   # fixed at start-up


@pytest.mark.parametrize("name, value, why", [
    ("device", "gpu", "must be auto, cpu, cuda or cuda:N"), ("dtype", "int8", "must be one of"),
    ("cache", "yes", "must be one of"),
])
def test_a_bad_override_is_refused_by_name(name, value, why):
    (problem,) = P.check_values(P.POLICY, {name: value})
    assert problem.startswith(f"{name}: ") and why in problem


def test_overrides_replace_the_profiles_settings_and_empty_keeps_them():
    prof, ckpt = P.profile_and_checkpoint(_values(profile=str(CONFIG / "aloha.yaml")))
    assert (prof.engine.device, prof.engine.dtype, prof.cache.enabled) == ("auto", "bfloat16", False)
    assert Path(ckpt) == CONFIG.parent / "checkpoints" / "pi05-aloha-transfer-cube"
    prof, ckpt = P.profile_and_checkpoint(_values(profile=str(CONFIG / "aloha.yaml"), device="cpu", dtype="float32",
                                                  checkpoint="/data/other"))
    assert (prof.engine.device, prof.engine.dtype, ckpt) == ("cpu", "float32", "/data/other")


def test_cache_on_needs_a_repository_and_off_turns_it_off(tmp_path):
    with pytest.raises(ProfileError, match="cache.repository: required when the cache is enabled"):
        P.profile_and_checkpoint(_values(profile=str(CONFIG / "aloha.yaml"), cache="on"))
    d = yaml.safe_load((CONFIG / "sim.yaml").read_text())
    d["cache"] = {"enabled": True, "repository": "/r"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(d))
    prof, _ = P.profile_and_checkpoint(_values(profile=str(tmp_path / "p.yaml"), cache="off", checkpoint="/c"))
    assert prof.cache.enabled is False


def test_no_profile_or_no_checkpoint_is_one_clear_reason():
    with pytest.raises(ValueError, match=re.escape("no profile: set the 'profile' parameter")):
        P.profile_and_checkpoint(_values())
    with pytest.raises(ValueError, match=re.escape("no checkpoint: set the 'checkpoint' parameter (checkpoint:=DIR)")):
        P.profile_and_checkpoint(_values(profile=str(CONFIG / "franka.yaml")))


def test_ring_names_follow_the_namespace_unless_set():
    """Two pipelines in two namespaces get two sets of rings; the root namespace keeps the plain
    names; a name set by parameter wins."""
    assert P.ring_names({"ring": "", "working_set": ""}, "/") == P.RingNames("vla_prefix", "vla_refs")
    assert P.ring_names({"ring": "", "working_set": ""}, "/cell/robot1") == \
        P.RingNames("vla_prefix_cell_robot1", "vla_refs_cell_robot1")
    assert P.ring_names({"ring": "mine", "working_set": ""}, "/r2") == P.RingNames("mine", "vla_refs_r2")
    assert P.ring_names({}, "/r2").working_set == "vla_refs_r2"      # the policy node has no 'ring'


def test_a_profiles_checkpoint_missing_where_it_resolves_says_to_pass_one(tmp_path):
    """The sim profile names ``out/demo/checkpoint`` (written by ``demo-data`` in a checkout);
    loaded from anywhere else (an install's share folder) it resolves to nothing: the node says
    where it looked and how to give one, instead of a bare loader error."""
    d = yaml.safe_load((CONFIG / "sim.yaml").read_text())
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "sim.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError) as e:
        P.profile_and_checkpoint(_values(profile=str(tmp_path / "config" / "sim.yaml")))
    assert str(e.value).startswith(f"{tmp_path / 'out' / 'demo' / 'checkpoint'}: no such checkpoint")
    assert "checkpoint:=DIR" in str(e.value)
    _, ckpt = P.profile_and_checkpoint(_values(profile=str(tmp_path / "config" / "sim.yaml"),
                                               checkpoint="/data/elsewhere"))
    assert ckpt == "/data/elsewhere"    # a checkpoint given is the loader's to check, as before
