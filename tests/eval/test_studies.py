"""The plotting studies: pe_decay.py, length_extrapolation.py, curvature.py (numbers, PNGs, CSV/JSON)."""

from __future__ import annotations

import csv
import json
import math
import struct
import zlib

import matplotlib.image
import networkx as nx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helm.evaluation import token_stream
from tests.eval.script_loader import load_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path, size):
    """A complete PNG (signature, CRC-checked chunks from IHDR to IEND) of ``size = (width, height)`` pixels, the
    script's figsize × dpi, that decodes to a drawing rather than a blank canvas."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    chunks, at = [], 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body, (crc,) = data[at + 8:at + 8 + length], struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert zlib.crc32(kind + body) == crc, (path, kind)
        chunks.append((kind, body))
        at += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", path
    assert struct.unpack(">II", chunks[0][1][:8]) == size, path
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == size[::-1]
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 16, path  # lines, text and antialiasing


def plotted(ax):
    """``{label: (x, y)}`` of the axes' lines."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def assert_labelled(fig, n_lines_at_least=1):
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        legend = ax.get_legend()
        assert legend is not None and len(legend.get_texts()) >= n_lines_at_least


def test_pe_decay_curves_have_the_properties_of_each_encoding(tmp_path):
    pe_decay = load_script("pe_decay")
    out = tmp_path / "decay.png"
    curves, fig = pe_decay.main(["--head-dim", "16", "--num-heads", "4", "--max-distance", "200", "--samples", "8",
                                 "--rope3d-chunk-size", "64", "--output", str(out),
                                 "--no-progress"])
    assert_png(out, (17 * 110, round(4.8 * 110)))
    assert_labelled(fig, n_lines_at_least=6)
    for ax, (setting, stat, _) in zip(fig.axes, pe_decay.PANELS, strict=True):  # each panel plots its curves
        lines = plotted(ax)
        assert len(lines) == len(curves[setting])
        for kind, curve in curves[setting].items():
            label = next(name for name in lines if name == kind or (kind == "alibi" and name.startswith("alibi")))
            assert lines[label] == (list(range(201)), curve[stat].tolist()), (setting, stat, kind)
    aligned, random = curves["aligned"], curves["random"]
    norm = aligned["none"]["mean"][0]  # mean |q_s|^2
    for kind in ("hope", "none", "alibi", "rope3d", "hope_boost"):  # distance 0: the space score is |q_s|^2
        assert torch.allclose(aligned[kind]["mean"][0], norm, rtol=1e-9), kind
    assert torch.allclose(aligned["none"]["mean"], norm.expand(201))  # no encoding: flat
    slope = aligned["none"]["mean"] - aligned["alibi"]["mean"]  # alibi: a linear penalty
    assert torch.allclose(slope, slope[1] * torch.arange(201, dtype=slope.dtype), atol=1e-9) and slope[1] > 0
    boost = aligned["hope_boost"]["mean"]
    assert bool((boost[1:] <= boost[:-1] + 1e-12).all()) and boost[-1] < 1e-3 * norm  # monotone decay to 0
    assert aligned["hope"]["mean"][1:].max() < norm and aligned["hope"]["mean"][1:].min() > -norm
    assert random["hope_boost"]["std"][-1] < 1e-3 < random["hope"]["std"][-1]  # damping removes the content term
    # rope3d equals hope while query (position 200 = 3·64 + 8) and key share a chunk, and differs across chunks
    assert torch.allclose(aligned["rope3d"]["mean"][:9], aligned["hope"]["mean"][:9])
    assert not torch.allclose(aligned["rope3d"]["mean"][9:], aligned["hope"]["mean"][9:])


