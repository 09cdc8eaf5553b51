"""Reference retrieval: visual top-T, joint-history rerank, fallback, stall, task packs."""

from __future__ import annotations

import pytest
import torch

from vla_runtime.cache.retrieval import (
    CandidateMatrix,
    Match,
    RetrievalConfig,
    Retriever,
    TaskPacks,
    candidates_from_repository,
    fallback_rule,
    first_call_floors,
)

F, L, D = 16, 3, 4
TASK = "stack blocks"


def unit(*xs: float) -> torch.Tensor:
    v = torch.zeros(F)
    v[: len(xs)] = torch.tensor(xs)
    return v


def matrix(entries: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]], capacity: int = 32) -> CandidateMatrix:
    m = CandidateMatrix(capacity, F, L, D)
    for key, (feat, hist) in entries.items():
        m.put(key, feat, hist)
    return m


def retriever(m: CandidateMatrix, max_calls: int = 40, **cfg) -> Retriever:
    r = Retriever(RetrievalConfig(history_len=L, **cfg), TaskPacks({TASK: m}))
    r.start_episode(TASK, max_calls=max_calls)
    return r


def test_planted_nearest_is_picked():
    g = torch.Generator().manual_seed(0)
    entries = {(f"ep{e}", i): (torch.randn(F, generator=g), torch.randn(L, D, generator=g))
               for e in range(3) for i in range(6)}
    feat, hist = entries[("ep2", 4)]
    r = retriever(matrix(entries))
    m = r.query((feat + 0.01 * torch.randn(F, generator=g)).reshape(2, 8).half(), hist)
    assert isinstance(m, Match) and m.key == ("ep2", 4)
    assert m.similarity > 0.99 and m.joint_distance == pytest.approx(0.0, abs=1e-6)
    assert r.stats.queries == 1 and r.stats.hits == 1 and r.stats.last_similarity == pytest.approx(m.similarity)


@pytest.mark.parametrize("closer", ["a", "b"])
def test_joint_rerank_breaks_a_visual_tie(closer):
    feat = unit(1, 2, 3)
    ha, hb = torch.zeros(L, D), torch.ones(L, D)
    r = retriever(matrix({("a", 0): (feat, ha), ("b", 0): (feat, hb)}))
    query_hist = (ha if closer == "a" else hb) + 0.1
    m = r.query(feat, query_hist)
    assert m.episode_id == closer
    assert m.joint_distance == pytest.approx(0.1, rel=1e-5)


def test_rerank_only_within_top_t():
    """A candidate outside the visual top T is never chosen, however close its joints are."""
    h = torch.zeros(L, D)
    entries = {("a", 0): (unit(1, 0.10), h + 1.0), ("b", 0): (unit(1, 0.12), h + 2.0), ("c", 0): (unit(1, 0.3), h)}
    m = retriever(matrix(entries), top_t=2).query(unit(1, 0.1), h)
    assert m.episode_id == "a"


def test_dual_arm_uses_the_larger_arm_distance():
    feat, cur = unit(1), torch.zeros(L, D)
    a = cur.clone()
    a[:, :2] = 0.6                    # arm RMS (0.6, 0.0); whole-state RMS 0.42
    b = cur + 0.5                     # arm RMS (0.5, 0.5); whole-state RMS 0.5
    entries = {("a", 0): (feat, a), ("b", 0): (feat, b)}
    single = retriever(matrix(entries)).query(feat, cur)
    assert single.episode_id == "a" and single.joint_distance == pytest.approx(0.6 / 2**0.5, rel=1e-5)
    dual = retriever(matrix(entries), arm_slices=((0, 2), (2, 4))).query(feat, cur)
    assert dual.episode_id == "b" and dual.joint_distance == pytest.approx(0.5, rel=1e-5)


def test_history_longer_than_history_len_is_aligned_on_the_last_rows():
    feat = unit(1)
    r = retriever(matrix({("a", 0): (feat, torch.zeros(L, D))}))
    long_hist = torch.cat([torch.full((5, D), 9.0), torch.zeros(L, D)])
    assert r.query(feat, long_hist).joint_distance == 0.0
    with pytest.raises(ValueError, match="state_history"):
        r.query(feat, torch.zeros(L - 1, D))


