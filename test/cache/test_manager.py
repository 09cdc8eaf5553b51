"""The cache manager's own bookkeeping, on a repository the test writes call by call.

Every reference call here has known contents (random images, prompt, masks; retrieval features
that are near-orthogonal random vectors, so a query equal to one call's features matches that
call and no other), and a fake clock makes every load take ``LOAD_S`` and every rebuild
``REBUILD_S``, so the window the manager keeps, the budget of rMuscle Eq. 5 it computes and what
it reports can each be written down by hand. ``test_manager_builder.py`` runs the same manager
end to end on a repository built from bags; this file pins down what that run cannot see.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vla_runtime.cache import manager as manager_mod
from vla_runtime.cache.entry import PreparedEntry, reconstruct_entry
from vla_runtime.cache.manager import (CacheManager, ManagerConfig, PrepareReport, model_images_to_stored,
                                       stored_images_to_model)
from vla_runtime.cache.repository import ReferenceCall, ReferenceRepository, RepositoryMeta
from vla_runtime.cache.retrieval import Match, RetrievalConfig
from vla_runtime.cache.selector import Selection
from vla_runtime.cache.window import WindowConfig
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_
from vla_runtime.nodes.profile import CacheSpec

HASH = "sha256:" + "b" * 64
MODEL = {"name": "pi05-tiny"}
# three cameras, the third absent: the tiny model's config says two, so the stored layout (3) and
# the model's camera count (2) and the visible cameras (2) tell apart which one a size is computed from
N_CAMS, IMAGE_MASK = 3, (True, True, False)
HIST, D, G, K = 3, 5, 2, 7
LENGTHS = {"pick": {"A": 6, "B": 9, "C": 2}, "place": {"P": 4}}
T, L = 2, 2                       # the window: 2 episodes x (current + 2 next) = capacity 6
LOAD_S, REBUILD_S = 0.125, 0.25   # binary fractions: every sum and mean below is exact


def window_cfg(**kw) -> ManagerConfig:
    return ManagerConfig(retrieval=RetrievalConfig(history_len=HIST, top_t=T), window=WindowConfig(T, L), **kw)


def make_call(cfg, g: torch.Generator) -> ReferenceCall:
    s = cfg.vision.image_size
    return ReferenceCall(
        images=torch.randint(0, 256, (N_CAMS, s, s, 3), generator=g, dtype=torch.uint8),
        image_mask=torch.tensor(IMAGE_MASK),
        tokens=torch.randint(0, cfg.vocab_size, (cfg.max_token_len,), generator=g),
        token_mask=torch.arange(cfg.max_token_len) < 9,
        state=torch.randn(D, generator=g),
        state_history=torch.randn(HIST, D, generator=g),
        retrieval=torch.randn(N_CAMS * cfg.num_image_tokens, cfg.vision.width, generator=g).half(),
        masks=torch.randint(0, cfg.expert.mlp_dim, (G, cfg.expert.depth, K), generator=g, dtype=torch.int32),
    )


@pytest.fixture(scope="module")
def model() -> Pi05Model:
    torch.set_num_threads(1)
    m = init_random_(Pi05Model(preset("pi05-tiny")), seed=5)
    m.setup_caches(1)
    return m


@pytest.fixture(scope="module")
def calls(model) -> dict[str, list[ReferenceCall]]:
    g = torch.Generator().manual_seed(11)
    return {e: [make_call(model.cfg, g) for _ in range(n)] for eps in LENGTHS.values() for e, n in eps.items()}


@pytest.fixture(scope="module")
def repo(calls, tmp_path_factory) -> ReferenceRepository:
    root = tmp_path_factory.mktemp("mgr") / "repo"
    r = ReferenceRepository.create(root, RepositoryMeta(checkpoint_hash=HASH, model=MODEL, retrieval_layer=2,
                                                        rho_n=0.5, mask_groups=[[0, 5], [5, 10]],
                                                        history_len=HIST))
    for task, eps in LENGTHS.items():
        for e in eps:
            r.add_episode(e, task, calls[e])
    return ReferenceRepository.open(root, expect_checkpoint_hash=HASH)


@pytest.fixture
def clock(monkeypatch):
    """A fake ``time`` for the manager: it advances only while a call is loaded (LOAD_S) or
    rebuilt (REBUILD_S), so the measured means of Eq. 5 are known exactly."""
    now = [0.0]
    monkeypatch.setattr(manager_mod, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    real_load, real_rebuild = ReferenceRepository.load_call, manager_mod.reconstruct_entry

    def load_call(self, episode_id, index):
        now[0] += LOAD_S
        return real_load(self, episode_id, index)

    def rebuild(*args, **kw):
        now[0] += REBUILD_S
        return real_rebuild(*args, **kw)

    monkeypatch.setattr(ReferenceRepository, "load_call", load_call)
    monkeypatch.setattr(manager_mod, "reconstruct_entry", rebuild)
    return now


def entry_bytes(cfg) -> int:
    """A prepared entry's bytes from its definition: FFN inputs and outputs of the visible
    cameras' tokens in every VLM layer but the last (float32 model), the camera mask (bool) and the
    Action Cache masks (int64)."""
    visible = sum(IMAGE_MASK)
    ffn = 2 * (cfg.vlm.depth - 1) * visible * cfg.num_image_tokens * cfg.vlm.width * 4
    return ffn + N_CAMS * 1 + G * cfg.expert.depth * K * 8


def window(spans: dict[str, int], lengths: dict[str, int]) -> set[tuple[str, int]]:
    """The entries a window over ``spans`` (episode -> current call) holds: the current call and
    the next L, clipped to the episode."""
    return {(e, i) for e, i0 in spans.items() for i in range(i0, min(i0 + L, lengths[e] - 1) + 1)}


# the initial window of "pick": call 0 of every episode, calls 1..L of the first T (index order)
PICK_INITIAL = {("A", 0), ("B", 0), ("C", 0), ("A", 1), ("A", 2), ("B", 1), ("B", 2)}


NOTHING = PrepareReport(added=0, dropped=0, deferred=0, budget=0, seconds=0.0)   # written out: not the defaults


def logged(caplog) -> list[str]:
    """The manager's log messages, formatted (exact text, not a substring of the whole log)."""
    return [r.getMessage() for r in caplog.records if r.name == manager_mod.__name__]


