"""Which halves of the cache run: the profile's auto/on/off against the recorded half timing."""

from __future__ import annotations

import pytest

from vla_runtime.cache.halves import (DEFAULT_RHO_P, HalfTiming, PhaseTiming, choose_rho_p, median_interval,
                                      parse_setting, resolve_halves)


def timing(context_speedup: float, action_speedup: float, rho_p: float = 0.4) -> HalfTiming:
    """A recorded timing whose halves ran at the given speed-ups (dense 10 ms per phase)."""
    return HalfTiming(PhaseTiming(0.010, 0.010 / context_speedup, 6), PhaseTiming(0.010, 0.010 / action_speedup, 6),
                      device="cpu", threads=1, dtype="float32", rho_p=rho_p, rho_n=0.5, calls=2, repeats=3)


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("on", "on"), ("off", "off"), (" ON ", "on"),
                                         ("Auto", "auto"), (True, "on"), (False, "off")])
def test_settings_parse(value, want):
    assert parse_setting(value, "cache.context_cache") == want


@pytest.mark.parametrize("value", ["yes", "true", "", None, 1, 0, 1.0, ["on"]])
def test_anything_else_is_refused_with_the_key_named(value):
    with pytest.raises(ValueError, match=r"^cache.action_cache: must be auto, on or off"):
        parse_setting(value, "cache.action_cache")


def test_auto_runs_a_half_only_where_it_was_measured_faster():
    r = resolve_halves("auto", "auto", timing(context_speedup=0.8, action_speedup=1.3))
    assert (r.context_cache, r.action_cache, r.dense) == (False, True, False)
    assert "context cache off (auto: prefill measured 0.80x of dense, not faster)" in r.reason
    assert "action cache on (auto: denoise measured 1.30x faster)" in r.reason
    assert "measured on cpu, 1 thread(s), float32" in r.reason
    r = resolve_halves("auto", "auto", timing(context_speedup=1.5, action_speedup=0.9))
    assert (r.context_cache, r.action_cache) == (True, False)
    # exactly as fast as dense does not pay: the gathers cost memory for nothing
    assert resolve_halves("auto", "auto", timing(1.0, 1.0)).dense


def test_on_and_off_force_a_half_whatever_was_measured():
    slow = timing(context_speedup=0.5, action_speedup=0.5)
    r = resolve_halves("on", "on", slow)
    assert (r.context_cache, r.action_cache) == (True, True)
    assert r.reason == "context cache on (forced by the profile); action cache on (forced by the profile)"
    r = resolve_halves("off", "auto", timing(context_speedup=2.0, action_speedup=2.0))
    assert (r.context_cache, r.action_cache) == (False, True)


def test_both_off_says_the_cache_is_effectively_dense():
    r = resolve_halves("auto", "auto", timing(context_speedup=0.7, action_speedup=0.9))
    assert r.dense and r.reason.startswith("both halves off, the cache is effectively dense: ")
    assert resolve_halves("off", "auto", timing(2.0, 0.5)).dense


def test_auto_without_a_recorded_timing_runs_the_half_and_says_it_is_unmeasured():
    r = resolve_halves("auto", "off", None)
    assert (r.context_cache, r.action_cache) == (True, False)
    assert "context cache on (auto, unmeasured" in r.reason and "build-cache --profile" in r.reason


def test_another_rho_p_than_the_timed_one_is_named():
    r = resolve_halves("auto", "auto", timing(1.2, 1.2, rho_p=0.4), rho_p=0.6)
    assert "the profile runs rho_p 0.6, the Context Cache was timed at 0.4" in r.reason
    assert "the profile runs" not in resolve_halves("auto", "auto", timing(1.2, 1.2, rho_p=0.4), rho_p=0.4).reason


def test_timing_round_trips_and_a_bad_field_is_named():
    t = timing(0.8, 1.3)
    d = t.as_dict()
    assert d["context_cache"]["speedup"] == pytest.approx(0.8) and d["action_cache"]["speedup"] == pytest.approx(1.3)
    assert HalfTiming.from_dict(d) == t
    d["action_cache"]["cached_s"] = -1.0
    with pytest.raises(ValueError, match=r"half_timing.action_cache.cached_s: must be a positive number"):
        HalfTiming.from_dict(d)
    with pytest.raises(ValueError, match=r"half_timing.device: must be a non-empty string"):
        HalfTiming.from_dict({**t.as_dict(), "device": ""})
    with pytest.raises(ValueError, match=r"half_timing.context_cache: must be an object"):
        HalfTiming.from_dict({**t.as_dict(), "context_cache": 3})


def test_rho_p_given_wins_else_the_profiled_one_else_the_default():
    assert choose_rho_p(0.6, timing(1.2, 1.2, rho_p=0.2)) == (0.6, "given")
    assert choose_rho_p(1, None) == (1.0, "given")
    assert choose_rho_p(None, timing(1.2, 1.2, rho_p=0.2)) == (0.2, "the repository's profiling")
    # a half measured slower still leaves its ratio: auto then turns that half off, at that ratio
    assert choose_rho_p(None, timing(0.7, 0.7, rho_p=0.6))[0] == 0.6
    assert choose_rho_p(None, None) == (DEFAULT_RHO_P, "the default: the repository was built without --profile")
    assert DEFAULT_RHO_P == 0.4   # the default the profiles documented before (docs/configuration.md)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, True, "0.4", float("nan")])