def test_fallback_below_threshold_persists_until_next_episode():
    h = torch.zeros(L, D)
    r = retriever(matrix({("a", 0): (unit(1, 0), h)}))
    assert r.query(unit(0.79, (1 - 0.79**2) ** 0.5), h) is None       # cosine 0.79
    assert r.fallback and "fallback" in r.reason and r.stats.fallbacks == 1
    assert r.stats.last_similarity == pytest.approx(0.79, abs=1e-5)
    assert r.query(unit(1, 0), h) is None                              # perfect match, still dense
    assert r.stats.fallbacks == 1 and r.stats.misses == 2
    r.start_episode(TASK, max_calls=40)
    assert not r.fallback
    assert r.query(unit(0.81, (1 - 0.81**2) ** 0.5), h).episode_id == "a"


def test_first_scene_floor_applies_to_the_first_search_only():
    h = torch.zeros(L, D)
    m = matrix({("a", 0): (unit(1, 0), h), ("a", 1): (unit(0, 1), h)})
    r = retriever(m, first_call_floor={TASK: 0.95, "other task": 0.99})
    assert r.query(unit(0.9, (1 - 0.9**2) ** 0.5), h) is None          # above 0.8, below the task's floor
    assert r.fallback and "first scene" in r.reason and r.stats.fallbacks == 1
    r.start_episode(TASK, max_calls=40)
    assert r.query(unit(0.96, (1 - 0.96**2) ** 0.5), h).key == ("a", 0)   # first scene above the floor
    assert r.query(unit(0.9, (1 - 0.9**2) ** 0.5), h).key == ("a", 0)     # later calls: only min_similarity


def test_first_scene_floor_with_no_prepared_candidate_waits_for_the_first_real_search():
    h = torch.zeros(L, D)
    m = CandidateMatrix(4, F, L, D)
    r = retriever(m, first_call_floor={TASK: 0.95})
    assert r.query(unit(0.9, 0.4359), h) is None and not r.fallback    # nothing prepared yet: not a fallback
    m.put(("a", 0), unit(1, 0), h)
    assert r.query(unit(0.9, (1 - 0.9**2) ** 0.5), h) is None and r.fallback   # the first real search


def test_stall_after_max_calls_repeats():
    h, feat = torch.zeros(L, D), unit(1)
    seen = []
    packs = TaskPacks({TASK: matrix({("a", 7): (feat, h)})})
    r = Retriever(RetrievalConfig(history_len=L), packs, on_stall=seen.append)
    r.start_episode(TASK, max_calls=3)
    assert all(r.query(feat, h) is not None for _ in range(3))
    assert not r.stalled
    assert r.query(feat, h) is None
    assert r.stalled and "stall" in r.reason and r.stats.stalls == 1
    assert [m.key for m in seen] == [("a", 7)]
    assert r.query(feat, h) is None and r.stats.stalls == 1           # latched, reported once
    r.reset()
    assert not r.stalled and r.query(feat, h).key == ("a", 7)


def test_past_the_references_runs_the_rest_of_the_episode_dense():
    """Matches to a reference's last call are counted over the episode, whichever reference; one
    more than ``max_end_matches`` runs the rest of the episode dense, until the next episode."""
    h = torch.zeros(L, D)
    m = matrix({("a", 0): (unit(1, 0), h), ("a", 1): (unit(0, 1), h), ("b", 2): (unit(1, 1), h)})
    r = Retriever(RetrievalConfig(history_len=L, max_end_matches=2), TaskPacks({TASK: m}))
    r.start_episode(TASK, max_calls=40, episode_lengths={"a": 2, "b": 3})
    assert r.query(unit(1, 0), h).key == ("a", 0) and r.end_matches == 0       # not a last call
    assert r.query(unit(0, 1), h).key == ("a", 1)                               # a's last call
    assert r.query(unit(1, 0), h).key == ("a", 0)                               # the count is not reset
    assert r.query(unit(1, 1), h).key == ("b", 2) and r.end_matches == 2        # b's last call
    assert r.query(unit(0, 1), h) is None and r.fallback and r.stats.past_end == 1
    assert r.reason.startswith("past the references: match 3 to a reference's last call") \
        and "dense for the rest of the episode" in r.reason
    assert r.query(unit(1, 0), h) is None and r.stats.past_end == 1              # latched, counted once
    r.start_episode(TASK, max_calls=40, episode_lengths={"a": 2, "b": 3})
    assert r.query(unit(0, 1), h).key == ("a", 1) and not r.fallback and r.end_matches == 1