def note(task: str, match: Match | None, candidates=(), **kw) -> Selection:
    return Selection(7, task, 1, match, tuple(candidates), **kw)


def at(episode: str, index: int) -> Match:
    return Match(episode, index, 1.0, 0.0)


# ----------------------------------------------------------------------------- image conversion


def test_image_conversion_follows_the_uint8_formula():
    """stored = round((x + 1) * 127.5) clipped to [0, 255], channels last; and back x = v / 127.5 - 1."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (2, 3, 4, 5), generator=g)
    x = codes.double() / 127.5 - 1            # on the uint8 grid: no rounding ties
    x[0, 0, 0, :3] = torch.tensor([-1.0, 1.0, -1.6])   # the two ends, and below -1
    x[1, 2, 3, 4] = 1.7                                  # above 1 (255 + 0.7 * 127.5 would wrap in uint8)
    x[1, 1, 0, 0] = 1 + 1.2 / 127.5                      # rounds to 256 before the clip
    want = np.clip(np.rint((x.numpy() + 1) * 127.5), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
    stored = model_images_to_stored(x.float())
    assert stored.dtype == torch.uint8 and stored.is_contiguous()
    np.testing.assert_array_equal(stored.numpy(), want)
    assert want[0, 0, 0, 0] == 0 and want[0, 0, 1, 0] == 255 and want[1, 3, 4, 2] == 255 and want[1, 0, 0, 1] == 255
    back = stored_images_to_model(torch.from_numpy(want))
    assert back.dtype == torch.float32 and back.shape == x.shape
    # float32 v / 127.5 - 1 differs from the float64 value by at most one float32 rounding of each step
    np.testing.assert_allclose(back.numpy(), want.transpose(0, 3, 1, 2) / 127.5 - 1, rtol=0, atol=2 ** -23 * 3)


# ----------------------------------------------------------------------------- construction


def test_construction_sizes_the_candidates_from_the_repository(model, repo):
    store: dict = {}
    m = CacheManager(model, repo, window_cfg(), entries=store)
    cfg = model.cfg
    # the window's capacity plus every episode of the largest task (call 0 of each is prepared at start)
    assert m.matrix.capacity == T * (L + 1) + 3
    assert m.matrix.feature_dim == N_CAMS * cfg.num_image_tokens * cfg.vision.width
    assert (m.matrix.history_len, m.matrix.state_dim) == (HIST, D)
    assert m.selector.lengths == LENGTHS and m.selector.state_dim == D
    assert m.entries is store and m.task is None and m.last_selection is None and m.stalls == 0
    assert m.candidates("pick") is None                     # no episode yet
    assert m.select(torch.zeros(m.matrix.feature_dim)) is None and m.last_selection is None


def test_construction_refuses_an_empty_repository_or_too_short_histories(model, repo, tmp_path):
    empty = ReferenceRepository.create(tmp_path / "empty", RepositoryMeta(
        checkpoint_hash=HASH, model=MODEL, retrieval_layer=2, rho_n=0.5, mask_groups=[[0, 10]], history_len=HIST))
    with pytest.raises(ValueError, match=f"repository {tmp_path / 'empty'} holds no episodes yet"):
        CacheManager(model, empty, window_cfg())
    long = ManagerConfig(retrieval=RetrievalConfig(history_len=HIST + 1))
    with pytest.raises(ValueError, match=f"repository histories cover {HIST} calls, retrieval needs {HIST + 1}"):
        CacheManager(model, repo, long)
    CacheManager(model, repo, ManagerConfig(retrieval=RetrievalConfig(history_len=HIST)))   # equal: enough


def test_a_repository_with_a_layout_but_no_episode_gives_a_manager_that_runs_dense(model, repo, calls, tmp_path):
    """An index can list a call layout and no episode (the repository itself resets the layout
    when its last episode goes; a hand-edited index keeps it, and ``open`` accepts it): the
    manager must come up, with room for the window only, and run every episode dense."""
    root = tmp_path / "layout-only"
    r = ReferenceRepository.create(root, RepositoryMeta(checkpoint_hash=HASH, model=MODEL, retrieval_layer=2,
                                                        rho_n=0.5, mask_groups=[[0, 5], [5, 10]],
                                                        history_len=HIST))
    r.add_episode("A", "pick", calls["A"][:2])
    index = json.loads((root / "index.json").read_text())
    index["episodes"], index["tasks"] = {}, {}
    (root / "index.json").write_text(json.dumps(index))
    m = CacheManager.open(model, root, HASH, window_cfg())
    assert m is not None and m.repo.tasks() == [] and m.matrix.capacity == T * (L + 1)
    assert m.start_episode("pick") == NOTHING and m.candidates("pick") is None


def test_open_keeps_config_and_store_and_refuses_without_raising(model, repo, tmp_path, caplog):
    cfg, store = window_cfg(memory_budget_bytes=123), {}
    m = CacheManager.open(model, repo.root, HASH, cfg, expect_model=MODEL, entries=store)
    assert m is not None and m.model is model and m.cfg is cfg and m.entries is store and m.repo.root == repo.root
    refusals = {   # what the logged reason names
        "checkpoint": dict(root=repo.root, checkpoint_hash="sha256:" + "c" * 64),
        "pi05-small": dict(root=repo.root, checkpoint_hash=HASH, expect_model={"name": "pi05-small"}),
        f"retrieval needs {HIST + 1}": dict(root=repo.root, checkpoint_hash=HASH,   # the manager's ValueError
                                            cfg=ManagerConfig(retrieval=RetrievalConfig(history_len=HIST + 1))),
        "nowhere": dict(root=tmp_path / "nowhere", checkpoint_hash=HASH),
    }
    prefix = "muscle-memory cache disabled, running dense: "
    for why, kw in refusals.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=manager_mod.__name__):
            assert CacheManager.open(model, **kw) is None, why
        [msg] = logged(caplog)
        assert msg.startswith(prefix) and why in msg[len(prefix):], msg


def test_default_memory_budget_is_the_profiles():
    """In-process default = the robot profile's documented ``cache.memory_budget_mb`` (4096)."""
    assert ManagerConfig().memory_budget_bytes == CacheSpec().memory_budget_mb << 20 == 4 * 2 ** 30
    assert ManagerConfig().default_time_available_s == 1.0