def test_a_given_rho_p_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match=r"rho_p must be in \(0, 1\], got"):
        choose_rho_p(bad, timing(1.2, 1.2))


def test_the_median_s_interval_is_the_binomial_order_statistics():
    """Distribution-free 95 % interval of a median: the (k+1)-th smallest and largest of n values,
    k the largest count with P(Binomial(n, 1/2) <= k) <= 2.5 %. By hand: n = 10, P(B <= 1) =
    11/1024 = 1.07 % and P(B <= 2) = 56/1024 = 5.5 %, so k = 1; n = 6, P(B <= 0) = 1/64, k = 0;
    n = 5, 1/32 > 2.5 %: no bound; n = 100: ranks 40 and 61, the textbook pair."""
    assert median_interval(range(10)) == (4.5, 1.0, 8.0)
    assert median_interval([5, 0, 3, 1, 4, 2]) == (2.5, 0.0, 5.0)      # order of the input does not matter
    assert median_interval(range(5)) == (2.0, None, None)
    assert median_interval(range(100)) == (49.5, 39.0, 60.0)
    assert median_interval([1.0] * 3000) == (1.0, 1.0, 1.0)             # past 2**1023: exact integers, no overflow
    with pytest.raises(ValueError, match="no values"):
        median_interval([])


def test_paired_timing_divides_each_call_by_itself():
    """Call i ran dense then cached: its ratio is dense_i / cached_i. Calls whose speed varies
    24-fold (the machine's load) but each 1.25x faster cached give 1.25 exactly at both ends of the
    interval; any other pairing of the same samples would not."""
    dense = [0.001 * 2 ** (i % 6) * (1 + i / 100) for i in range(12)]
    t = PhaseTiming.paired(dense, [d / 1.25 for d in dense])
    assert t.samples == 12 and (t.ratio, t.ratio_low, t.ratio_high) == pytest.approx((1.25, 1.25, 1.25))
    assert t.speedup == t.ratio and t.shown_faster
    with pytest.raises(ValueError, match="as many dense as cached samples"):
        PhaseTiming.paired(dense, dense[:-1])


def test_auto_runs_a_half_only_where_its_interval_lies_above_one():
    """A half 1.01x by its paired figure but with an interval reaching 0.97 is not shown faster:
    auto leaves it off, and says so with the interval; 1.06x from 1.02 runs."""
    noisy = PhaseTiming(0.0103, 0.0100, 36, ratio=1.01, ratio_low=0.97, ratio_high=1.06)
    clear = PhaseTiming(0.0110, 0.0100, 36, ratio=1.06, ratio_low=1.02, ratio_high=1.09)
    t = HalfTiming(clear, noisy, device="cpu", threads=1, dtype="float32", rho_p=0.6, rho_n=0.75, calls=12, repeats=3)
    r = resolve_halves("auto", "auto", t)
    assert (r.context_cache, r.action_cache) == (True, False)
    assert "context cache on (auto: prefill measured 1.06x (95 % interval 1.02-1.09) faster)" in r.reason
    assert "action cache off (auto: denoise measured 1.01x (95 % interval 0.97-1.06) of dense, not shown faster)" in r.reason
    assert "denoise 10.30 -> 10.00 ms (1.01x (95 % interval 0.97-1.06))" in r.reason
    # forced halves ignore the interval
    assert resolve_halves("on", "on", t).action_cache


def test_a_timing_with_intervals_round_trips_and_a_disordered_one_is_refused():
    noisy = PhaseTiming(0.0103, 0.0100, 36, ratio=1.01, ratio_low=0.97, ratio_high=1.06)
    t = HalfTiming(noisy, PhaseTiming(0.01, 0.02, 4, ratio=0.5), "cpu", 1, "float32", 0.6, 0.75, 12, 3)
    assert HalfTiming.from_dict(t.as_dict()) == t
    d = t.as_dict()
    d["context_cache"]["ratio_low"] = 1.2
    with pytest.raises(ValueError, match=r"half_timing.context_cache: ratio_low <= ratio <= ratio_high must hold"):
        HalfTiming.from_dict(d)
    d = t.as_dict()
    d["context_cache"]["ratio_high"] = None
    with pytest.raises(ValueError, match=r"both bounds or neither"):
        HalfTiming.from_dict(d)


def test_the_saving_is_what_autos_running_halves_save_and_only_when_auto_chose_them_all():
    # dense 10 ms per phase: 2.0x saves 5 ms, 1.25x saves 2 ms
    r = resolve_halves("auto", "auto", timing(context_speedup=2.0, action_speedup=1.25))
    assert r.saving_s == pytest.approx(7e-3)
    only_context = resolve_halves("auto", "auto", timing(context_speedup=2.0, action_speedup=0.8))
    assert only_context.saving_s == pytest.approx(5e-3)
    # a half forced on, a timing missing, or nothing running: nothing to weigh
    assert resolve_halves("on", "auto", timing(2.0, 1.25)).saving_s is None
    assert resolve_halves("auto", "auto", None).saving_s is None
    assert resolve_halves("auto", "auto", timing(0.8, 0.9)).saving_s is None
    # a half forced off leaves the other's saving
    assert resolve_halves("off", "auto", timing(2.0, 1.25)).saving_s == pytest.approx(2e-3)
