"""The performance model on made-up rates, the automatic choice, and the calibration cache."""

import json
import math
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates, Placement
from deep_optimizer_states.core.slots import FILL_BYTES_PER_ELEMENT
from deep_optimizer_states.core.schedule import placements, spread
from deep_optimizer_states.planning import calibrate
from deep_optimizer_states.planning import plan as plan_module
from deep_optimizer_states.planning.perfmodel import (
    Rates,
    Window,
    best_stride,
    choose,
    lower_bound,
    predict,
    stride_formula,
    stride_places,
)
from deep_optimizer_states.planning.plan import Planner
from deep_optimizer_states.planning.refine import solve
from tests.harness import mlp, needs_compiler

H200_LIKE = Rates(cpu_adam=4.2e9, cpu_engine=3.8e9, cpu_contended=2.8e9, gpu_adam=120e9, h2d=55e9, d2h=55e9,
                  bidir=50e9, link=47e9, link_contended=30e9, gpu_upcast=340e9, cpu_downcast=25e9,
                  per_subgroup_s=60e-6)
NO_CONTENTION = Rates(cpu_adam=4e9, cpu_engine=4e9, cpu_contended=4e9, gpu_adam=100e9, h2d=50e9, d2h=50e9,
                      bidir=50e9, link=40e9, link_contended=40e9, gpu_upcast=1e12, cpu_downcast=5e9,
                      per_subgroup_s=0.0)


def equal(count, size=25_000_000):
    return [size] * count


def test_more_work_never_takes_less_time():
    for k in (None, 1, 2, 3):
        times = [predict(equal(n), stride_places(n, k), H200_LIKE).seconds for n in (8, 16, 32, 64)]
        assert times == sorted(times)


def test_faster_resources_never_slow_the_update():
    sizes, places = equal(40), stride_places(40, 2)
    base = predict(sizes, places, H200_LIKE).seconds
    faster_cpu = Rates(**{**H200_LIKE.as_dict(), "cpu_engine": 5e9, "cpu_contended": 3.6e9})
    faster_link = Rates(**{**H200_LIKE.as_dict(), "link": 60e9, "link_contended": 52e9})
    assert predict(sizes, places, faster_cpu).seconds <= base
    assert predict(sizes, places, faster_link).seconds <= base


def test_the_ends_are_priced_by_their_single_resource():
    n = 40
    all_cpu = predict(equal(n), stride_places(n, None), NO_CONTENTION)
    assert all_cpu.bottleneck == "cpu" and all_cpu.staged == 0
    assert all_cpu.body_s == pytest.approx(n * 25e6 / 4e9)
    all_staged = predict(equal(n), stride_places(n, 1), NO_CONTENTION)
    assert all_staged.bottleneck == "link" and all_staged.cpu == 0
    assert all_staged.body_s == pytest.approx(12 * n * 25e6 / 40e9)


def test_contention_slows_the_mix_and_one_slot_serialises_the_link():
    sizes, places = equal(40), stride_places(40, 2)
    free = Rates(**{**H200_LIKE.as_dict(), "cpu_contended": 3.8e9, "link_contended": 47e9})
    assert predict(sizes, places, H200_LIKE).seconds > predict(sizes, places, free).seconds
    assert predict(sizes, stride_places(40, 1), H200_LIKE, slots=1).seconds > \
        1.9 * predict(sizes, stride_places(40, 1), H200_LIKE, slots=2).body_s


def test_residents_cost_gpu_time_only():
    sizes = equal(10)
    cpu_only = predict(sizes, [Placement.CPU] * 10, H200_LIKE)
    with_residents = predict(sizes, [Placement.RESIDENT] * 5 + [Placement.CPU] * 5, H200_LIKE)
    assert with_residents.resident == 5 and with_residents.seconds < cpu_only.seconds
    assert predict(sizes, [Placement.RESIDENT] * 10, H200_LIKE).seconds == pytest.approx(10 * 25e6 / 120e9)


