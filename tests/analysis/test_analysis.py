"""jsa.analysis.tensor_ranges and plot_ranges, through the public API."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics import analysis

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
DOC = Path(__file__).resolve().parents[2] / "docs" / "analysis.md"


def reference_stats(data, formats=(E4M3, E5M2)):
    """Statistics of `data` computed independently: casts with ml_dtypes, float64 sums."""
    x = np.asarray(data)
    a = np.abs(x.astype(np.float64))
    finite = np.isfinite(a)
    nonzero = a > 0
    nnz = max(nonzero.sum(), 1)
    stats = {
        "rms": float(np.sqrt(np.mean(a[finite] ** 2))),
        "max_abs": float(a[finite].max()),
        "subnormal": float((nonzero & (a < ml_dtypes.finfo(x.dtype).smallest_normal)).sum()) / nnz,
        "nonfinite": float((~finite).sum()) / a.size,
    }
    for name in formats:
        cast = x.astype(np.float32).astype(jnp.dtype(name)).astype(np.float64)
        stats[f"{name}_flush"] = float((nonzero & (cast == 0)).sum()) / nnz
        stats[f"{name}_overflow"] = float((a > ml_dtypes.finfo(jnp.dtype(name)).max).sum()) / a.size
    return stats


def assert_row_matches(row, data, scale):
    expected = reference_stats(data)
    assert row.dtype == np.asarray(data).dtype.name
    assert row.shape == np.shape(data)
    assert row.scale == float(scale)
    np.testing.assert_allclose(row.rms, expected["rms"], rtol=1e-6)
    assert row.max_abs == expected["max_abs"]
    assert row.subnormal == expected["subnormal"]
    assert row.nonfinite == expected["nonfinite"]
    for name in (E4M3, E5M2):
        assert row.flush[name] == expected[f"{name}_flush"]
        assert row.overflow[name] == expected[f"{name}_overflow"]


def test_known_data_gives_exact_statistics():
    # neg keeps the scale and negates the data: the row describes known float16 data.
    data = np.array([500.0, -4.0, 0.0, 2.0**-20], np.float16)
    x = jsa.scaled_array(data, 2.0**-20)
    table = analysis.tensor_ranges(lambda a: -a, x)
    (row,) = table.rows
    assert (row.index, row.equation, row.iteration, row.output) == (0, 0, None, 0)
    assert (row.primitive, row.phase, row.dtype, row.shape) == ("neg", "forward", "float16", (4,))
    assert row.scale == 2.0**-20
    np.testing.assert_allclose(row.rms, np.sqrt((500.0**2 + 16 + 2.0**-40) / 4), rtol=1e-6)
    assert row.max_abs == 500.0
    # Nonzero elements: 500, -4, 2^-20; only 2^-20 is subnormal in float16 and flushes in
    # both formats (below half their smallest subnormal, 2^-10 and 2^-17); 500 is above
    # float8_e4m3fn's max (448), not float8_e5m2's (57344).
    assert row.subnormal == 1 / 3 and row.nonfinite == 0.0
    assert row.flush == {E4M3: 1 / 3, E5M2: 1 / 3}
    assert row.overflow == {E4M3: 1 / 4, E5M2: 0.0}
    assert "test_analysis.py:" in row.source and row.source.endswith("<lambda>)")
    # A library function has no user source line (frames of JAX and jsa are skipped).
    assert analysis.tensor_ranges(jnp.negative, x).rows[0].source == ""


def test_multiplication_flushing_in_e4m3_matches_real_casts():
    data = np.array([[2.0**-6, 2.0**-4], [1.5, 0.0]], np.float16)
    x = jsa.scaled_array(data, 2.0**-20)
    f = lambda a: a * a
    out = jsa.autoscale(f)(x)
    (row,) = jsa.analysis.tensor_ranges(f, x).rows
    assert row.primitive == "mul"
    assert_row_matches(row, out.data, out.scale)
    np.testing.assert_allclose(row.max_abs * row.scale, 2.25 * 2.0**-40, rtol=1e-3)

    # Plain float16 (scale 1): 2^-12, 2^-8, 2.25 and 0; 2^-12 flushes in float8_e4m3fn only.
    (plain,) = jsa.analysis.tensor_ranges(f, x.data).rows
    assert plain.scale == 1.0
    assert_row_matches(plain, data * data, 1.0)
    assert plain.flush == {E4M3: 1 / 3, E5M2: 0.0}
    assert plain.max_abs == 2.25


def test_plain_mode_has_scale_one_and_shows_what_scaling_avoids():
    x = jsa.scaled_array(np.array([1.0, 2.0, 3.0, 300.0], np.float16), 2.0**-10)
    f = lambda a: a * a
    scaled = analysis.tensor_ranges(f, x)
    plain = analysis.tensor_ranges(f, x, scaled=False)
    assert not plain.scaled and scaled.scaled
    assert [r.scale for r in plain.rows] == [1.0]
    (row,) = plain.rows
    # Plain float16 values 2^-10, 2^-9, 3 * 2^-10, 300 * 2^-10: their squares are subnormal
    # (2^-20, 2^-18, 9 * 2^-20) or normal (0.0858).
    assert_row_matches(row, (x.data * np.float16(2.0**-10)) ** 2, 1.0)
    assert row.subnormal == 3 / 4
    assert scaled.rows[0].subnormal == 0.0 and scaled.rows[0].scale != 1.0

    # Non-finite elements are counted, and left out of RMS and max.
    (inf_row,) = analysis.tensor_ranges(f, jnp.array([300.0, 2.0], jnp.float16)).rows
    assert inf_row.nonfinite == 0.5 and inf_row.max_abs == 4.0 and inf_row.rms == 4.0
    assert inf_row.overflow == {E4M3: 0.5, E5M2: 0.5}


def mlp_loss(w1, w2, x):
    h = jnp.tanh(x @ w1)
    return jnp.sum((h @ w2) ** 2)


@pytest.mark.slow
def test_forward_and_backward_pass_of_grad():
    rng = np.random.default_rng(0)
    w1 = jsa.as_scaled_array(jnp.asarray(rng.normal(size=(4, 8)), jnp.float16))
    w2 = jsa.as_scaled_array(jnp.asarray(rng.normal(size=(8, 2)), jnp.float16))
    x = jsa.as_scaled_array(jnp.asarray(rng.normal(size=(3, 4)), jnp.float16))
    table = analysis.tensor_ranges(jax.grad(mlp_loss, argnums=(0, 1)), w1, w2, x)
    assert table.name == "mlp_loss"
    phases = [r.phase for r in table.rows]
    split = phases.index("backward")
    assert set(phases[:split]) == {"forward"} and set(phases[split:]) == {"backward"}
    forward, backward = table.select("forward"), table.select("backward")
    assert [r.primitive for r in forward][:2] == ["dot_general", "tanh"]
    # dh, dw2, dw1: each weight gradient one product in the weights' layout (autodiff's
    # transpose of it fused, docs/design.md "autoscale").
    assert "transpose" not in {r.primitive for r in backward}
    assert sum(r.primitive == "dot_general" for r in backward) == 3
    # The gradients are the outputs of the last backward equations.
    grads = jsa.autoscale(jax.grad(mlp_loss, argnums=(0, 1)))(w1, w2, x)
    last = table.rows[-1]
    assert last.shape == (4, 8) and last.primitive == "dot_general"
    assert_row_matches(last, grads[0].data, grads[0].scale)
    assert [r.index for r in table.rows] == list(range(len(table)))
    assert set(table.summary()) == {"forward", "backward"}


def test_rows_from_jit_body_and_scan_iterations_in_order():
    def f(x):
        y = jax.jit(lambda a: jnp.sin(a) * 3.0)(x)
        c, _ = jax.lax.scan(lambda c, _: (c * 0.5, None), y, None, length=3)
        return c

    x = jsa.as_scaled_array(jnp.array([1.0, -0.5], jnp.float16))
    table = analysis.tensor_ranges(f, x)
    summary = [(r.primitive, r.iteration, r.equation) for r in table.rows]
    assert summary == [
        ("sin", 0, 0),
        ("mul", 0, 0),
        ("jit", None, 0),
        ("mul", 0, 1),
        ("mul", 1, 1),
        ("mul", 2, 1),
        ("scan", None, 1),
    ]
    assert all("test_analysis.py" in r.source for r in table.rows)
    values = [r.max_abs * r.scale for r in table.rows]
    expected = 3 * np.sin(1.0) * np.array([1, 1, 1, 0.5, 0.25, 0.125, 0.125])
    expected[0] = np.sin(1.0)
    np.testing.assert_allclose(values, expected, rtol=4e-3)
    out = jsa.autoscale(f)(x)
    assert_row_matches(table.rows[-1], out.data, out.scale)
    # Deterministic: a second run gives the same rows.
    assert analysis.tensor_ranges(f, x).rows == table.rows


def test_table_helpers():
    x = jsa.scaled_array(np.array([500.0, -4.0, 0.0, 2.0**-20], np.float16), 1.0)
    table = analysis.tensor_ranges(lambda a: jnp.abs(-a), x, formats=[E4M3, jnp.float16])
    assert table.formats == (E4M3, "float16")
    records = table.to_dicts()
    assert [d["primitive"] for d in records] == ["neg", "abs"]
    assert records[0][f"{E4M3}_overflow"] == 0.25 and records[0]["float16_flush"] == 0.0
    assert "flush" not in records[0] and records[0]["shape"] == (4,)
    assert table.worst(1, by="overflow") == table.rows[:1]
    assert table.worst(by="overflow", format="float16") == ()
    assert table.worst(by="subnormal", phase="backward") == ()
    summary = table.summary()["forward"]
    assert summary["rows"] == 2 and summary["max_abs"] == 500.0
    assert summary[f"{E4M3}_overflow_rows"] == 2 and summary["nonfinite_rows"] == 0
    text = table.to_text()
    lines = text.splitlines()
    assert lines[0].startswith("<lambda>: 2 tensors, scaled")
    header = next(line for line in lines if line.lstrip().startswith("#"))
    assert "e4m3fn:flush%" in header and "source" in header
    assert len(table.to_text(1).splitlines()) == len(lines) - 1
    assert str(table) == text


def test_plot_has_two_panels_and_writes_png(tmp_path):
    table = analysis.tensor_ranges(
        jax.grad(lambda w: jnp.sum(jnp.tanh(w * 3.0))),
        jsa.as_scaled_array(jnp.linspace(-1, 1, 8, dtype=jnp.float16)),
    )
    path = tmp_path / "ranges.png"
    fig = analysis.plot_ranges(table, E5M2, path=path)
    assert len(fig.axes) == 2
    assert [ax.get_title() for ax in fig.axes] == [
        f"forward pass ({len(table.select('forward'))} tensors)",
        f"backward pass ({len(table.select('backward'))} tensors)",
    ]
    assert "<lambda>" in fig._suptitle.get_text() and E5M2 in fig._suptitle.get_text()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Drawn into given axes; a format the table has no statistics for only shades its range.
    from matplotlib.figure import Figure

    own = Figure()
    axes = own.subplots(1, 2)
    assert analysis.plot_ranges(table, "bfloat16", axes=axes) is own


def test_bad_inputs_raise_clear_errors():
    x = jnp.ones(2, jnp.float16)
    with pytest.raises(ValueError, match=r"Unknown format 'float8_e9m9': expected a floating"):
        analysis.tensor_ranges(jnp.sin, x, formats=["float8_e9m9"])
    with pytest.raises(ValueError, match="Unknown format 'int8'"):
        analysis.tensor_ranges(jnp.sin, x, formats=("int8",))
    with pytest.raises(ValueError, match="at least one format"):
        analysis.tensor_ranges(jnp.sin, x, formats=())
    table = analysis.tensor_ranges(jnp.sin, x)
    with pytest.raises(ValueError, match="Unknown criterion 'size'"):
        table.worst(by="size")
    with pytest.raises(ValueError, match="'float16' was not recorded in this table"):
        table.worst(format="float16")
    with pytest.raises(ValueError, match="Unknown format 'e4m3'"):
        analysis.plot_ranges(table, "e4m3")
    with pytest.raises(ValueError, match="Unknown pass 'forwards'"):
        table.select("forwards")
    with pytest.raises(TypeError, match="cannot be called inside jit"):
        jax.jit(lambda a: analysis.tensor_ranges(jnp.sin, a).rows[0].rms)(x)


def _without_counts(line: str) -> str:
    if re.match(r"(\w+: |  forward: |  backward: )\d+ tensors", line):
        return re.sub(r"(\d+ tensors|flush \d+)", "#", line)
    return line


@pytest.mark.slow
def test_doc_snippet_runs_and_its_output_is_current(tmp_path, monkeypatch, capsys):
    text = DOC.read_text()
    (block,) = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "analysis.md", "exec"), {})
    out = capsys.readouterr().out
    assert (tmp_path / "ranges.png").exists()
    shown = re.search(r"^```\n(loss: .*?)^```", text, re.S | re.M).group(1)
    # JAX releases differ by an equation here and there (a convert, a broadcast): summary
    # lines are compared with their counts of tensors and flushed rows left out.
    printed = [_without_counts(line) for line in out.splitlines()]
    for line in shown.splitlines():
        if "..." not in line:
            assert _without_counts(line) in printed