@pytest.mark.parametrize("cfg, lengths", [({"max_end_matches": 0}, {"a": 1}), ({"max_end_matches": 1}, None)])
def test_past_the_references_off_without_a_limit_or_without_episode_lengths(cfg, lengths):
    h, feat = torch.zeros(L, D), unit(1)
    r = Retriever(RetrievalConfig(history_len=L, **cfg), TaskPacks({TASK: matrix({("a", 0): (feat, h)})}))
    r.start_episode(TASK, max_calls=40, episode_lengths=lengths)
    assert all(r.query(feat, h) is not None for _ in range(5)) and not r.fallback


def test_unknown_task_runs_dense():
    r = Retriever(RetrievalConfig(history_len=L), TaskPacks({TASK: matrix({("a", 0): (unit(1), torch.zeros(L, D))})}))
    r.start_episode("fold towel", max_calls=10)
    assert "unknown task" in r.reason
    assert r.query(unit(1), torch.zeros(L, D)) is None and "unknown task" in r.reason
    assert not r.fallback


def test_no_prepared_candidates_is_not_a_fallback():
    r = retriever(CandidateMatrix(4, F, L, D))
    assert r.query(unit(1), torch.zeros(L, D)) is None
    assert r.reason == "no prepared candidates" and not r.fallback


def test_call_zero_selects_candidate_episodes():
    h = torch.zeros(L, D)
    entries = {}
    for ep, y in (("A", 0.0), ("B", 0.3), ("C", 0.6)):
        for i in range(3):
            entries[(ep, i)] = (unit(1, y, 0.01 * i), h)
    r = retriever(matrix(entries), top_t=2)
    assert r.candidate_episodes() == []
    assert r.query(unit(1, 0), h).episode_id == "A"
    assert r.candidate_episodes() == ["A", "B"]
    # C matches this exactly, but later calls stay within the episodes chosen at call 0.
    m = r.query(unit(1, 0.6), h)
    assert m.episode_id == "B"
    r.start_episode(TASK, max_calls=40)
    assert r.candidate_episodes() == []
    assert r.query(unit(1, 0.6), h).episode_id == "C"


def test_candidate_matrix_slots():
    m = CandidateMatrix(2, F, L, D)
    m.put(("a", 0), unit(3, 4), torch.zeros(L, D))
    assert torch.allclose(m.features[0], unit(0.6, 0.8))                  # stored normalised
    m.put(("a", 1), unit(1), torch.zeros(L, D))
    with pytest.raises(ValueError, match="full"):
        m.put(("b", 0), unit(1), torch.zeros(L, D))
    m.remove(("a", 0))                                                    # rows stay packed:
    assert m.keys == [("a", 1)] and torch.allclose(m.features[0], unit(1))  # the last row filled the hole
    assert m.put(("b", 0), unit(1), torch.zeros(L, D)) == 1 and len(m) == 2 and ("a", 0) not in m
    assert m.features.shape[0] == 2
    with pytest.raises(ValueError, match="history"):
        m.put(("c", 0), unit(1), torch.zeros(L + 1, D))