# ----------------------------------------------------------------------------- episodes


def test_start_episode_prepares_the_initial_window_from_the_stored_calls(model, repo, calls, clock):
    m = CacheManager(model, repo, window_cfg())
    report = m.start_episode("pick")
    n = len(PICK_INITIAL)
    assert report == PrepareReport(added=n, dropped=0, deferred=0, budget=n, seconds=n * (LOAD_S + REBUILD_S))
    assert set(m.entries) == PICK_INITIAL == set(m.matrix.keys) == m.window.prepared
    assert all(e.key == k for k, e in m.entries.items())
    assert m.candidates("pick") is m.matrix and m.candidates("place") is None
    assert m.window.lengths == LENGTHS["pick"]
    e = m.entries[("B", 2)]
    call = calls["B"][2]
    assert torch.equal(e.retrieval, call.retrieval) and torch.equal(e.state_history, call.state_history)
    assert e.masks.dtype == torch.int64 and torch.equal(e.masks, call.masks.long())
    assert torch.equal(e.image_mask, call.image_mask) and e.nbytes() == entry_bytes(model.cfg)
    # the states of a dense prefill of the stored call (images back in [-1, 1], channels first, in
    # float32 like the model: the same rounding, so the same states bit for bit)
    images = call.images.permute(0, 3, 1, 2).float() / 127.5 - 1
    ref = reconstruct_entry(model, e.key, images, call.image_mask, call.tokens, call.token_mask, None)
    assert torch.equal(e.ffn_in, ref.ffn_in) and torch.equal(e.ffn_out, ref.ffn_out)
    # the candidate row holds the call's features (unit-normalised) and its joint history
    row = m.matrix.keys.index(("B", 2))
    f = call.retrieval.float().reshape(-1)
    torch.testing.assert_close(m.matrix.features[row], f / f.norm(), rtol=0, atol=1e-6)  # float32 norm rounding
    assert torch.equal(m.matrix.histories[row], call.state_history)
    # another task's episode starts afresh: only its entries
    m.follow(note("pick", at("A", 1)))
    report = m.start_episode("place")
    assert set(m.entries) == {("P", 0), ("P", 1), ("P", 2)} == set(m.matrix.keys) == m.window.prepared
    assert report.added == 3 and m.last_selection is None and m.task == "place"


