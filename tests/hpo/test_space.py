"""The search space: r grid, decomposition into (lr, T) within bounds, the r(eps) fit, clamping."""

import math

import numpy as np
import pytest

from dpadapter.hpo.space import SearchSpace, StepConfig, fit_scaling

SPACE = SearchSpace(lr_min=0.05, lr_max=2.0, steps_min=10, steps_max=60, grid_size=8)


def test_grid_is_log_spaced_between_the_products_of_the_bounds():
    g = SPACE.grid()
    assert len(g) == 8
    assert g[0] == pytest.approx(0.05 * 10) and g[-1] == pytest.approx(2.0 * 60)
    ratios = np.diff(np.log(g))
    assert np.allclose(ratios, ratios[0])


def test_random_decomposition_stays_within_bounds_and_keeps_r():
    rng = np.random.default_rng(0)
    seen_steps = set()
    for _ in range(300):
        r = SPACE.sample_r(rng)
        assert r in SPACE.grid()
        c = SPACE.decompose_random(r, rng)
        assert isinstance(c.steps, int) and SPACE.steps_min <= c.steps <= SPACE.steps_max
        assert SPACE.lr_min <= c.lr <= SPACE.lr_max
        assert c.r == pytest.approx(r)
        seen_steps.add(c.steps)
    assert len(seen_steps) > 10  # T is actually sampled, not fixed


def test_a_sweep_samples_distinct_grid_points_uniformly():
    rng = np.random.default_rng(1)
    counts = dict.fromkeys(SPACE.grid(), 0)
    for _ in range(400):
        rs = SPACE.sample_sweep(rng, 3)
        assert len(set(rs)) == 3 and set(rs) <= set(SPACE.grid())
        for r in rs:
            counts[r] += 1
    assert min(counts.values()) > 0.6 * 150  # each point: 3/8 of 400 sweeps on average
    assert len(SPACE.sample_sweep(rng, 10)) == 10  # more trials than points: repeats allowed


def test_decomposition_is_reproducible_from_the_seed():
    a = [SPACE.decompose_random(SPACE.sample_r(r), r) for r in [np.random.default_rng(3)] * 5]
    b = [SPACE.decompose_random(SPACE.sample_r(r), r) for r in [np.random.default_rng(3)] * 5]
    assert a == b


def test_max_steps_decomposition_prefers_the_most_steps():
    assert SPACE.decompose_max_steps(30.0) == StepConfig(lr=0.5, steps=60)
    # r below lr_min * steps_max: fewer steps at lr >= lr_min
    small = SPACE.decompose_max_steps(1.0)
    assert small.steps == 20 and small.lr == pytest.approx(0.05)
    assert SPACE.decompose_max_steps(0.5) == StepConfig(lr=0.05, steps=10)
    for r in SPACE.grid():
        c = SPACE.decompose_max_steps(r)
        assert c.r == pytest.approx(r)
        assert SPACE.lr_min <= c.lr <= SPACE.lr_max


def test_clamping_to_the_grid():
    assert SPACE.clamp(-50.0) == SPACE.r_min
    assert SPACE.clamp(1e6) == SPACE.r_max
    assert SPACE.clamp(7.0) == 7.0
    with pytest.raises(ValueError):
        SPACE.clamp(math.nan)
    # an out-of-range r is clamped before it is decomposed
    assert SPACE.decompose_max_steps(1e6) == StepConfig(lr=2.0, steps=60)


def test_line_through_two_points():
    f = fit_scaling([(0.1, 2.0), (0.2, 3.0)])
    assert f.kind == "linear"
    assert f.slope == pytest.approx(10.0) and f.intercept == pytest.approx(1.0)
    assert f.predict(0.1) == pytest.approx(2.0) and f.predict(0.2) == pytest.approx(3.0)
    assert f.predict(0.88) == pytest.approx(9.8)


def test_quadratic_through_three_points():
    pts = [(0.1, 1.0), (0.2, 4.0), (0.3, 9.0)]  # r = 100 eps^2
    f = fit_scaling(pts, "quadratic")
    assert f.coeffs == pytest.approx((100.0, 0.0, 0.0), abs=1e-9)
    assert f.predict(1.0) == pytest.approx(100.0)


def test_fit_rejects_degenerate_inputs():
    with pytest.raises(ValueError, match="distinct"):
        fit_scaling([(0.1, 1.0), (0.1, 2.0)])
    with pytest.raises(ValueError, match="at least 3"):
        fit_scaling([(0.1, 1.0), (0.2, 2.0)], "quadratic")
    with pytest.raises(ValueError, match="unknown fit"):
        fit_scaling([(0.1, 1.0), (0.2, 2.0)], "cubic")


def test_negative_slope_extrapolation_is_clamped():
    f = fit_scaling([(0.1, 100.0), (0.2, 1.0)])
    assert f.predict(0.9) < 0
    assert SPACE.clamp(f.predict(0.9)) == SPACE.r_min


def test_space_validates_its_bounds():
    with pytest.raises(ValueError):
        SearchSpace(2.0, 1.0, 1, 2, 4)
    with pytest.raises(ValueError):
        SearchSpace(0.1, 1.0, 5, 2, 4)
    with pytest.raises(ValueError):
        SearchSpace(0.1, 1.0, 1, 2, 1)