def test_the_stride_formula_is_the_special_case_of_equal_subgroups():
    """Without contention the model's best stride is the paper's k* = 1 + t_link / t_cpu, rounded."""
    n = 240
    k_star = stride_formula(25_000_000, NO_CONTENTION)
    k, _ = best_stride(equal(n), NO_CONTENTION)
    assert k in (math.floor(k_star), math.ceil(k_star))
    # at k*, the CPU's (k-1) subgroups take as long as one staged subgroup's transfer
    t_cpu = 25e6 / NO_CONTENTION.cpu_contended
    t_link = 12 * 25e6 / (NO_CONTENTION.link_contended - 4 * NO_CONTENTION.cpu_contended)
    assert (k_star - 1) * t_cpu == pytest.approx(t_link)
    # and the model's time for stride k is the slower of the two paths (the link also carries the CPU path's
    # 4 bytes per element), plus fill and drain
    for k in (2, 3, 5):
        p = predict(equal(n), stride_places(n, k), NO_CONTENTION)
        cpu_part = n * (k - 1) / k * 25e6 / NO_CONTENTION.cpu_contended
        link_part = (n / k * 12 + n * (k - 1) / k * 4) * 25e6 / NO_CONTENTION.link_contended
        assert p.body_s == pytest.approx(max(cpu_part, link_part), rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_choice_is_never_worse_than_brute_force_over_k(seed):
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(8, generator=gen).tolist()
    cpu = 1e9 + 5e9 * u[0]
    link = 10e9 + 60e9 * u[1]
    rates = Rates(cpu_adam=cpu * 1.1, cpu_engine=cpu, cpu_contended=cpu * (0.5 + 0.5 * u[2]),
                  gpu_adam=50e9 + 100e9 * u[3], h2d=link, d2h=link, bidir=link * 0.9,
                  link=link * (0.8 + 0.2 * u[4]), link_contended=link * (0.5 + 0.3 * u[5]),
                  gpu_upcast=500e9, cpu_downcast=5e9, per_subgroup_s=1e-4 * u[6])
    count = 8 + int(60 * u[7])
    sizes = equal(count)
    brute = min((predict(sizes, stride_places(count, k), rates).seconds, k) for k in [None, *range(1, count + 1)])
    k, pred = best_stride(sizes, rates)
    assert pred.seconds == brute[0]
    places, chosen = choose(sizes, rates)
    assert chosen.seconds <= brute[0] + 1e-12
    assert places == spread(count, chosen.staged)


@pytest.mark.parametrize("resident_count", [0, 30, 90])
def test_choice_beside_residents_is_the_best_spread_counting_their_gpu_time(resident_count):
    """With a slow resident path the GPU can bound the update: the choice must see the residents' GPU time
    (every spread of the rest priced with the residents in front, as the plan runs it)."""
    rates = replace(H200_LIKE, resident=5e9)
    tail = equal(40)
    prefix = [Placement.RESIDENT] * resident_count
    sizes = equal(resident_count) + tail
    brute = min(predict(sizes, prefix + spread(40, s), rates).seconds for s in range(41))
    places, chosen = choose(tail, rates, 2, sum(equal(resident_count)))
    assert predict(sizes, prefix + places, rates).seconds == pytest.approx(brute, rel=1e-12)
    assert chosen.seconds == pytest.approx(brute, rel=1e-12)
    if resident_count == 90:  # 2.25e9 resident elements at 5 G/s: the GPU bounds; staging would add to it
        assert predict(sizes, prefix + places, rates).bottleneck == "gpu"
        assert chosen.staged < choose(tail, rates)[1].staged


def test_a_head_start_on_the_cpu_moves_work_to_it_and_is_priced_as_chosen():
    """With CPU work done during backward (``speculate``), the best spread stages fewer subgroups; the
    vectorised choice equals the brute-force minimum over every spread with the same head start."""
    sizes = equal(60)
    before, plain = choose(sizes, H200_LIKE)
    ahead = 12 * 25e6
    places, chosen = choose(sizes, H200_LIKE, window=Window(ahead=ahead))
    brute = min(predict(sizes, spread(60, s), H200_LIKE, 2, Window(ahead=ahead)).seconds for s in range(61))
    assert chosen.seconds == pytest.approx(brute, rel=1e-12)
    assert predict(sizes, places, H200_LIKE, 2, Window(ahead=ahead)).seconds == \
        pytest.approx(chosen.seconds, rel=1e-12)
    assert chosen.staged < plain.staged and chosen.seconds < plain.seconds
    # a head start never makes an update longer, and beyond the CPU's work it leaves the link's
    assert all(predict(sizes, spread(60, s), H200_LIKE, 2, Window(ahead=ahead)).seconds
               <= predict(sizes, spread(60, s), H200_LIKE, 2).seconds for s in range(61))
    everything = predict(sizes, spread(60, 30), H200_LIKE, 2, Window(ahead=sum(sizes)))
    assert everything.cpu_s == 0 and everything.link_s > 0


def test_the_planner_prices_the_head_start_that_updates_kept(monkeypatch):
    """Updates that kept CPU work done during backward teach the plan its head start (their median, the
    first update ignored) and "auto" plans again for it; updates without speculation leave it at 0."""
    sizes = equal(60)
    planner = _cuda_planner(monkeypatch, sizes, H200_LIKE, ahead_cap=int(16 * 25e6))
    first = planner.plan("auto")
    for kept in (0, 10, 12, 12, 11):  # the first update teaches nothing
        planner.observe(_telemetry(planner.current.placements, 0.1, speculated_elements=int(kept * 25e6)),
                        overlapped=True)
    assert planner.ahead == 11.5 * 25e6
    again = planner.refresh()
    assert again.placements == choose(sizes, planner.rates, 2, window=planner.window)[0]
    assert again.prediction.staged < first.prediction.staged
    assert planner.factors == {"cpu_engine": 1.0, "cpu_contended": 1.0, "link_contended": 1.0}  # no rate learnt
    still = _cuda_planner(monkeypatch, sizes, H200_LIKE)
    plan = still.plan("auto")
    for _ in range(4):
        still.observe(_telemetry(still.current.placements, 0.1), overlapped=True)
    assert still.ahead == 0 and still.refresh() is plan


def test_a_plan_that_left_speculation_no_work_prices_the_spares_until_an_update_shows_more(monkeypatch):
    """An update that kept all the CPU work its plan gave (here none: every subgroup staged) shows only a
    floor: the plan then prices the spares' capacity, giving the CPU work to run ahead, until an update
    stops short of its plan's CPU work; from then on what updates kept is the head start, and a later
    floor does not bring the capacity back. An update whose backward ran under another plan teaches
    nothing. Without speculation (no capacity) nothing moves."""
    sizes, cap = equal(60), int(16 * 25e6)
    link_bound = replace(H200_LIKE, cpu_engine=H200_LIKE.cpu_engine / 8, cpu_contended=H200_LIKE.cpu_contended / 8)
    planner = _cuda_planner(monkeypatch, sizes, link_bound, ahead_cap=cap)
    first = planner.plan("auto")
    assert first.prediction.staged == 60  # the CPU is too slow to take any subgroup in the update itself
    for _ in range(2):  # the first update teaches nothing; the second kept all of nothing
        planner.observe(_telemetry(planner.current.placements, 0.0), overlapped=True)
    assert planner.ahead == cap
    explored = planner.refresh()
    assert explored is not first and explored.prediction.staged < 60
    assert explored.placements == choose(sizes, link_bound, 2, window=Window(ahead=cap))[0]
    planner.observe(_telemetry(explored.placements, 0.1), overlapped=True, planned_in_backward=False)
    assert planner.ahead == cap  # its backward ran under the plan before: it teaches nothing
    planner.observe(_telemetry(explored.placements, 0.1, speculated_elements=int(3 * 25e6)), overlapped=True)
    assert planner.ahead == 3 * 25e6  # speculation stopped short: what it kept is the head start
    settled = planner.refresh()
    assert settled.placements == choose(sizes, link_bound, 2, window=Window(ahead=3 * 25e6))[0]
    on_cpu = (60 - settled.prediction.staged) * 25e6
    planner.observe(_telemetry(settled.placements, 0.1, speculated_elements=int(on_cpu)), overlapped=True)
    assert planner.ahead == 3 * 25e6 and planner.refresh() is settled  # a floor again: the measure stays
    plain = _cuda_planner(monkeypatch, sizes, link_bound)
    plan = plain.plan("auto")
    for _ in range(3):
        plain.observe(_telemetry(plain.current.placements, 0.0), overlapped=True)
    assert plain.ahead == 0 and plain.refresh() is plan


ONE_36B = [1_364_297_728 // 55] * 55  # the 1.36B model's 55 subgroups
H200_BF16 = replace(H200_LIKE, cpu_engine=3.4e9, cpu_contended=2.9e9, link_contended=38e9, cpu_path_bytes=2)


def _window(seed):
    """A made-up window: any head start, fill, overlap and rest."""
    u = torch.rand(5, generator=torch.Generator().manual_seed(seed)).tolist()
    filled = math.inf if u[1] > 0.8 else u[1] * 1.2e9
    return Window(ahead=u[0] * 5e8, filled=filled, overlap=u[2] > 0.3, rest_s=0.3 * u[3] if u[4] > 0.2 else 0.0)


@pytest.mark.parametrize("seed", range(12))
def test_the_choice_in_any_window_is_the_best_spread_and_priced_as_predicted(seed):
    """The vectorised choice minimises the predicted iteration over every spread in the same window, and
    its prediction is the one ``predict`` gives the placement."""
    window = _window(seed)
    places, chosen = choose(ONE_36B, H200_BF16, window=window)
    by_spread = [predict(ONE_36B, spread(55, s), H200_BF16, 2, window) for s in range(56)]
    assert chosen.iteration_s == pytest.approx(min(p.iteration_s for p in by_spread), rel=1e-12)
    again = predict(ONE_36B, places, H200_BF16, 2, window)
    assert again.iteration_s == pytest.approx(chosen.iteration_s, rel=1e-12)
    assert again.seconds == pytest.approx(chosen.seconds, rel=1e-12)
    for p in by_spread:  # the iteration is the rest plus the update, and with overlap never under the cycle
        assert p.iteration_s >= window.rest_s + p.seconds - 1e-12
        assert p.iteration_s >= (p.cycle_s if window.overlap else 0.0)


def test_fills_during_backward_and_flushes_beside_the_next_forward_leave_the_update():
    """Each part of the window only shortens the update: a staged way in that came during backward leaves
    the host-to-GPU direction (and the pipeline's first fill), a way back beside the next forward leaves
    the update; the link's traffic of a step (the cycle) is the same whatever the window."""
    for s in (10, 28, 45, 55):
        places = spread(55, s)
        alone = predict(ONE_36B, places, H200_BF16)
        hidden = predict(ONE_36B, places, H200_BF16, 2, Window(overlap=True))
        filled = predict(ONE_36B, places, H200_BF16, 2, Window(filled=math.inf, overlap=True))
        half = predict(ONE_36B, places, H200_BF16, 2, Window(filled=s * ONE_36B[0] / 2, overlap=True))
        assert filled.seconds <= half.seconds <= hidden.seconds <= alone.seconds
        assert filled.cycle_s == hidden.cycle_s == alone.cycle_s > 0
        assert filled.link_s < alone.link_s
    # filled ahead but flushed inside the update: the way back still bounds the link as before
    s28 = spread(55, 28)
    assert predict(ONE_36B, s28, H200_BF16, 2, Window(filled=math.inf)).link_s == \
        pytest.approx(predict(ONE_36B, s28, H200_BF16).link_s, rel=0.05)


def test_prefetch_with_overlap_stages_more_until_the_links_cycle_binds():
    """Priced as an isolated update (or overlapped without fills), a head start on the CPU moves the 1.36B
    plan towards the CPU (19 of 55 staged here; on the H200 the model's split ran 0.374 s and half staged
    with prefetch 0.290 s, overlap.md call 38). With the way in during backward and the way back beside the
    next forward, the plan stages more, until the link's traffic of a step fills the iteration; clipped (no
    head start) it stages more still."""
    ahead = 13 * ONE_36B[0]
    _, isolated = choose(ONE_36B, H200_BF16, window=Window(ahead=ahead))
    _, overlapped = choose(ONE_36B, H200_BF16, window=Window(ahead=ahead, overlap=True, rest_s=0.14))
    _, prefetched = choose(ONE_36B, H200_BF16, window=Window(ahead=ahead, filled=math.inf, overlap=True,
                                                             rest_s=0.14))
    _, clipped = choose(ONE_36B, H200_BF16, window=Window(filled=math.inf, overlap=True, rest_s=0.14))
    assert isolated.staged == overlapped.staged < prefetched.staged < clipped.staged < 55
    assert prefetched.iteration_s < overlapped.iteration_s
    for chosen in (prefetched, clipped):  # balanced: the cycle within a subgroup's traffic of the rest + update
        assert abs(chosen.cycle_s - (0.14 + chosen.seconds)) < 12 * ONE_36B[0] / H200_BF16.link_contended + 0.01
    # a longer rest (backward) leaves the link more time: more staged
    _, longer = choose(ONE_36B, H200_BF16, window=Window(ahead=ahead, filled=math.inf, overlap=True, rest_s=0.3))
    assert longer.staged > prefetched.staged
    with pytest.raises(ValueError, match=">= 0"):
        Window(rest_s=-1.0)


def _filling_planner(monkeypatch, sizes, rates, room_elements, ahead_cap=0):
    """A planner for ``overlap`` and ``prefetch`` on a GPU whose memory for slots filled ahead holds
    ``room_elements``."""
    planner = Planner(sizes, torch.device("cuda"), 2, rates, ahead_cap=ahead_cap, overlap=True, prefetch=True)
    monkeypatch.setattr(planner, "slots_that_fit", lambda: 2)
    monkeypatch.setattr(planner, "fill_room", lambda: int(FILL_BYTES_PER_ELEMENT * room_elements))
    return planner


def _observed_updates(planner, n):
    """``n`` updates of the current plan (or all on the CPU) observed, overlapped, with nothing filled ahead."""
    places = planner.current.placements if planner.current else [Placement.CPU] * len(planner.sizes)
    for _ in range(n):
        planner.observe(_telemetry(places, 0.1), overlapped=True, planned_in_backward=False)


def test_the_planner_learns_the_rest_of_the_iteration_and_what_fills_reach(monkeypatch):
    """Under overlap the planner learns the iteration outside the update (time between two steps less the
    update's time to its last param write and the wait for its end, the least of recent steps) and plans
    again for it; with
    prefetch it prices none before a rest is learnt, then as many fills as the memory for them holds (and the
    link carries in the rest) until updates show fills stopping short, then their median. Without overlap
    nothing is learnt from step times."""
    sizes = ONE_36B
    planner = _filling_planner(monkeypatch, sizes, H200_BF16, room_elements=10**12)
    first = planner.plan("offload")
    assert planner.window == Window(filled=0.0, overlap=True), "no rest learnt yet: nothing filled ahead"
    planner.observe_step(7.0, 0.5)  # the first update's step (calibration, first calls): left out
    assert planner.rest_s == 0.0
    _observed_updates(planner, 2)
    for period, written in ((0.40, 0.20), (0.35, 0.20), (0.36, 0.22), (0.37, 0.21), (0.9, 0.2)):  # 0.9: an eval
        planner.observe_step(period, written)
    assert planner.rest_s == pytest.approx(0.14)
    link_bound = _filling_planner(monkeypatch, sizes, H200_BF16, room_elements=10**12)
    _observed_updates(link_bound, 2)
    for _ in range(3):  # a step that waited for the last update's flushes: the wait is the link's, not the rest
        link_bound.observe_step(0.5, 0.2, 0.14)
    assert link_bound.rest_s == pytest.approx(0.16)
    for _ in range(5):  # a loop that synchronizes each step: the rest it showed before is soon forgotten
        link_bound.observe_step(0.8, 0.2)
    assert link_bound.rest_s == pytest.approx(0.6)
    synced = _filling_planner(monkeypatch, sizes, H200_BF16, room_elements=10**12)
    _observed_updates(synced, 2)
    for tail in (0.1, 0.2, 0.3):  # a loop that waits for each whole update: its flush tail, however long, is not
        synced.observe_step(0.3 + 0.2 + tail, 0.2, 0.0, tail)  # rest (0.3 s of forward and backward here)
        assert synced.rest_s == pytest.approx(0.3)
    again = planner.refresh()
    assert again is not first and again.placements == choose(sizes, H200_BF16, 2, window=planner.window)[0]
    assert again.prediction.staged > first.prediction.staged  # the link has the rest of the step too
    assert planner.refresh() is again  # nothing moved
    staged = [n for n, p in zip(sizes, again.placements) if p is Placement.STAGED]
    for filled in (len(staged), 10, 9, 9):  # all filled (a floor: not a measure); then short of its plan
        planner.observe(_telemetry(again.placements, 0.1, prefetched_elements=filled * sizes[0]), overlapped=True)
    assert planner.filled == 9 * sizes[0]
    short = planner.refresh()
    assert short.placements == choose(sizes, H200_BF16, 2, window=planner.window)[0]
    assert short.prediction.staged < again.prediction.staged
    planner.observe(_telemetry(short.placements, 0.1, prefetched_elements=0), overlapped=True,
                    planned_in_backward=False)  # its backward filled for another plan: teaches nothing
    assert planner.filled == 9 * sizes[0]
    tight = _filling_planner(monkeypatch, sizes, H200_BF16, room_elements=3 * sizes[0])
    _observed_updates(tight, 2)
    tight.observe_step(0.4, 0.2)
    assert tight.plan("offload").prediction is not None and tight.filled == 3 * sizes[0]  # the memory bounds
    plain = Planner(sizes, torch.device("cuda"), 2, H200_BF16)
    _observed_updates(plain, 2)
    plain.observe_step(0.4, 0.2)
    assert plain.rest_s == 0.0 and plain.window == Window()


def test_fills_are_priced_as_far_as_the_link_carries_them_in_the_rest(monkeypatch):
    """Memory for slots is not the only bound on what comes in during backward: the link carries 12 B per
    element in the rest of the iteration at its contended rate, and fills beyond that queue ahead of the
    update's own copies up (5.2B on an H200: every fitting slot priced as filled for free beside a 0.21 s
    rest, 0.99 s predicted against 1.04 s measured, overlap.md call 46). So the plan prices no more as filled,
    and its iteration above the one with free fills; the memory still bounds where it is the tighter."""
    sizes = equal(208)
    planner = _filling_planner(monkeypatch, sizes, H200_BF16, room_elements=10**12)
    planner.plan("offload")
    assert planner.carried == 0 and planner.filled == 0  # no rest learnt yet: nothing carried
    _observed_updates(planner, 2)
    for _ in range(3):
        planner.observe_step(1.0, 0.79)
    assert planner.rest_s == pytest.approx(0.21)
    assert planner.filled == pytest.approx(0.21 * H200_BF16.link_contended / 12)
    assert planner.filled < 100 * sizes[0]  # of the ~100 subgroups a 5.2B plan stages
    bounded = planner.refresh()
    assert bounded.prediction == predict(sizes, bounded.placements, H200_BF16, 2, planner.window)
    free = choose(sizes, H200_BF16, 2, window=replace(planner.window, filled=math.inf))[1]
    assert bounded.prediction.iteration_s > free.iteration_s
    tight = _filling_planner(monkeypatch, sizes, H200_BF16, room_elements=3 * sizes[0])
    _observed_updates(tight, 2)
    tight.observe_step(1.0, 0.79)
    assert tight.filled == 3 * sizes[0]
    unknown = _filling_planner(monkeypatch, sizes, None, room_elements=10**12)  # no rates: nothing to bound by
    _observed_updates(unknown, 2)
    unknown.observe_step(1.0, 0.79)
    assert unknown.rest_s == pytest.approx(0.21) and unknown.carried == math.inf


def test_fills_within_backward_bound_what_is_carried_by_backwards_span(monkeypatch):
    """With ``FILLS_WITHIN_BACKWARD`` the fills are carried in backward's span of final gradients where it is
    shorter than the learnt rest (a loop that synchronises after backward lengthens that rest by the fills it
    waits for); the least recent span counts, none seen leaves the rest; off, the rest alone."""
    sizes = equal(208)
    planner = _filling_planner(monkeypatch, sizes, H200_BF16, room_elements=10**12)
    planner.plan("offload")
    _observed_updates(planner, 2)
    for _ in range(3):
        planner.observe_step(1.0, 0.65)
    assert planner.rest_s == pytest.approx(0.35) and planner.backward_s is None
    monkeypatch.setattr(plan_module, "FILLS_WITHIN_BACKWARD", True)
    assert planner.fill_window_s == pytest.approx(0.35)  # no backward seen yet
    for seconds in (0.14, None, 0.12, 0.13):  # None: a step with no streamed gradient says nothing
        planner.observe_backward(seconds)
    assert planner.backward_s == pytest.approx(0.12) and planner.fill_window_s == pytest.approx(0.12)
    assert planner.carried == pytest.approx(0.12 * H200_BF16.link_contended / 12)
    assert planner.filled == pytest.approx(planner.carried)
    bounded = planner.refresh().prediction.staged
    monkeypatch.setattr(plan_module, "FILLS_WITHIN_BACKWARD", False)
    assert planner.fill_window_s == pytest.approx(0.35)
    assert planner.carried == pytest.approx(0.35 * H200_BF16.link_contended / 12)
    assert planner.refresh().prediction.staged > bounded  # more carried in the longer rest: more staged
    for _ in range(5):
        planner.observe_step(1.0, 0.95)  # a rest of 0.05 s, shorter than backward's span: the rest bounds
    monkeypatch.setattr(plan_module, "FILLS_WITHIN_BACKWARD", True)
    assert planner.fill_window_s == pytest.approx(0.05)


@pytest.mark.parametrize("within_backward", [False, True])
def test_a_loop_that_synchronises_after_backward_and_the_fills_it_waits_for(monkeypatch, within_backward):
    """A simulated loop that synchronises the device after backward (the bench's phases; overlap.md calls
    142-145): its forward and backward take 0.22 s, backward's span of final gradients 0.12 s, and the
    synchronize waits for the fills still running after backward, so a step's rest reads 0.22 s plus that
    overrun. Fills sized by the learnt rest overrun by more each step: the rest and the plan climb (24 to
    39-40 of 55 staged on the H200). Bounded by backward's span (``FILLS_WITHIN_BACKWARD``) they overrun
    nothing, and the rest and the plan stay those of a loop that does not synchronise."""
    monkeypatch.setattr(plan_module, "FILLS_WITHIN_BACKWARD", within_backward)
    true_rest, span = 0.22, 0.12
    planner = _filling_planner(monkeypatch, ONE_36B, H200_BF16, room_elements=10**12)
    planner.plan("offload")
    _observed_updates(planner, 2)
    planner.observe_step(true_rest + 0.2, 0.2)
    rests, staged = [], []
    for _ in range(20):
        fill_s = planner.filled * 12 / H200_BF16.link_contended
        done_s = predict(ONE_36B, planner.current.placements, H200_BF16, 2, planner.window).seconds
        _observed_updates(planner, 1)
        planner.observe_backward(span)
        planner.observe_step(true_rest + max(0.0, fill_s - span) + done_s, done_s)
        rests.append(planner.rest_s)
        staged.append(planner.refresh().prediction.staged)
    if within_backward:
        assert rests[-1] == pytest.approx(true_rest) and staged[-5:] == [staged[-1]] * 5
        assert planner.carried == pytest.approx(span * H200_BF16.link_contended / 12)
    else:
        assert rests[-1] > 1.5 * true_rest and staged[-1] > staged[0]


@pytest.mark.parametrize("start_rest", [0.6, 0.0])
def test_a_plan_learnt_in_a_link_bound_loop_reaches_the_best_split(monkeypatch, start_rest):
    """A machine that runs as the model prices it (rest 0.14 s, fills as far as the link carries them in it:
    the planner's bound, ``Planner.carried``): each step lasts the larger of the rest plus the update and the
    link's cycle, and waits the difference for the last update's end. From a plan that stages everything
    (learnt in a loop that synchronised, a 0.6 s rest) or from none learnt, the plan reaches the best split
    for the true rest within a few steps. Had the wait counted as rest, a link-bound plan on a machine whose
    fills cost nothing would stay where it is: every fewer-staged split would look slower."""
    def run(truth, subtract):
        planner = _filling_planner(monkeypatch, ONE_36B, H200_BF16, room_elements=10**12)
        planner.plan("offload")
        _observed_updates(planner, 2)
        for _ in range(5 if start_rest else 0):
            planner.observe_step(start_rest + 0.1, 0.1)
        staged = [planner.refresh().prediction.staged]
        for _ in range(8):
            real = predict(ONE_36B, planner.current.placements, H200_BF16, 2, truth)
            period = max(truth.rest_s + real.seconds, real.cycle_s)
            _observed_updates(planner, 1)
            planner.observe_step(period, real.seconds, period - truth.rest_s - real.seconds if subtract else 0.0)
            staged.append(planner.refresh().prediction.staged)
        return staged

    truth = Window(filled=0.14 * H200_BF16.link_contended / 12, overlap=True, rest_s=0.14)
    best = choose(ONE_36B, H200_BF16, window=truth)[1].staged
    reached = run(truth, subtract=True)
    assert reached[-3:] == [best] * 3 and 20 < best < 55
    if start_rest:
        stuck = run(Window(filled=math.inf, overlap=True, rest_s=0.14), subtract=False)
        assert reached[0] > best and stuck == [reached[0]] * 9  # stuck without the wait taken out


def test_an_overlapped_optimizer_tells_its_planner_each_steps_length():
    """The optimizer times each step() against the last one and tells the planner with the update's time
    to its last param write and what of the update ran before the next forward began (in this loop, whose
    forward follows step() at once, little of it)."""
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=300, overlap=True)
    seen = []
    real = opt.planner.observe_step
    opt.planner.observe_step = lambda period, written, joined, idle: (seen.append((period, written, joined, idle)),
                                                                       real(period, written, joined, idle))
    for _ in range(4):
        model(torch.randn(8, 32)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert len(seen) == 3
    assert all(period > joined >= 0 and written is not None and written >= 0 and period > idle >= 0
               for period, written, joined, idle in seen)
    assert opt.planner.rest_s > 0
    opt.close()


def test_lower_bound_is_below_every_plan():
    sizes = equal(55)
    bound, fraction = lower_bound(sum(sizes), H200_LIKE)
    assert 0 < fraction < 1
    for k in (None, 1, 2, 3, 4):
        assert bound <= predict(sizes, stride_places(55, k), H200_LIKE).seconds
    assert bound <= choose(sizes, H200_LIKE)[1].seconds


def test_rates_round_trip_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DOS_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    assert calibrate.load_cached(cpu) is None
    path = calibrate.save(H200_LIKE, cpu)
    assert path.parent == tmp_path and calibrate.load_cached(cpu) == H200_LIKE


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 1}),
                                     "STALE", json.dumps({"version": 999}), "NEGATIVE"])