def test_start_episode_of_an_unknown_task_runs_dense(model, repo, caplog):
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    with caplog.at_level(logging.WARNING, logger=manager_mod.__name__):
        assert m.start_episode("fold") == NOTHING
    assert logged(caplog) == ["no reference episodes for task 'fold': running dense"]
    assert m.task == "fold" and not m.entries and len(m.matrix) == 0 and not m.window.prepared
    assert m.candidates("fold") is None
    m.observe_state(torch.zeros(D))
    assert m.select(torch.zeros(m.matrix.feature_dim)) is None


# ----------------------------------------------------------------------------- selection


def test_select_serves_the_matched_entry_and_notes_the_selection(model, repo, calls, caplog):
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    m.observe_state(calls["A"][2].state_history[-1])
    got = m.select(calls["A"][2].retrieval)        # its own features: cosine 1 to A2, about 0 to the rest
    assert got is m.entries[("A", 2)]
    sel = m.last_selection
    assert (sel.request_seq, sel.task, sel.episode) == (-1, "pick", 0)
    assert m.last_match is sel.match and sel.match.key == ("A", 2) and sel.candidates[0] == "A"
    assert m.retriever is m.selector.retriever
    noise = torch.randn(calls["A"][2].retrieval.shape, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.DEBUG, logger=manager_mod.__name__):
        assert m.select(noise) is None
    assert logged(caplog) == [f"dense call: {m.retriever.reason}"] and m.retriever.reason.startswith("fallback")
    assert m.last_match is None and m.last_selection.dense_for_episode


# ----------------------------------------------------------------------------- the sliding window


@pytest.mark.parametrize("match, candidates, spans", [
    # A has 6 calls: call 3 is 3/5 = 60 % through; B (9 calls) at round(0.6 * 8) = 5
    (at("A", 3), ("A", "B"), {"A": 3, "B": 5}),
    # C's last call (1 of 2 calls) is 100 %: B at its last call 8 (one position left, none after)
    (at("C", 1), ("C", "B"), {"C": 1, "B": 8}),
    # the match's episode outside the followed ones: it stays, with the first of them (T = 2);
    # 2/5 = 40 % -> B at round(3.2) = 3
    (at("A", 2), ("B", "C"), {"A": 2, "B": 3}),
    # nothing followed, or only episodes of another task: the match's episode alone
    (at("B", 4), (), {"B": 4}),
    (at("B", 4), ("P",), {"B": 4}),
])
def test_prepare_moves_the_window_to_the_same_progress_in_the_followed_episodes(model, repo, match, candidates,
                                                                                 spans):
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    m.follow(note("pick", match, candidates))
    report = m.prepare(time_available_s=100.0)
    want = window(spans, LENGTHS["pick"])
    assert set(m.entries) == want == set(m.matrix.keys) == m.window.prepared
    assert (report.added, report.dropped, report.deferred) == (len(want - PICK_INITIAL),
                                                               len(PICK_INITIAL - want), 0)


@pytest.mark.parametrize("sel", [
    None,
    note("pick", None, ("A", "B"), reason="fallback"),
    note("pick", at("A", 3), ("A", "B"), dense_for_episode=True),
    note("place", at("A", 3), ("A", "B")),
])
def test_prepare_does_nothing_without_a_usable_match(model, repo, sel):
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    if sel is not None:
        m.follow(sel)
    assert m.prepare(time_available_s=100.0) == NOTHING
    assert set(m.entries) == PICK_INITIAL == m.window.prepared


def test_prepare_budget_is_eq5_with_the_measured_times(model, repo, clock):
    """Eq. 5 with every term known: 6 entries missing, each load 0.125 s, each rebuild 0.25 s."""
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    m.follow(note("pick", at("A", 3), ("A", "B")))
    # wanted A3..A5, B5..B7, none prepared; transfer 6 x 0.125 = 0.75 s
    # default T_avl 1.0 s: floor((1.0 - 0.75) / 0.25) = 1
    assert m.prepare() == PrepareReport(1, 7, 5, 1, LOAD_S + REBUILD_S)
    assert set(m.entries) == {("A", 3)}                     # nearest first
    # 5 missing now: floor((2.0 - 0.625) / 0.25) = 5.5 -> 5, all of them
    assert m.prepare(time_available_s=2.0) == PrepareReport(5, 0, 0, 5, 5 * (LOAD_S + REBUILD_S))
    assert set(m.entries) == window({"A": 3, "B": 5}, LENGTHS["pick"])


