import pytest
import torch

from dicache.engine.calibrators import (
    CorrectedTaylorCalibrator,
    InputCorrectedCalibrator,
    ReuseCalibrator,
    TaylorSeerCalibrator,
    make_calibrator,
)
from dicache.settings.cache_config import CacheConfig


def poly(coeffs):
    return lambda x: sum(c * x**k for k, c in enumerate(coeffs))


@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("positions", [[0, 1, 2, 3], [0, 2, 3, 7], [1.0, 0.8, 0.55, 0.3]])
def test_taylorseer_is_exact_on_polynomials_of_its_order(order, positions):
    torch.manual_seed(order)
    coeffs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(order + 1)]
    f = poly(coeffs)
    cal = TaylorSeerCalibrator(order)
    for x in positions:
        cal.update(x, f(x))
    step = positions[-1] - positions[-2]
    for target in (positions[-1] + step * 0.5, positions[-1] + step, positions[-1] + 3 * step):
        torch.testing.assert_close(cal.estimate(target), f(target), rtol=1e-9, atol=1e-9)
    assert cal.stored_tensors == order + 1


def test_order_two_is_not_exact_on_cubics_but_order_one_degrades_gracefully():
    f = poly([torch.tensor(0.0), torch.tensor(0.0), torch.tensor(0.0), torch.tensor(1.0)])
    cal = TaylorSeerCalibrator(2)
    for x in (0, 1, 2, 3):
        cal.update(x, f(x))
    assert not torch.allclose(cal.estimate(4), f(4))


def test_available_from_second_computed_step_and_falls_back_to_reuse():
    cal = TaylorSeerCalibrator(2)
    assert not cal.ready
    cal.update(0, torch.tensor([1.0]))
    assert cal.ready and cal.estimate(5).item() == 1.0  # one point: plain reuse
    cal.update(1, torch.tensor([3.0]))
    assert cal.estimate(2).item() == 5.0  # two points: linear, already at the 2nd computed step
    assert cal.stored_tensors == 2


def test_memory_bound_is_order_plus_one():
    cal = TaylorSeerCalibrator(1)
    for x in range(10):
        cal.update(x, torch.full((2,), float(x)))
    assert cal.stored_tensors == 2


def test_reuse_returns_last_residual_unchanged():
    cal = ReuseCalibrator()
    a, b = torch.randn(3), torch.randn(3)
    cal.update(0, a)
    cal.update(4, b)
    assert cal.estimate(9) is b and cal.stored_tensors == 1
    with pytest.raises(RuntimeError):
        ReuseCalibrator().estimate(0)


def test_order_is_validated():
    with pytest.raises(ValueError, match="1 or 2"):
        TaylorSeerCalibrator(3)


def test_damping_scales_the_extrapolation_terms():
    r0, r1 = torch.full((3,), 1.0), torch.full((3,), 3.0)
    estimates = {}
    for damping in (0.0, 0.5, 1.0):
        c = TaylorSeerCalibrator(order=1, damping=damping)
        c.update(0.0, r0)
        c.update(1.0, r1)
        estimates[damping] = c.estimate(2.0)
    torch.testing.assert_close(estimates[1.0], torch.full((3,), 5.0))  # plain linear extrapolation
    torch.testing.assert_close(estimates[0.0], r1)  # damping 0 is reuse
    torch.testing.assert_close(estimates[0.5], torch.full((3,), 4.0))
    with pytest.raises(ValueError, match="taylorseer_damping"):
        TaylorSeerCalibrator(order=1, damping=1.5)


@pytest.mark.parametrize("positions", [[0, 1, 2, 3], [0, 1, 3, 7], [1.0, 0.9, 0.62, 0.2]])
def test_corrected_is_exact_on_linear_sequences_from_the_third_computed_step(positions):
    torch.manual_seed(0)
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    cal = CorrectedTaylorCalibrator(1, damping=0.5)
    for x in positions:
        cal.update(x, a + b * x)
    assert cal.gain == pytest.approx(1.0)
    step = positions[-1] - positions[-2]
    for target in (positions[-1] + step * 0.5, positions[-1] + 3 * step):
        torch.testing.assert_close(cal.estimate(target), a + b * target, rtol=1e-9, atol=1e-9)
    assert cal.stored_tensors == 2


@pytest.mark.parametrize("q", [0.3, 0.7, 1.0])
def test_corrected_is_exact_one_step_ahead_on_geometric_increments(q):
    torch.manual_seed(1)
    a, b = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    f = lambda n: a + b * sum(q**i for i in range(n))  # noqa: E731  increments b, b·q, b·q², …
    cal = CorrectedTaylorCalibrator(1, damping=0.5)
    for n in range(4):
        cal.update(float(n), f(n))
    assert cal.gain == pytest.approx(q)
    torch.testing.assert_close(cal.estimate(4.0), f(4), rtol=1e-9, atol=1e-9)