def test_corrupt_or_stale_cache_is_ignored_with_a_warning(tmp_path, monkeypatch, content):
    monkeypatch.setenv("DOS_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    path = calibrate.save(H200_LIKE, cpu)
    data = json.loads(path.read_text())
    if content == "STALE":
        data["fingerprint"]["gpu"] = "another GPU"
        content = json.dumps(data)
    elif content == "NEGATIVE":
        data["rates"]["cpu_adam"] = -1
        content = json.dumps(data)
    path.write_text(content)
    with pytest.warns(UserWarning, match="ignoring the calibration cache"):
        assert calibrate.load_cached(cpu) is None


def test_calibration_measures_positive_rates_and_caches_them(tmp_path, monkeypatch):
    monkeypatch.setenv("DOS_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    lines = []
    rates = calibrate.measure(cpu, numel=100_000, subgroups=4, log=lines.append)
    assert all(v > 0 for v in rates.as_dict().values())
    assert any("G elements/s" in line for line in lines) and any("GB/s" in line for line in lines)
    calibrate.save(rates, cpu)
    assert calibrate.calibrated_rates(cpu) == rates  # from the cache, not measured again


@needs_compiler
def test_the_bf16_cpu_path_is_calibrated_apart_and_priced_at_its_bytes(tmp_path, monkeypatch):
    """Its engine moves 2 B per CPU element each way, not 4: its rates say so, are cached in a file of their
    own (the default path's stays), and a CPU-heavy placement is priced with less link work."""
    monkeypatch.setenv("DOS_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    plain = calibrate.calibrated_rates(cpu)
    lean = calibrate.calibrated_rates(cpu, bf16=True)
    assert (plain.cpu_path_bytes, lean.cpu_path_bytes) == (4, 2)
    assert calibrate.cache_path(cpu) != calibrate.cache_path(cpu, bf16=True)
    assert calibrate.load_cached(cpu) == plain and calibrate.load_cached(cpu, bf16=True) == lean
    sizes, places = [1000] * 8, [Placement.CPU] * 7 + [Placement.STAGED]
    halved = replace(H200_LIKE, cpu_path_bytes=2)
    assert predict(sizes, places, halved).link_s < predict(sizes, places, H200_LIKE).link_s


@pytest.mark.parametrize("low_readings", [0, 1, calibrate.ENGINE_ATTEMPTS])
def test_an_engine_cpu_path_read_far_below_the_kernel_is_measured_again(monkeypatch, low_readings):
    """A busy host slows a reading and never speeds one up: the engine is measured again while its CPU path
    reads below LOW_ENGINE_CPU of the bare kernel, the fastest attempt is kept, and a reading still low
    after the last attempt warns (else "auto" would leave the CPU idle and never learn otherwise)."""
    engine_rates, readings = calibrate._engine_rates, []

    def low_at_first(*args, **kwargs):
        rates = engine_rates(*args, **kwargs)
        if len(readings) < low_readings:
            rates = replace(rates, cpu_engine=rates.cpu_adam * calibrate.LOW_ENGINE_CPU * (len(readings) + 1) / 10)
        readings.append(rates.cpu_engine)
        return rates

    monkeypatch.setattr(calibrate, "_engine_rates", low_at_first)
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rates = calibrate.measure(torch.device("cpu"), numel=100_000, subgroups=4, log=lines.append)
    assert len(readings) == min(low_readings + 1, calibrate.ENGINE_ATTEMPTS)
    assert rates.cpu_engine == max(readings), "the fastest attempt is kept"
    assert sum("measuring the engine again" in line for line in lines) == len(readings) - 1
    warned = [w for w in caught if "cpu_threads" in str(w.message)]
    assert len(warned) == (low_readings == calibrate.ENGINE_ATTEMPTS)
    if warned:
        assert str(calibrate.cache_path(torch.device("cpu"))) in str(warned[0].message)


def test_residents_are_priced_at_the_calibrated_resident_rate_else_at_the_kernel_rate():
    sizes, places = equal(8), [Placement.RESIDENT] * 8
    unmeasured = predict(sizes, places, H200_LIKE)
    assert unmeasured.gpu_s == pytest.approx(sum(sizes) / H200_LIKE.gpu_adam)
    measured = replace(H200_LIKE, resident=H200_LIKE.gpu_adam / 3)  # gather + scatter cost beside the kernel
    assert predict(sizes, places, measured).gpu_s == pytest.approx(3 * unmeasured.gpu_s)
    assert predict(sizes, places, measured).bottleneck == "gpu"


def test_optimizer_exposes_its_plan_and_replans_on_schedule_change():
    opt = DeepOptimizerStates(mlp(), subgroup_size=1500)
    assert opt.plan.schedule == "auto" and len(opt.plan.placements) == len(opt.layout.subgroups)
    opt.schedule = 3
    assert opt.plan.placements == stride_places(len(opt.layout.subgroups), 3)
    opt.schedule = "cpu"
    assert set(opt.placements) == {Placement.CPU}


def test_engine_telemetry_has_the_staged_window_and_lane_times():
    from tests.harness import loss_of

    model = mlp()
    opt = DeepOptimizerStates(model, subgroup_size=1500, schedule=2)
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    opt.step()
    u = opt.last_update
    assert 0 < u.staged_window_s <= u.seconds
    assert set(u.lane_seconds) == {"grads_down", "params_up", "stage_in", "gpu", "stage_out", "resident"}
    assert u.lane_seconds["stage_in"] > 0 and u.cpu_adam_seconds > 0
    opt.schedule = "cpu"
    opt.step()
    assert opt.last_update.staged_window_s == 0.0 and opt.last_update.lane_seconds["stage_in"] == 0.0


def _cuda_planner(monkeypatch, sizes, rates, ahead_cap=0):
    """A planner for a GPU that this CPU machine pretends to have: two staging slots always fit."""
    planner = Planner(sizes, torch.device("cuda"), 2, rates, ahead_cap=ahead_cap)
    monkeypatch.setattr(planner, "slots_that_fit", lambda: 2)
    return planner


def _telemetry(places, cpu_adam_seconds, seconds=1.0, prefetched=0, speculated_elements=0, prefetched_elements=0):
    """What the planner reads of an update that ran ``places``."""
    staged = places.count(Placement.STAGED)
    return SimpleNamespace(seconds=seconds, cpu_adam_seconds=cpu_adam_seconds, staged_subgroups=staged,
                           cpu_subgroups=len(places) - staged, prefetched=prefetched,
                           prefetched_elements=prefetched_elements,
                           speculated=int(speculated_elements > 0), speculated_elements=speculated_elements)


def _run(planner, sizes, truth, updates=5):
    """``updates`` updates of the planner's current placement on a machine whose real rates are ``truth``."""
    for _ in range(updates):
        real = predict(sizes, planner.current.placements, truth, 2)
        planner.observe(_telemetry(planner.current.placements, real.cpu_s, real.seconds))


def test_planner_learns_the_cpu_rate_alone_from_updates_all_on_the_cpu(monkeypatch):
    sizes = equal(16)
    planner = _cuda_planner(monkeypatch, sizes, H200_LIKE)
    first = planner.plan("auto")
    planner.plan("cpu")
    _run(planner, sizes, replace(H200_LIKE, cpu_engine=1.3 * H200_LIKE.cpu_engine))
    assert planner.factors == pytest.approx({"cpu_engine": 1.3, "cpu_contended": 1.0, "link_contended": 1.0})
    assert planner.rates.cpu_engine == pytest.approx(1.3 * H200_LIKE.cpu_engine)
    assert planner.rates.link == H200_LIKE.link and planner.rates.cpu_contended == H200_LIKE.cpu_contended
    again = planner.plan("auto")
    assert again.prediction.staged < first.prediction.staged  # a faster CPU takes more subgroups
    assert again.placements == choose(sizes, planner.rates, 2)[0]


def test_planner_learns_the_cpu_rate_beside_the_link_from_mixes(monkeypatch):
    sizes = equal(16)
    planner = _cuda_planner(monkeypatch, sizes, H200_LIKE)
    truth = replace(H200_LIKE, cpu_contended=0.75 * H200_LIKE.cpu_contended)  # contention hurts more
    planner.plan(2)
    _run(planner, sizes, truth)
    assert planner.factors["cpu_contended"] == pytest.approx(0.75, rel=1e-3)
    assert planner.factors["cpu_engine"] == 1.0
    for k in (2, 3):
        planner.plan(k)
        assert predict(sizes, planner.current.placements, planner.rates, 2).cpu_s == \
            pytest.approx(predict(sizes, planner.current.placements, truth, 2).cpu_s, rel=1e-3)


def test_refinement_ignores_the_first_update_and_outliers_and_never_calibrates(monkeypatch):
    sizes = equal(8)
    planner = _cuda_planner(monkeypatch, sizes, None)
    monkeypatch.setattr(calibrate, "calibrated_rates", lambda *a, **k: pytest.fail("calibrated for a fixed schedule"))
    monkeypatch.setattr(calibrate, "load_cached", lambda device, bf16=False: None)
    planner.plan("cpu")
    for _ in range(3):
        planner.observe(_telemetry(planner.current.placements, 0.1))
    assert planner.factors["cpu_engine"] == 1.0 and planner.known_rates() is None  # no rates cached
    monkeypatch.setattr(calibrate, "load_cached", lambda device, bf16=False: H200_LIKE)
    expected = predict(sizes, planner.current.placements, H200_LIKE, 2).cpu_s
    for seconds in (expected / 0.9, expected / 0.9, expected / 0.9, expected / 5.0):  # one outlier
        planner.observe(_telemetry(planner.current.placements, seconds))
    assert planner.factors["cpu_engine"] == pytest.approx(0.9)
    planner.observe(_telemetry(planner.current.placements, 0.0))  # an update with no CPU work teaches nothing
    assert planner.factors["cpu_engine"] == pytest.approx(0.9)


def test_updates_run_beside_forward_and_backward_teach_nothing(monkeypatch):
    """An overlapped update's times include the next forward's and backward's contention: the same telemetry
    that refines the CPU's rate from a synchronous update leaves every factor at 1 when it was overlapped,
    and the placements made on the calibrated rates stay."""
    sizes = equal(16)
    truth = replace(H200_LIKE, cpu_engine=0.5 * H200_LIKE.cpu_engine)
    overlapped, synchronous = (_cuda_planner(monkeypatch, sizes, H200_LIKE) for _ in range(2))
    for planner, flag in ((overlapped, True), (synchronous, False)):
        planner.plan("cpu")
        for _ in range(5):
            real = predict(sizes, planner.current.placements, truth, 2)
            planner.observe(_telemetry(planner.current.placements, real.cpu_s, real.seconds), overlapped=flag)
    assert overlapped.factors == {"cpu_engine": 1.0, "cpu_contended": 1.0, "link_contended": 1.0}
    assert synchronous.factors["cpu_engine"] == pytest.approx(0.5)


def test_updates_whose_staged_states_came_in_during_backward_teach_nothing(monkeypatch):
    """With ``prefetch`` some staged subgroups skip their way in inside the update, which the model prices:
    their updates look faster than the rates are; the same telemetry without them refines the rate."""
    sizes = equal(16)
    truth = replace(H200_LIKE, link_contended=0.5 * H200_LIKE.link_contended)
    prefetched, plain = (_cuda_planner(monkeypatch, sizes, H200_LIKE) for _ in range(2))
    for planner, filled in ((prefetched, 3), (plain, 0)):
        planner.plan(2)
        for _ in range(5):
            real = predict(sizes, planner.current.placements, truth, 2)
            planner.observe(_telemetry(planner.current.placements, real.cpu_s, real.seconds, prefetched=filled))
    assert prefetched.factors == {"cpu_engine": 1.0, "cpu_contended": 1.0, "link_contended": 1.0}
    assert plain.factors != prefetched.factors


def _link_bound(sizes, r):
    """A mix of half the subgroups staged: the link bounds it on H200-like rates."""
    places = spread(len(sizes), len(sizes) // 2)
    assert predict(sizes, places, r, 2).bottleneck == "link"
    return places


def test_planner_learns_the_contended_link_rate_from_link_bound_updates(monkeypatch):
    sizes = equal(16)
    planner = _cuda_planner(monkeypatch, sizes, H200_LIKE)
    places = _link_bound(sizes, H200_LIKE)
    planner.plan(2)
    planner.current = replace(planner.current, placements=places)
    truth = replace(H200_LIKE, link_contended=0.85 * H200_LIKE.link_contended)  # the real link is slower
    _run(planner, sizes, truth)
    assert planner.factors == pytest.approx({"cpu_engine": 1.0, "cpu_contended": 1.0, "link_contended": 0.85},
                                            rel=1e-3)
    assert planner.rates.link == H200_LIKE.link  # the rate alone is not what these updates show
    assert predict(sizes, places, planner.rates, 2).seconds == pytest.approx(
        predict(sizes, places, truth, 2).seconds, rel=1e-3)


def test_link_rate_is_not_learned_from_cpu_bound_all_staged_or_fallen_back_updates(monkeypatch):
    sizes = equal(16)
    planner = _cuda_planner(monkeypatch, sizes, H200_LIKE)
    planner.plan(8)  # the CPU bounds this one: its wall says nothing about the link
    cpu_s = predict(sizes, planner.current.placements, H200_LIKE, 2).cpu_s
    for _ in range(3):
        planner.observe(_telemetry(planner.current.placements, cpu_s, seconds=cpu_s * 1.05))
    planner.plan("gpu")  # no CPU subgroups: the link runs alone, not contended
    for _ in range(3):
        planner.observe(_telemetry(planner.current.placements, 0.0, seconds=5.0))
    planner.plan(2)
    planner.current = replace(planner.current, placements=_link_bound(sizes, H200_LIKE))
    planner.observe(_telemetry(placements("cpu", 16), cpu_s, seconds=5.0))  # no staging memory: all on the CPU
    assert planner.factors["link_contended"] == 1.0 and planner.factors["cpu_engine"] == 1.0


def test_auto_plans_again_when_the_link_turns_out_slower(monkeypatch):
    sizes = equal(16)
    planner = _cuda_planner(monkeypatch, sizes, H200_LIKE)
    first = planner.plan("auto")
    truth = replace(H200_LIKE, link_contended=0.7 * H200_LIKE.link_contended)
    for _ in range(6):
        _run(planner, sizes, truth, updates=1)
        planner.refresh()
    assert planner.factors["link_contended"] == pytest.approx(0.7, rel=1e-3)
    # sharing the link with the CPU path now costs more than it saves: every subgroup is staged
    assert first.prediction.cpu > 0 and planner.current.prediction.cpu == 0
    assert planner.current.placements == choose(sizes, planner.rates, 2)[0]
    assert predict(sizes, planner.current.placements, truth, 2).seconds < \
        predict(sizes, first.placements, truth, 2).seconds  # and on the real rates it is faster


def test_solve_finds_the_factor_or_says_there_is_none():
    assert solve(lambda f: 2.0 / f, 1.0) == pytest.approx(2.0)
    assert solve(lambda f: 2.0 / f, 100.0) is None  # a hiccup far outside the range teaches nothing


def _record(schedule, sizes, truth, timed=True):
    from deep_optimizer_states.tools.benchmark import Record

    places = placements(schedule, len(sizes))
    real = predict(sizes, places, truth, 2)
    return Record(schedule, places, 2, _telemetry(places, real.cpu_s, real.seconds), real.seconds, timed)


def test_each_schedule_is_predicted_from_the_other_schedules_updates_only():
    from deep_optimizer_states.tools.benchmark import refined_without

    sizes = equal(16)
    truth = replace(H200_LIKE, cpu_contended=0.8 * H200_LIKE.cpu_contended)
    records = [_record(k, sizes, truth) for _ in range(4) for k in ("cpu", 2, 3)]
    learnt = refined_without(2, records, sizes, H200_LIKE)
    assert learnt.factors()["cpu_contended"] == pytest.approx(0.8, rel=1e-3)  # taught by k=3 alone
    slower = replace(truth, cpu_contended=0.5 * H200_LIKE.cpu_contended)
    changed = [_record(2, sizes, slower) if r.schedule == 2 else r for r in records]
    assert refined_without(2, changed, sizes, H200_LIKE).factors() == learnt.factors()  # its own: unseen
    assert refined_without(3, changed, sizes, H200_LIKE).factors()["cpu_contended"] < 0.8  # others: seen
    only_k2 = [r for r in records if r.schedule == 2]
    assert refined_without(2, only_k2, sizes, H200_LIKE).factors()["cpu_contended"] == 1.0  # nothing to learn


def test_link_rate_is_not_learned_from_updates_with_residents(monkeypatch):
    """With residents the update's time holds their GPU work too (here 15 ms the model does not price): the
    link rate, which is right, must not absorb it."""
    sizes = equal(16)
    planner = _cuda_planner(monkeypatch, sizes, H200_LIKE)
    places = [Placement.RESIDENT] * 4 + _link_bound(sizes, H200_LIKE)[4:]
    planner.plan(2)
    planner.current = replace(planner.current, placements=places)
    for _ in range(5):
        real = predict(sizes, places, H200_LIKE, 2)
        planner.observe(SimpleNamespace(seconds=real.seconds + 0.015, cpu_adam_seconds=real.cpu_s,
                                        staged_subgroups=places.count(Placement.STAGED),
                                        cpu_subgroups=places.count(Placement.CPU), prefetched=0, speculated=0,
                                        speculated_elements=0))
    assert planner.factors["link_contended"] == 1.0