def test_length_extrapolation_table_and_plot(make_checkpoint, text_file, tmp_path):
    extrapolation = load_script("length_extrapolation")
    models = {"hope": make_checkpoint("helm_d"), "learned": make_checkpoint("helm_d:learned"),
              "llama": make_checkpoint("llama")}
    train_length = 16  # 8x = 128 tokens: past the 64-entry table of the learned variant
    argv = [a for name, folder in models.items() for a in ("--model", f"{name}={folder}")]
    rows = extrapolation.main([*argv, "--files", str(text_file), "--train-length", str(train_length),
                               "--max-tokens", "520", "--batch-size", "4", "--output-dir", str(tmp_path),
                               "--no-progress"])
    assert [(r["model"], r["factor"]) for r in rows] == [(m, f) for m in models for f in (1, 2, 4, 8)]
    table = list(csv.DictReader((tmp_path / "extrapolation.csv").open()))
    assert len(table) == 12 and set(table[0]) == set(extrapolation.CSV_FIELDS)
    table_size = json.loads((models["learned"] / "config.json").read_text())["max_position_embeddings"]
    for row in rows:
        assert row["seq_len"] == row["factor"] * train_length
        too_long = row["model"] == "learned" and row["seq_len"] > table_size
        assert (row["perplexity"] == "") == too_long and ("max_position_embeddings" in row["note"]) == too_long
    hope = {r["factor"]: r for r in rows if r["model"] == "hope"}
    # the same tokens at every factor: scored counts differ exactly by the window-first tokens
    usable = hope[1]["windows"] * train_length
    assert usable == 512  # 520 tokens cut to a multiple of 8 x 16
    assert all(r["scored_tokens"] == usable - r["windows"] for r in hope.values())
    assert all(r["windows"] * r["seq_len"] == usable for r in hope.values())
    # each cell is exp(mean model(w, labels=w).loss) over the packed windows of the cut text
    model = AutoModelForCausalLM.from_pretrained(models["hope"]).eval()
    texts = [json.loads(line)["text"] for line in text_file.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(models["hope"])
    ids = token_stream(texts, tok, eos_id=tok.eos_token_id)[:usable]
    for factor, row in hope.items():
        with torch.no_grad():
            losses = [model(input_ids=w[None], labels=w[None]).loss for w in ids.view(-1, factor * train_length)]
        assert row["perplexity"] == pytest.approx(math.exp(float(torch.stack(losses).double().mean())), rel=1e-5)
    record = json.loads((tmp_path / "extrapolation.json").read_text())
    learned = next(run for run in record["runs"] if run["model_name"] == "learned")
    assert learned["results"]["length_extrapolation"]["ppl@8x"] is None
    assert math.isfinite(learned["results"]["length_extrapolation"]["ppl@1x"])
    assert_png(tmp_path / "extrapolation.png", (7 * 120, round(4.5 * 120)))
    fig = extrapolation.plot(rows, tmp_path / "again.png", title="t")
    assert_labelled(fig, n_lines_at_least=3)
    # one line per model through the table's scored cells (the learned model's only up to its table size)
    table_rows = [r for r in table if r["perplexity"]]
    assert plotted(fig.axes[0]) == {
        name: ([int(r["factor"]) for r in table_rows if r["model"] == name],
               [pytest.approx(float(r["perplexity"]), rel=1e-5) for r in table_rows if r["model"] == name])
        for name in models}


def test_ollivier_ricci_on_graphs_with_known_curvature():
    curvature = load_script("curvature")
    complete = nx.complete_graph(5)
    nx.set_edge_attributes(complete, 1.0, "weight")
    # K_n with idleness α: only the mass α - (1-α)/(n-1) moves, across one edge
    values = curvature.ollivier_ricci(complete, alpha=0.5, progress=False).values()
    assert all(v == pytest.approx(1 - (0.5 - 0.5 / 4)) for v in values)
    tree = nx.Graph([(0, 1), (0, 2), (0, 3), (1, 4), (1, 5)])
    nx.set_edge_attributes(tree, 1.0, "weight")
    # tree edge between two degree-3 nodes, α = 0: κ = -2(1 - 1/3 - 1/3) (Jost-Liu)
    assert curvature.ollivier_ricci(tree, alpha=0.0, progress=False)[(0, 1)] == pytest.approx(-2 / 3)


def test_lorentz_distance_matches_the_manifold_geodesic():
    from helm.manifold.math import dist, lift

    curvature = load_script("curvature")
    generator = torch.Generator().manual_seed(0)
    points = lift(3 * torch.randn(12, 6, generator=generator, dtype=torch.float64), k=2.0)
    got = torch.from_numpy(curvature.pairwise_distances(points, metric="lorentz", k=2.0))
    assert torch.allclose(got, dist(points[:, None], points[None], k=2.0), atol=1e-10)
    assert float(got.diagonal().abs().max()) == 0.0


def test_curvature_runs_on_helm_and_llama(make_checkpoint, text_file, tmp_path):
    curvature = load_script("curvature")
    record = curvature.main(["--model", f"helm={make_checkpoint('helm_d')}", "--model",
                             f"llama={make_checkpoint('llama')}", "--files", str(text_file), "--max-points", "120",
                             "--knn", "6", "--output-dir", str(tmp_path), "--no-progress"])
    runs = {run["model_name"]: run["results"]["ricci_curvature"] for run in record["runs"]}
    assert runs["helm"]["distance"] == "lorentz" and runs["llama"]["distance"] == "euclidean"
    for name, stats in runs.items():
        assert stats["points"] + stats["duplicates_dropped"] == 120 and stats["edges"] >= 6 * stats["points"] / 2
        assert stats["points"] >= 100
        assert -2.0 <= stats["min"] <= stats["mean"] <= stats["max"] <= 1.0  # unit edges: κ in [-2, 1]
        assert 0.0 <= stats["fraction_negative"] <= 1.0
    assert json.loads((tmp_path / "curvature.json").read_text()) == json.loads(json.dumps(record))
    assert_png(tmp_path / "curvature.png", (7 * 120, round(4.5 * 120)))
    values = {"a": torch.rand(50).numpy(), "b": -torch.rand(50).numpy()}
    fig = curvature.plot(values, tmp_path / "c.png", title="t")
    assert_labelled(fig, n_lines_at_least=2)
    # each histogram is the density of its values over 40 common bins
    bins = np.linspace(min(v.min() for v in values.values()), max(v.max() for v in values.values()), 41)
    for bars, v in zip(fig.axes[0].containers, values.values(), strict=True):
        assert np.allclose([bar.get_height() for bar in bars], np.histogram(v, bins=bins, density=True)[0])


def test_length_extrapolation_applies_each_rope_scaling_at_evaluation(make_checkpoint, text_file, tmp_path):
    """``--rope-scaling``: one line per (model, scaling); factor 1 is the unscaled model, longer windows run the
    scaled one (different perplexities), and a scaling an encoding does not take (learned) is a note, not a crash."""
    extrapolation = load_script("length_extrapolation")
    models = {"hope": make_checkpoint("helm_d"), "learned": make_checkpoint("helm_d:learned"),
              "llama": make_checkpoint("llama")}
    argv = [a for name, folder in models.items() for a in ("--model", f"{name}={folder}")]
    rows = extrapolation.main([*argv, "--files", str(text_file), "--train-length", "16", "--factors", "1", "2",
                               "--max-tokens", "256", "--rope-scaling", "none", "linear", "yarn", "--output-dir",
                               str(tmp_path), "--no-progress"])
    cell = {(r["model"], r["factor"]): r for r in rows}
    assert set(cell) == {(f"{m}{s}", f) for m in models for s in ("", "+linear", "+yarn") for f in (1, 2)}
    for name in ("hope", "llama"):
        for scaling in ("+linear", "+yarn"):
            assert cell[name + scaling, 1]["perplexity"] == cell[name, 1]["perplexity"]
            assert cell[name + scaling, 2]["perplexity"] != cell[name, 2]["perplexity"] != ""
    assert cell["learned+linear", 2]["perplexity"] == "" and "rope_parameters" in cell["learned+linear", 2]["note"]


def test_length_extrapolation_study_script_runs_end_to_end(tmp_path):
    """``scripts/length_extrapolation_study.sh`` as a fresh clone runs it (README), shrunk: 2 training steps, one
    HELM encoding and the tiny-llama baseline, two scalings, 4,096 evaluation tokens. Every (model, scaling, length)
    gets a row, the refused scaling of a non-rotary encoding is a note, and the README's table and figure come out."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "STEPS": "2", "ENCODINGS": "alibi", "SCALINGS": "none yarn", "MAX_TOKENS": "4096",
           "RUNS": str(tmp_path / "runs"), "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(root / "scripts" / "length_extrapolation_study.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "extrapolation.csv")))
    lengths = {256, 512, 1024, 2048, 4096}
    for model in ("alibi", "alibi+yarn", "llama-rope", "llama-rope+yarn"):
        assert {int(r["seq_len"]) for r in rows if r["model"] == model} == lengths, model
    assert all(r["perplexity"] and math.isfinite(float(r["perplexity"])) for r in rows
               if r["model"] in ("alibi", "llama-rope", "llama-rope+yarn"))
    refused = [r for r in rows if r["model"] == "alibi+yarn" and int(r["seq_len"]) > 256]
    assert refused and all(not r["perplexity"] and "yarn" in r["note"] and "alibi" in r["note"] for r in refused)
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| model | 256 | 512 | 1024 | 2048 | 4096 |"
    assert [line.split(" | ")[0] for line in table[2:]] == ["| alibi", "| llama-rope", "| llama-rope+yarn"]
    # the table prints the CSV's perplexities; the figure is the README's 13 × 5.5 in at 110 dpi
    cells = {(r["model"], int(r["seq_len"])): float(r["perplexity"]) for r in rows if r["perplexity"]}
    for line in table[2:]:
        name, *values = [cell.strip() for cell in line.strip("| ").split(" | ")]
        for n, value in zip(sorted(lengths), values, strict=True):
            assert value == (f"{cells[name, n]:,.1f}" if (name, n) in cells else "—"), (name, n)
    assert_png(tmp_path / "out" / "study.png", (13 * 110, round(5.5 * 110)))
    assert "[study] done in" in done.stdout