def test_corrected_falls_back_to_reuse_then_damped_taylorseer():
    cal = CorrectedTaylorCalibrator(1, damping=0.5)
    assert not cal.ready
    cal.update(0, torch.tensor([1.0]))
    assert cal.estimate(5).item() == 1.0  # one point: plain reuse
    cal.update(1, torch.tensor([3.0]))
    assert cal.estimate(2).item() == 4.0  # two points: TaylorSeer with the configured damping
    assert cal.gain == 0.5


def test_corrected_gain_is_clamped_and_kept_when_the_trend_is_zero():
    cal = CorrectedTaylorCalibrator(1, damping=0.5)
    for x, m in ((0, 0.0), (1, 1.0), (2, 5.0)):  # the trend carried 4x as far as predicted: clamped to 1
        cal.update(x, torch.tensor([m]))
    assert cal.gain == 1.0
    cal.update(3, torch.tensor([3.0]))  # overshoot the other way: the fit is negative, clamped to 0
    assert cal.gain == 0.0
    cal = CorrectedTaylorCalibrator(1, damping=0.5)
    for x in (0, 1, 2):
        cal.update(x, torch.tensor([2.0]))  # flat: no trend to fit, the gain stays at the damping
    assert cal.gain == 0.5
    cal.reset()
    assert not cal.ready and cal.gain == 0.5


def test_make_calibrator_picks_the_forecaster():
    on = {"enable_taylorseer": True, "taylorseer_damping": 0.5}
    assert type(make_calibrator(CacheConfig.from_env({}, **on))) is TaylorSeerCalibrator
    corrected = make_calibrator(CacheConfig.from_env({}, forecaster="corrected", **on))
    assert isinstance(corrected, CorrectedTaylorCalibrator) and corrected.damping == 0.5
    assert type(make_calibrator(CacheConfig.from_env({}))) is ReuseCalibrator  # TaylorSeer off: reuse
    assert type(make_calibrator(CacheConfig.from_env({}, forecaster="input_corrected", **on))) is (
        InputCorrectedCalibrator
    )


def test_input_corrected_by_hand():
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    cal = InputCorrectedCalibrator(1, damping=0.5)
    cal.update(0, t(1, 1), t(0, 0))
    assert cal.estimate(1, t(2, 2)).tolist() == [1, 1] and cal.coupling is None  # one point: reuse
    cal.update(1, t(3, 3), t(1, 1))  # e = (2, 2), d = (1, 1), no trend yet: a = <e,d>/<d,d> = 2
    assert cal.coupling == 2.0 and cal.gain == 0.5
    # D0 + damping·D1·(2 − 1) + a·(u − u0) = 3 + 0.5·2 + 2·2
    assert cal.estimate(2, t(3, 3)).tolist() == [8, 8]
    # t = T(2) = (2, 2), e = (3, 1), d = (1, 0): <t,t> 8, <d,d> 1, <t,d> 2, <e,t> 8, <e,d> 3, det 4 -> g 0.5, a 2
    cal.update(2, t(6, 4), t(2, 1))
    assert cal.gain == pytest.approx(0.5) and cal.coupling == pytest.approx(2.0)
    # D0 (6, 4) + 0.5·D1 (3, 1)·(3 − 2) + 2·((4, 2) − (2, 1))
    torch.testing.assert_close(cal.estimate(3, t(4, 2)), t(11.5, 6.5))
    assert cal.stored_tensors == 3  # D0, D1 and the input
    cal.reset()
    assert not cal.ready and cal.coupling is None and cal.stored_tensors == 0


@pytest.mark.parametrize("positions", [[0, 1, 2, 3], [1.0, 0.9, 0.62, 0.2]])
def test_input_corrected_is_exact_on_residuals_affine_in_the_input(positions):
    torch.manual_seed(2)
    a, k = torch.randn(3, 4, dtype=torch.float64), 0.7
    inputs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(len(positions) + 1)]
    cal = InputCorrectedCalibrator(1, damping=0.5)
    for x, u in zip(positions, inputs):
        cal.update(x, a + k * u, u)
    assert cal.coupling == pytest.approx(k)
    torch.testing.assert_close(cal.estimate(positions[-1] * 0.5, inputs[-1]), a + k * inputs[-1])


def test_input_corrected_on_a_still_or_missing_input_is_the_corrected_forecaster():
    torch.manual_seed(4)
    residuals = [torch.randn(6, dtype=torch.float64) for _ in range(4)]
    still = torch.randn(6, dtype=torch.float64)
    for source in (still, None):
        plain, cal = CorrectedTaylorCalibrator(1, damping=0.5), InputCorrectedCalibrator(1, damping=0.5)
        for x, m in enumerate(residuals):
            plain.update(x, m)
            cal.update(x, m, source)
            assert cal.gain == pytest.approx(plain.gain)
            # a still stream keeps the fitted trend (never frozen to the last residual)
            torch.testing.assert_close(cal.estimate(x + 1.5, source), plain.estimate(x + 1.5))