def test_prepare_budget_from_the_caller_time_and_the_default(model, repo, clock):
    m = CacheManager(model, repo, window_cfg(default_time_available_s=1.5))
    m.start_episode("pick")
    m.follow(note("pick", at("A", 3), ("A", "B")))
    # floor((1.5 - 0.75) / 0.25) = 3: A3, B5, A4 (nearest first, episodes in turn)
    assert m.prepare() == PrepareReport(3, 7, 3, 3, 3 * (LOAD_S + REBUILD_S))
    assert set(m.entries) == {("A", 3), ("B", 5), ("A", 4)}
    # the caller's time wins over the default: 3 missing, floor((0.7 - 0.375) / 0.25) = 1
    assert m.prepare(time_available_s=0.7).budget == 1


def test_prepare_budget_by_free_memory(model, repo, clock):
    """Memory term of Eq. 5: (budget - used, at least 0, + the entries being dropped) / entry bytes."""
    eb = entry_bytes(model.cfg)
    m = CacheManager(model, repo, window_cfg(default_time_available_s=1.5, memory_budget_bytes=5 * eb + eb // 2))
    m.start_episode("pick")                           # 7 entries: over the budget, and that is allowed
    m.follow(note("pick", at("A", 3), ("A", "B")))
    # free max(0, 5.5 - 7) + 7 dropped = 7 entries: time (3) bounds
    assert m.prepare().budget == 3                    # A3, B5, A4 prepared
    # nothing dropped now, 3 missing; free 5.5 - 3 = 2.5 entries -> 2
    assert m.prepare(time_available_s=100.0) == PrepareReport(2, 0, 1, 2, 2 * (LOAD_S + REBUILD_S))
    assert set(m.entries) == {("A", 3), ("B", 5), ("A", 4), ("B", 6), ("A", 5)}
    # A at 4 (80 %) -> B at round(6.4) = 6: wanted A4, A5, B6, B7, B8; A3 and B5 dropped, B7, B8 missing
    m.follow(note("pick", at("A", 4), ("A", "B")))
    assert m.prepare(time_available_s=100.0) == PrepareReport(2, 2, 0, 2, 2 * (LOAD_S + REBUILD_S))


def test_prepare_counts_the_memory_left_in_the_budget_and_what_it_drops(model, repo, clock):
    """Missing entries beyond those dropped: the budget's unused memory (the default 4 GiB) decides."""
    m = CacheManager(model, repo, window_cfg(default_time_available_s=1.5))
    m.start_episode("pick")
    m.follow(note("pick", at("A", 3), ("A", "B")))
    assert m.prepare().added == 3                     # A3, B5, A4
    m.follow(note("pick", at("A", 4), ("A", "B")))
    # wanted A4, B6, A5, B7, B8: 4 missing, 2 dropped (A3, B5); memory for all, time for all
    assert m.prepare(time_available_s=100.0) == PrepareReport(4, 2, 0, 4, 4 * (LOAD_S + REBUILD_S))
    assert set(m.entries) == window({"A": 4, "B": 6}, LENGTHS["pick"])


def test_prepare_when_every_dropped_entry_is_needed_back(model, repo, clock):
    """Budget below what is prepared: only the dropped entries' memory is free."""
    eb = entry_bytes(model.cfg)
    m = CacheManager(model, repo, window_cfg(memory_budget_bytes=eb // 2))
    m.start_episode("pick")
    m.follow(note("pick", at("A", 3), ("A", "B")))
    # free max(0, 0.5 - 7) = 0 entries + 7 dropped = 7: all 6 missing entries fit
    assert m.prepare(time_available_s=100.0).budget == 6


def test_a_stall_restarts_the_initial_window(model, repo, caplog):
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    m.follow(note("pick", at("A", 3), ("A", "B")))
    m.prepare(time_available_s=100.0)
    assert set(m.entries) != PICK_INITIAL
    stall = note("pick", None, ("A", "B"), reason="stall: reference ('A', 3)", restart=True, dense_for_episode=False)
    with caplog.at_level(logging.WARNING, logger=manager_mod.__name__):
        m.follow(stall)
    assert logged(caplog) == ["stall detected for task 'pick': stall: reference ('A', 3); the episode's window restarts"]
    assert m.stalls == 1 and m.task == "pick" and m.last_selection is stall
    assert set(m.entries) == PICK_INITIAL == set(m.matrix.keys) == m.window.prepared
    m.follow(stall)
    assert m.stalls == 2 and set(m.entries) == PICK_INITIAL
    m.follow(note("pick", at("A", 1), ("A", "B")))  # no restart: nothing changes but the note
    assert m.stalls == 2 and set(m.entries) == PICK_INITIAL


def test_a_restart_before_any_episode_is_ignored(model, repo, caplog):
    m = CacheManager(model, repo, window_cfg())
    with caplog.at_level(logging.WARNING, logger=manager_mod.__name__):
        m.follow(note("pick", None, restart=True))
    assert m.stalls == 0 and not m.entries and caplog.text == ""


def test_a_real_stall_through_select(model, repo, calls):
    """The same observation every call: the selector reports a stall after as many repeats as the
    task's longest episode has calls (9); the manager restarts the window and serves again."""
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    call = calls["A"][0]
    got = []
    for _ in range(LENGTHS["pick"]["B"] + 1):
        m.observe_state(call.state_history[-1])
        got.append(m.select(call.retrieval))
    assert all(g is not None for g in got[:-1]) and got[-1] is None
    assert m.stalls == 1 and set(m.entries) == PICK_INITIAL and m.last_selection.restart


# ----------------------------------------------------------------------------- memory


def test_memory_report(model, repo, calls):
    cfg = model.cfg
    stored = sum(t.numel() * t.element_size() for t in vars(calls["A"][0]).values())
    m = CacheManager(model, repo, window_cfg())
    # no entry yet: the estimate over every stored camera (3, not the model's 2), float32 states
    est = 2 * (cfg.vlm.depth - 1) * N_CAMS * cfg.num_image_tokens * cfg.vlm.width * 4
    assert m.memory_report() == {"bytes_per_stored_call": stored, "bytes_per_prepared_entry": est,
                                 "prepared_entries": 0, "working_set_bytes": 0, "window_capacity_entries": T * (L + 1),
                                 "kept_rebuilt_entries": 0, "kept_rebuilt_bytes": 0}
    m.start_episode("pick")
    n = len(PICK_INITIAL)
    assert m.memory_report() == {"bytes_per_stored_call": stored, "bytes_per_prepared_entry": entry_bytes(cfg),
                                 "prepared_entries": n, "working_set_bytes": n * entry_bytes(cfg),
                                 "window_capacity_entries": T * (L + 1),
                                 "kept_rebuilt_entries": n, "kept_rebuilt_bytes": n * entry_bytes(cfg)}


# ----------------------------------------------------------------------------- rebuilt entries kept


def test_default_reuse_budget_is_the_profiles_and_budgets_are_checked():
    """In-process default = the profile's documented ``cache.reuse_budget_mb`` (1024)."""
    assert ManagerConfig().reuse_budget_bytes == CacheSpec().reuse_budget_mb << 20 == 2 ** 30
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"reuse_budget_bytes must be a non-negative int, got {bad!r}"):
            ManagerConfig(reuse_budget_bytes=bad)
        with pytest.raises(ValueError, match=f"memory_budget_bytes must be a non-negative int, got {bad!r}"):
            ManagerConfig(memory_budget_bytes=bad)


def test_the_next_episode_of_a_task_takes_back_its_rebuilt_entries(model, repo, calls, clock):
    """The initial window of an episode is the same calls each time: once rebuilt they are taken
    back (the fake clock does not move: no load, no rebuild), as the same objects, which still hold
    what a dense prefill of their stored call gives, and they become candidates again."""
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    first = dict(m.entries)
    assert m.start_episode("place").reused == 0
    t = clock[0]
    n = len(PICK_INITIAL)
    assert m.start_episode("pick") == PrepareReport(added=n, dropped=0, deferred=0, budget=n, seconds=0.0, reused=n)
    assert clock[0] == t and m.reused == n
    eb = entry_bytes(model.cfg)
    kept = m.memory_report()
    assert (kept["kept_rebuilt_entries"], kept["kept_rebuilt_bytes"]) == (n + 3, (n + 3) * eb)   # taken back, kept again
    assert set(m.entries) == PICK_INITIAL == set(m.matrix.keys)
    assert all(m.entries[k] is first[k] for k in PICK_INITIAL)
    call = calls["A"][2]
    ref = reconstruct_entry(model, ("A", 2), stored_images_to_model(call.images), call.image_mask, call.tokens,
                            call.token_mask, None)
    assert torch.equal(m.entries[("A", 2)].ffn_in, ref.ffn_in) and torch.equal(m.entries[("A", 2)].ffn_out, ref.ffn_out)
    row = m.matrix.keys.index(("A", 2))
    assert torch.equal(m.matrix.histories[row], call.state_history)
    f = call.retrieval.float().reshape(-1)
    torch.testing.assert_close(m.matrix.features[row], f / f.norm(), rtol=0, atol=1e-6)   # float32 norm rounding
    assert m.start_episode("place").reused == 3 and m.reused == n + 3      # the count adds up


def test_kept_entries_cost_no_time_in_the_budget(model, repo, clock):
    """Eq. 5's time term counts only the missing entries that must be rebuilt: the kept ones are
    added on top (memory permitting). Same sliding as the Eq. 5 test, once to rebuild, then again."""
    m = CacheManager(model, repo, window_cfg())
    m.start_episode("pick")
    m.follow(note("pick", at("A", 3), ("A", "B")))
    assert m.prepare(time_available_s=100.0).added == 6          # A3..A5, B5..B7 rebuilt once
    m.start_episode("pick")                                     # the initial window again, all kept
    m.follow(note("pick", at("A", 3), ("A", "B")))
    # 6 missing, all kept: no transfer, no rebuild; the default 1.0 s alone would allow 1 (Eq. 5 test)
    assert m.prepare() == PrepareReport(6, 7, 0, 6, 0.0, 6)
    assert set(m.entries) == window({"A": 3, "B": 5}, LENGTHS["pick"])


def test_a_window_of_kept_and_new_entries_within_time_and_memory(model, repo, clock):
    """Some missing entries kept, some not: Eq. 5's time term covers the rebuilds only, then the
    kept ones are added, all within free memory (a budget of 5.5 entries). Still an estimate: the
    window adds nearest first, so more rebuilds than the time term allowed can run."""
    eb = entry_bytes(model.cfg)
    m = CacheManager(model, repo, window_cfg(reuse_budget_bytes=10 * eb, memory_budget_bytes=5 * eb + eb // 2))
    m.start_episode("pick")                                     # A0 B0 C0 A1 B1 A2 B2 rebuilt
    m.follow(note("pick", at("A", 3), ("A", "B")))
    assert m.prepare(time_available_s=100.0).added == 6         # A3 B5 A4 B6 A5 B7: 13 rebuilt, 10 kept
    m.start_episode("pick")      # its 7 rebuilt again, each pushing out the oldest kept: B6 A5 B7 are left
    m.follow(note("pick", at("A", 3), ("A", "B")))
    t = clock[0]
    # 6 missing, 3 kept; 3 to rebuild: transfer 3 x 0.125 s, floor((1.0 - 0.375) / 0.25) = 2; + 3 kept = 5
    # (memory: all 7 prepared are dropped, 7 entries free); nearest first: A3 B5 A4 rebuilt, B6 A5 kept
    assert m.prepare() == PrepareReport(5, 7, 1, 5, 3 * (LOAD_S + REBUILD_S), 2)
    assert clock[0] == t + 3 * (LOAD_S + REBUILD_S)
    # B7 missing (kept), 5 prepared, none dropped: 0.5 entries of memory free, so none is added
    assert m.prepare() == PrepareReport(0, 0, 1, 0, 0.0, 0)


def test_a_kept_entry_needs_free_memory_like_a_rebuilt_one(model, repo, clock):
    """The memory term bounds kept and rebuilt entries together (a budget of 2.5 entries)."""
    eb = entry_bytes(model.cfg)
    m = CacheManager(model, repo, window_cfg(memory_budget_bytes=2 * eb + eb // 2))
    m.start_episode("place")                                     # P0 P1 P2
    m.follow(note("place", at("P", 1), ("P",)))
    assert m.prepare().added == 1                                # P3 rebuilt (and kept), P0 dropped
    m.start_episode("place")                                     # P0 P1 P2 taken back
    m.follow(note("place", at("P", 1), ("P",)))
    # P3 missing and kept; 3 prepared, P0 dropped: max(0, 2.5 - 3) + 1 = 1 entry of memory
    assert m.prepare() == PrepareReport(1, 1, 0, 1, 0.0, 1)
    assert set(m.entries) == {("P", 1), ("P", 2), ("P", 3)}
    # the window widens from one episode to two: B0..B2 are missing and kept, nothing is dropped;
    # with 3.5 entries of budget and A0..A2 prepared half an entry is free: none is taken back
    m = CacheManager(model, repo, window_cfg(memory_budget_bytes=3 * eb + eb // 2))
    m.start_episode("pick")
    m.follow(note("pick", at("A", 0), ("A",)))
    assert m.prepare() == PrepareReport(0, 4, 0, 0, 0.0, 0)       # B0 C0 B1 B2 dropped (kept)
    m.follow(note("pick", at("A", 0), ("A", "B")))
    assert m.prepare() == PrepareReport(0, 0, 3, 0, 0.0, 0)
    assert m.prepare(time_available_s=100.0).deferred == 3        # time was never the bound


def test_kept_entries_stay_within_their_budget_least_recently_used_out(model, repo, clock):
    eb = entry_bytes(model.cfg)
    m = CacheManager(model, repo, window_cfg(reuse_budget_bytes=2 * eb + eb // 2))
    m.start_episode("place")                    # P0, P1, P2 rebuilt in that order: P0 out
    assert m.memory_report()["kept_rebuilt_entries"] == 2 and m.memory_report()["kept_rebuilt_bytes"] == 2 * eb
    # P1 and P2 taken out of the pool first (rebuilding P0 must not push them out), P0 rebuilt and
    # kept, then P1 and P2 kept again, which pushes P0, now the least recently used, out
    assert m.start_episode("place").reused == 2
    assert list(m._rebuilt) == [("P", 1), ("P", 2)] and m.memory_report()["kept_rebuilt_bytes"] == 2 * eb
    assert m.start_episode("place").reused == 2 and m.reused == 4
    m.follow(note("place", at("P", 0), ("P",)))
    assert m.prepare().reused == 0              # nothing missing
    one = CacheManager(model, repo, window_cfg(reuse_budget_bytes=eb))   # exactly one entry fits
    one.start_episode("place")
    assert one.memory_report()["kept_rebuilt_entries"] == 1
    none = CacheManager(model, repo, window_cfg(reuse_budget_bytes=eb - 1))   # an entry larger: none kept
    none.start_episode("place")
    assert none.memory_report()["kept_rebuilt_entries"] == 0 and none.start_episode("place").reused == 0


def test_measured_times_are_the_last_256(model, repo, monkeypatch):
    """The budget's means run over the last 256 loads and the last 256 rebuilds: the very first
    load and rebuild, slow, stop counting once 256 more have been measured."""
    now = [0.0]
    monkeypatch.setattr(manager_mod, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    real_load = ReferenceRepository.load_call
    count = {"load": 0, "rebuild": 0}

    def slow_first(what: str, usual: float) -> None:
        now[0] += 1000.0 if count[what] == 0 else usual
        count[what] += 1

    def load_call(self, episode_id, index):
        slow_first("load", 0.0)
        return real_load(self, episode_id, index)

    def rebuild(model, key, images, image_mask, tokens, token_mask, masks):
        slow_first("rebuild", REBUILD_S)   # an entry of the right kind, not rebuilt: only the clock matters
        return PreparedEntry(key, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), image_mask.clone(), None)

    monkeypatch.setattr(ReferenceRepository, "load_call", load_call)
    monkeypatch.setattr(manager_mod, "reconstruct_entry", rebuild)
    m = CacheManager(model, repo, window_cfg(reuse_budget_bytes=0))   # every start rebuilds
    for _ in range(4):                              # 4 x 3 = 12 entries, the slow first ones among them
        m.start_episode("place")
    for _ in range(35):                             # + 35 x 7 = 257: the slow ones are 257 entries back
        m.start_episode("pick")
    assert count == {"load": 257, "rebuild": 257}
    m.follow(note("pick", at("A", 3), ("A", "B")))
    # the last 256 loads took 0 s, rebuilds 0.25 s; 6 missing, no transfer time: floor(1.0 / 0.25) = 4
    # (with the slow ones counted the budget would be 0)
    assert m.prepare().budget == 4


def test_a_bfloat16_model_rebuilds_bfloat16_entries(repo, calls):
    """A bfloat16 runtime rebuilds bfloat16 states from the stored uint8 images (half the bytes of
    float32, which the estimate before any entry counts too). The images reach the vision tower in
    the weights' dtype whether the manager casts them or the model does (``embed_images``)."""
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=5).to(torch.bfloat16)
    model.setup_caches(1)
    cfg = model.cfg
    m = CacheManager(model, repo, window_cfg())
    est = 2 * (cfg.vlm.depth - 1) * N_CAMS * cfg.num_image_tokens * cfg.vlm.width * 2
    assert m.memory_report()["bytes_per_prepared_entry"] == est
    m.start_episode("place")
    e, call = m.entries[("P", 1)], calls["P"][1]
    images = (call.images.permute(0, 3, 1, 2).float() / 127.5 - 1).to(torch.bfloat16)
    ref = reconstruct_entry(model, e.key, images, call.image_mask, call.tokens, call.token_mask, None)
    assert e.ffn_in.dtype == torch.bfloat16 and torch.equal(e.ffn_in, ref.ffn_in) and torch.equal(e.ffn_out, ref.ffn_out)


def test_before_rebuild_runs_before_each_rebuilt_entry_only(model, repo, clock):
    """The hook (the gate that waits for the gap between calls) runs before each entry's load
    and dense prefill, never for an entry taken back from the kept ones (nothing to compute), and
    not for the initial window (the first search waits for that one)."""
    m = CacheManager(model, repo, window_cfg())
    calls_at: list[float] = []
    m.start_episode("pick")
    m.follow(note("pick", at("A", 3), ("A", "B")))
    t0 = clock[0]
    report = m.prepare(time_available_s=100.0, before_rebuild=lambda: calls_at.append(clock[0] - t0))
    assert report.added == 6 and report.reused == 0
    # once per rebuild, each before its load: the clock has moved by whole rebuilds only
    assert calls_at == [i * (LOAD_S + REBUILD_S) for i in range(6)]
    m.start_episode("pick")                                     # the initial window again, all kept
    m.follow(note("pick", at("A", 3), ("A", "B")))
    calls_at.clear()
    assert m.prepare(before_rebuild=lambda: calls_at.append(clock[0])).reused == 6
    assert calls_at == []
