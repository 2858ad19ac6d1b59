"""The training run's loss curve picture: valid SVG whatever the points (one, flat, NaN, attempts)."""
import base64
import math
import xml.etree.ElementTree as ET

from orbit_dagster.assets.metadata import loss_svg

NS = "{http://www.w3.org/2000/svg}"


def polylines(points):
    root = ET.fromstring(base64.b64decode(loss_svg(points)))
    return [p.get("points").split() for p in root.iter(NS + "polyline")]


def test_one_colour_per_attempt_and_every_coordinate_finite():
    points = [{"step": s, "attempt": 1 if s < 10 else 2, "train_loss": 4.0 - s / 10} for s in range(1, 20)]
    lines = polylines(points)
    assert [len(line) for line in lines] == [9, 10]
    assert all(math.isfinite(float(v)) for line in lines for xy in line for v in xy.split(","))


def test_a_single_point_a_flat_curve_and_nan_losses_still_draw():
    assert len(polylines([{"step": 5, "attempt": 1, "train_loss": 2.0}])[0]) == 1
    flat = polylines([{"step": s, "attempt": 1, "train_loss": 1.0} for s in (1, 2, 3)])
    assert len(flat[0]) == 3 and all(math.isfinite(float(v)) for xy in flat[0] for v in xy.split(","))
    with_nan = polylines([{"step": 1, "attempt": 1, "train_loss": float("nan")},
                          {"step": 2, "attempt": 1, "train_loss": 3.0}, {"step": 3, "attempt": 1, "train_loss": 2.0}])
    assert len(with_nan[0]) == 2  # the NaN point is left out, not drawn as nan