def test_config_validation():
    with pytest.raises(ValueError, match="top_t"):
        RetrievalConfig(top_t=0)
    with pytest.raises(ValueError, match="arm_slices"):
        RetrievalConfig(arm_slices=((3, 1),))
    with pytest.raises(ValueError, match="first_call_floor"):
        RetrievalConfig(first_call_floor={TASK: 1.5})
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_end_matches"):
            RetrievalConfig(max_end_matches=bad)
    r = retriever(matrix({("a", 0): (unit(1), torch.zeros(L, D))}), arm_slices=((0, 2), (2, 5)))
    with pytest.raises(ValueError, match="exceed the state dimension"):
        r.query(unit(1), torch.zeros(L, D))
    with pytest.raises(RuntimeError, match="start_episode"):
        Retriever(RetrievalConfig(), TaskPacks({})).query(unit(1), torch.zeros(L, D))


def test_candidates_from_repository(tmp_path):
    from vla_runtime.cache.repository import ReferenceCall, ReferenceRepository, RepositoryMeta

    g = torch.Generator().manual_seed(0)

    def call() -> ReferenceCall:
        return ReferenceCall(
            images=torch.zeros(1, 4, 4, 3, dtype=torch.uint8), image_mask=torch.ones(1, dtype=torch.bool),
            tokens=torch.zeros(3, dtype=torch.int64), token_mask=torch.ones(3, dtype=torch.bool),
            state=torch.randn(D, generator=g), state_history=torch.randn(L, D, generator=g),
            retrieval=torch.randn(2, F // 2, generator=g).half(), masks=torch.zeros(1, 1, 2, dtype=torch.int32))

    repo = ReferenceRepository.create(tmp_path / "r", RepositoryMeta(
        checkpoint_hash="sha256:x", model={}, retrieval_layer=1, rho_n=0.5, mask_groups=[[0, 10]], history_len=L))
    repo.add_episode("e0", TASK, [call() for _ in range(4)])
    repo.add_episode("e1", TASK, [call() for _ in range(4)])
    target = repo.load_call("e1", 2)
    r = Retriever(RetrievalConfig(history_len=L), candidates_from_repository(repo))
    r.start_episode(TASK, max_calls=8)
    assert r.query(target.retrieval, target.state_history).key == ("e1", 2)


def test_first_call_floors_is_the_least_similar_first_scene_leaving_its_episode_out(tmp_path):
    from vla_runtime.cache.repository import ReferenceCall, ReferenceRepository, RepositoryMeta

    def call(feature: torch.Tensor) -> ReferenceCall:
        return ReferenceCall(
            images=torch.zeros(1, 4, 4, 3, dtype=torch.uint8), image_mask=torch.ones(1, dtype=torch.bool),
            tokens=torch.zeros(3, dtype=torch.int64), token_mask=torch.ones(3, dtype=torch.bool),
            state=torch.zeros(D), state_history=torch.zeros(L, D),
            retrieval=feature.reshape(2, F // 2).half(), masks=torch.zeros(1, 1, 2, dtype=torch.int32))

    repo = ReferenceRepository.create(tmp_path / "r", RepositoryMeta(
        checkpoint_hash="sha256:x", model={}, retrieval_layer=1, rho_n=0.5, mask_groups=[[0, 10]], history_len=L))
    c = 0.6   # e0's first scene: cosine c to e1's later call, 0 to everything else
    repo.add_episode("e0", TASK, [call(unit(1, 0, 0)), call(unit(0, 0, 1))])
    repo.add_episode("e1", TASK, [call(unit(0, 0, 1)), call(unit(c, (1 - c * c) ** 0.5, 0))])
    repo.add_episode("lone", "other task", [call(unit(1)), call(unit(1))])
    floors = first_call_floors(repo)
    # e1's first scene matches e0's second call exactly (1.0); e0's first scene at best c: the floor is c.
    # The own episode is left out (e0's first call is identical to itself), and a task with one
    # episode gets no floor.
    assert floors == {TASK: pytest.approx(c, abs=2e-3)}


def test_fallback_rule_words_each_part_that_is_on():
    assert fallback_rule(0.8, None) == "a best visual similarity below 0.8"
    assert fallback_rule(0.8, {}).endswith("no first-scene floor (no task has two reference episodes)")
    assert "a first scene below the floor of 'open drawer' 0.99712" in fallback_rule(0.8, {"open drawer": 0.997123})
    assert fallback_rule(0.8, None, 1).endswith("; more than 1 match to a reference's last call (past the references)")
    assert fallback_rule(0.8, None, 3).endswith("; more than 3 matches to a reference's last call (past the references)")


def test_similarity_filter_runs_before_the_joint_rerank():
    """A visually poor candidate (cosine 0.47, below min_similarity 0.8) never wins the rerank,
    however close its joint history: the query picks the 0.98 one with the farther history."""
    h = torch.zeros(L, D)
    good = unit(0.98, (1 - 0.98**2) ** 0.5)           # cosine 0.98 to unit(1)
    poor = unit(0.47, 0, (1 - 0.47**2) ** 0.5)        # cosine 0.47 to unit(1)
    entries = {("good", 0): (good, h + 1.0), ("poor", 0): (poor, h)}
    m = retriever(matrix(entries), top_t=4, min_similarity=0.8).query(unit(1), h)
    assert m is not None and m.key == ("good", 0)
    assert m.similarity == pytest.approx(0.98, abs=1e-6) and m.joint_distance == pytest.approx(1.0, rel=1e-6)


# ---------------------------------------------------------------- boundaries found by the mutation run


def test_config_accepts_its_boundaries_and_names_what_it_refuses():
    """The smallest legal values and both ends of the cosine range are accepted; each refusal
    names the key and the offending value."""
    RetrievalConfig(top_t=1, history_len=1, min_similarity=-1.0, first_call_floor={TASK: -1.0})
    RetrievalConfig(min_similarity=1.0, first_call_floor={TASK: 1.0}, arm_slices=((0, 1), (1, 2)))
    bad = [({"history_len": 0}, "RetrievalConfig.history_len must be a positive int, got 0"),
           ({"history_len": "3"}, "RetrievalConfig.history_len must be a positive int, got '3'"),
           ({"min_similarity": 1.5}, r"RetrievalConfig.min_similarity must lie in \[-1, 1\], got 1.5"),
           ({"min_similarity": -1.5}, r"RetrievalConfig.min_similarity must lie in \[-1, 1\], got -1.5"),
           ({"min_similarity": "0.8"}, r"RetrievalConfig.min_similarity must lie in \[-1, 1\], got '0.8'"),
           ({"first_call_floor": {TASK: -1.5}}, r"first_call_floor\['stack blocks'\] must lie in \[-1, 1\], got -1.5"),
           ({"arm_slices": ((0, 0),)}, r"arm_slices entries must be \[start, end\) joint ranges, got \(0, 0\)"),
           ({"arm_slices": ((0, 1, 2),)}, r"arm_slices entries must be \[start, end\) joint ranges, got \(0, 1, 2\)")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            RetrievalConfig(**kwargs)


def test_max_calls_of_one_is_accepted_and_zero_is_named():
    r = retriever(matrix({("a", 0): (unit(1), torch.zeros(L, D))}), max_calls=1)
    assert r.query(unit(1), torch.zeros(L, D)) is not None
    with pytest.raises(ValueError, match="max_calls must be a positive int, got 0"):
        r.start_episode(TASK, max_calls=0)
    with pytest.raises(RuntimeError, match="Retriever.query before start_episode"):
        Retriever(RetrievalConfig(), TaskPacks({})).query(unit(1), torch.zeros(L, D))


def test_a_new_episode_of_a_known_task_starts_clean_and_counts_its_queries():
    """Right after ``start_episode`` nothing is latched and there is no reason (the state the
    selector's note and the ROS diagnostics read: plain booleans, an empty string); the counters
    count every query, across episodes for the lifetime stats."""
    h = torch.zeros(L, D)
    r = retriever(matrix({("a", 0): (unit(1, 0), h)}), max_calls=40)
    assert r.reason == "" and r.fallback is False and r.stalled is False and r.calls == 0
    for _ in range(3):
        r.query(unit(1, 0), h)
    assert r.calls == 3 and r.stats.queries == 3 and r.stats.hits == 3
    r.query(unit(0, 1), h)                                               # cosine 0: a fallback
    r.start_episode(TASK, max_calls=40)
    assert r.calls == 0 and r.reason == "" and r.fallback is False
    r.query(unit(0, 1), h)                                               # and another one
    assert r.stats.fallbacks == 2 and r.stats.queries == 5 and r.stats.hits == 3 and r.stats.misses == 2
    assert r.reason.endswith("; dense for the rest of the episode")


def test_similarity_does_not_depend_on_the_query_scale():
    """Cosine: a query of norm 0.01 matches as well as one of norm 1 (the features are
    activations, their norm varies with the scene)."""
    h = torch.zeros(L, D)
    m = retriever(matrix({("a", 0): (unit(3, 4), h)})).query(0.01 * unit(3, 4), h)
    assert m is not None and m.similarity == pytest.approx(1.0, abs=1e-6)


def test_a_similarity_exactly_at_the_threshold_or_floor_is_kept():
    """Orthogonal features give a cosine of exactly 0.0 in float32, so the boundary is exact:
    ``min_similarity`` 0 and a first-scene floor of 0 both keep it (below, not at, falls back)."""
    h = torch.zeros(L, D)
    at_min = retriever(matrix({("a", 0): (unit(0, 1), h)}), min_similarity=0.0).query(unit(1), h)
    assert at_min is not None and at_min.similarity == 0.0
    at_floor = retriever(matrix({("a", 0): (unit(0, 1), h)}), min_similarity=-1.0,
                         first_call_floor={TASK: 0.0}).query(unit(1), h)
    assert at_floor is not None and at_floor.similarity == 0.0


def test_a_first_scene_at_the_threshold_but_below_the_floor_says_it_was_the_floor():
    h = torch.zeros(L, D)
    r = retriever(matrix({("a", 0): (unit(0, 1), h)}), min_similarity=0.0, first_call_floor={TASK: 0.5})
    assert r.query(unit(1), h) is None
    assert r.reason.startswith("fallback: first scene's best visual similarity 0.00000 < 0.50000")


def test_candidates_of_the_chosen_episodes_all_gone_is_not_a_fallback():
    """The window slid on: the episodes chosen at the first search have no prepared entry left,
    only another episode's. The query runs dense for that call and says why; the episode goes on."""
    h = torch.zeros(L, D)
    m = matrix({("a", 0): (unit(1), h), ("b", 0): (unit(0, 1), h)})
    r = retriever(m, top_t=1)
    assert r.query(unit(1), h).key == ("a", 0) and r.candidate_episodes() == ["a"]
    m.remove(("a", 0))
    assert r.query(unit(1), h) is None
    assert r.reason == "no prepared candidates" and r.fallback is False
    m.put(("a", 1), unit(1), h)
    assert r.query(unit(1), h).key == ("a", 1) and r.reason == ""      # a match clears the last reason


def test_the_followed_episodes_mask_follows_rows_that_move():
    """Which rows belong to the followed episodes is kept between calls, so it must follow the
    matrix: a followed entry removed (another episode's row moves into its place) and another
    put where that row was are scored by the episode they hold now."""
    h = torch.zeros(L, D)
    m = matrix({("a", 0): (unit(1), h), ("b", 0): (unit(1, 0.1), h)})
    r = retriever(m, top_t=1)
    assert r.query(unit(1), h).key == ("a", 0) and r.candidate_episodes() == ["a"]
    assert r.query(unit(1, 0.1), h).key == ("a", 0)          # b is closer but not followed
    m.remove(("a", 0))                                        # b's entry moves into row 0
    assert r.query(unit(1, 0.1), h) is None and r.reason == "no prepared candidates"
    m.put(("a", 1), unit(1, 0.2), h)                          # row 1 now holds a followed entry
    assert m.keys == [("b", 0), ("a", 1)]
    assert r.query(unit(1, 0.1), h).key == ("a", 1)


def test_query_shape_errors_name_both_sides():
    r = retriever(matrix({("a", 0): (unit(1), torch.zeros(L, D))}))
    with pytest.raises(ValueError, match=f"features have {F + 1} elements, the task pack's have {F}"):
        r.query(torch.zeros(F + 1), torch.zeros(L, D))
    long = Retriever(RetrievalConfig(history_len=L + 1), TaskPacks({TASK: matrix({("a", 0): (unit(1), torch.zeros(L, D))})}))
    long.start_episode(TASK, max_calls=4)
    with pytest.raises(ValueError, match=f"task pack histories cover {L} calls, history_len is {L + 1}"):
        long.query(unit(1), torch.zeros(L + 1, D))


def test_a_moved_row_stays_addressable_and_clear_empties_the_matrix():
    """Removing a row moves the last candidate into the hole: that candidate must still be found
    under its key (overwritten in place, removed) afterwards."""
    h = torch.zeros(L, D)
    m = matrix({("a", 0): (unit(1), h), ("b", 0): (unit(0, 1), h), ("c", 0): (unit(0, 0, 1), h)})
    m.remove(("a", 0))                                                  # c moves to row 0
    assert m.put(("c", 0), unit(0, 0, 0, 1), h) == 0 and len(m) == 2   # overwritten where it now is
    assert torch.equal(m.features[0], unit(0, 0, 0, 1))
    m.remove(("c", 0))
    assert m.keys == [("b", 0)] and torch.equal(m.features[0], unit(0, 1))
    m.clear()
    assert len(m) == 0 and ("b", 0) not in m and m.episode_code.numel() == 0
    assert m.put(("d", 0), unit(1), h) == 0 and m.keys == [("d", 0)]


def test_from_tensors_checks_its_rows_and_builds_on_the_cpu_by_default():
    keys = [("a", 0), ("a", 1)]
    feats, hist = torch.randn(2, F), torch.randn(2, L, D)
    with pytest.raises(ValueError, match="2 keys, 3 feature rows, 2 histories"):
        CandidateMatrix.from_tensors(keys, torch.randn(3, F), hist)
    with pytest.raises(ValueError, match="2 keys, 2 feature rows, 1 histories"):
        CandidateMatrix.from_tensors(keys, feats, hist[:1])
    one = CandidateMatrix.from_tensors(keys[:1], feats[:1].reshape(1, 2, F // 2), hist[:1])
    assert one.device == torch.device("cpu") and one.feature_dim == F and one.capacity == 1
    assert torch.allclose(one.features[0], feats[0] / feats[0].norm())
    empty = CandidateMatrix.from_tensors([], torch.empty(0, F), torch.empty(0, L, D))
    assert len(empty) == 0


def test_fallback_rule_is_one_sentence_with_every_part_that_is_on():
    assert fallback_rule(0.8, {}) == ("a best visual similarity below 0.8; no first-scene floor "
                                      "(no task has two reference episodes)")
    assert fallback_rule(0.8, {"a": 0.5, "b": 0.25}, 2) == (
        "a best visual similarity below 0.8; a first scene below the floor of 'a' 0.50000, 'b' 0.25000; "
        "more than 2 matches to a reference's last call (past the references)")
    assert fallback_rule(0.7, None, 1) == ("a best visual similarity below 0.7; more than 1 match to a "
                                           "reference's last call (past the references)")


def _repo_call(feature: torch.Tensor):
    from vla_runtime.cache.repository import ReferenceCall
    return ReferenceCall(
        images=torch.zeros(1, 4, 4, 3, dtype=torch.uint8), image_mask=torch.ones(1, dtype=torch.bool),
        tokens=torch.zeros(3, dtype=torch.int64), token_mask=torch.ones(3, dtype=torch.bool),
        state=torch.zeros(D), state_history=torch.zeros(L, D),
        retrieval=feature.reshape(2, F // 2).half(), masks=torch.zeros(1, 1, 2, dtype=torch.int32))


def _plain_floor(episodes: dict[str, list[torch.Tensor]]) -> float:
    """Per episode, its first call's best cosine to any call of another episode; the least."""
    def cos(a, b):
        return float(a @ b) / float(a.norm() * b.norm())
    return min(max(cos(calls[0], other) for e2, calls2 in episodes.items() if e2 != e for other in calls2)
               for e, calls in episodes.items())


def test_first_call_floors_on_unnormalised_features_of_several_tasks(tmp_path):
    """Features of norms 0.2 to 5 (the floor is a cosine, whatever their scale), three calls per
    episode with later calls unlike first ones (only first calls are queries), a one-episode task
    listed first (skipped, the others still done), and ``tasks`` restricting the answer. The
    features are stored in float16: the plain floor is computed from the stored values."""
    from vla_runtime.cache.repository import ReferenceRepository, RepositoryMeta

    repo = ReferenceRepository.create(tmp_path / "r", RepositoryMeta(
        checkpoint_hash="sha256:x", model={}, retrieval_layer=1, rho_n=0.5, mask_groups=[[0, 10]], history_len=L))
    repo.add_episode("lone", "a lone task", [_repo_call(unit(1)), _repo_call(unit(1))])
    g = torch.Generator().manual_seed(3)
    tasks = {TASK: ("e0", "e1", "e2"), "open drawer": ("d0", "d1")}
    for task, eps in tasks.items():
        for e in eps:
            repo.add_episode(e, task, [_repo_call(torch.randn(F, generator=g) * s) for s in (0.2, 5.0, 1.0)])
    want = {}
    for task in tasks:
        keys, feats = repo.retrieval_matrix(task)
        stored: dict[str, list[torch.Tensor]] = {}
        for (e, _), f in zip(keys, feats.float()):
            stored.setdefault(e, []).append(f)
        want[task] = _plain_floor(stored)
    floors = first_call_floors(repo)
    assert set(floors) == set(tasks)
    for task in tasks:   # float32 cosines against float64 ones of the same float16 features: 1e-5
        assert floors[task] == pytest.approx(want[task], abs=1e-5)
    assert set(first_call_floors(repo, tasks=["open drawer"])) == {"open drawer"}
    packs = candidates_from_repository(repo, tasks=["open drawer"])
    assert set(packs.packs) == {"open drawer"}
    assert {e for e, _ in packs.candidates("open drawer").keys} == {"d0", "d1"}
    assert {e for e, _ in candidates_from_repository(repo).candidates(TASK).keys} == {"e0", "e1", "e2"}


def test_matrix_dimensions_accept_one_and_name_what_they_refuse():
    CandidateMatrix(1, 1, 1, 1)
    for i, name in enumerate(("capacity", "feature_dim", "history_len", "state_dim")):
        for bad in (0, "2"):
            dims = [2, 2, 2, 2]
            dims[i] = bad
            with pytest.raises(ValueError, match=f"CandidateMatrix.{name} must be a positive int, got {bad!r}"):
                CandidateMatrix(*dims)


def test_put_normalises_short_features_and_names_a_wrong_size():
    m = CandidateMatrix(2, F, L, D)
    m.put(("a", 0), unit(0.3, 0.4), torch.zeros(L, D))                 # norm 0.5
    torch.testing.assert_close(m.features[0], unit(0.6, 0.8))
    with pytest.raises(ValueError, match=rf"candidate \('a', 1\): feature has {F + 1} elements, matrix holds {F}"):
        m.put(("a", 1), torch.zeros(F + 1), torch.zeros(L, D))
    with pytest.raises(ValueError, match=rf"candidate \('a', 1\): history \({L + 1}, {D}\), matrix holds \({L}, {D}\)"):
        m.put(("a", 1), unit(1), torch.zeros(L + 1, D))


def test_stall_and_past_the_references_counts_add_up_over_episodes():
    h = torch.zeros(L, D)
    r = Retriever(RetrievalConfig(history_len=L, max_end_matches=1), TaskPacks({TASK: matrix({("a", 1): (unit(1), h)})}))
    for episode in range(2):
        r.start_episode(TASK, max_calls=40, episode_lengths={"a": 2})
        assert r.query(unit(1), h) is not None and r.query(unit(1), h) is None
    assert r.stats.past_end == 2
    for episode in range(2):
        r.start_episode(TASK, max_calls=1)
        assert r.query(unit(1), h) is not None and r.query(unit(1), h) is None
    assert r.stats.stalls == 2
