"""The compiled `vision` entry (the tower: patches -> aligned rows, `vision.tower`) on the CPU,
against the graph's tower on shared-vision-small's weights.

Built once for the module (only this entry, the case's config: `dsv41 compile --entries
vision`). Tolerances: the case's bounds for `aligner_embeddings` (per-row relative L2, max and
median, `case.json` noise_floor.acceptance.bounds), both against the graph tower and against
the golden rows of the case's image; the shapes of a small image whose grid is padded (a 3 x 5
patch grid, r = 3) must agree as well."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CONFORMANCE
from PIL import Image

from dsv41.compiler.build import CompileOptions, compile_artifact
from dsv41.graph.image_processor import preprocess
from dsv41.graph.model import Model
from dsv41.graph.vision import encode_image
from dsv41.runtime.backends.artifact import Artifact
from dsv41.runtime.backends.compiled import CompiledPhases

CASE = CONFORMANCE / "shared-vision-small"


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def compiled(vcase, tmp_path_factory):
    model = Model.from_checkpoint(vcase.checkpoint)
    opts = CompileOptions(args=model.args, model_name="vision-small", target="cpu",
                          out=tmp_path_factory.mktemp("artifacts"), entries=("vision",))
    report = compile_artifact(opts)
    print(f"vision entry built in {report.total_seconds:.0f} s")
    art = Artifact.load(opts.artifact_dir)
    return model, CompiledPhases(art, model, threads=2), art


def test_compiled_vision_entry_matches_the_graph_tower(vcase, compiled):
    model, phases, art = compiled
    assert art.entries == ("vision",)
    assert art.manifest.entries["vision"].outputs == ("aligned",)
    b = vcase.bounds
    lo, mid = (b[k]["aligner_embeddings"] for k in ("hidden_states_rel_l2_max",
                                                     "hidden_states_rel_l2_median"))
    image = preprocess(Image.fromarray(vcase.golden["image_rgb"], "RGB"), model.args)
    got = phases.encode_image(model, image).float().numpy()
    graph = encode_image(model.w, model.args, image).float().numpy()
    golden = vcase.golden["aligner_embeddings"].astype(np.float32)
    assert got.shape == graph.shape == golden.shape
    for name, ref in (("graph tower", graph), ("golden", golden)):
        e = _rel(got, ref)
        print(f"compiled vision vs {name}: rel L2 max {e.max():.3g}, median {np.median(e):.3g}")
        assert e.max() <= lo and np.median(e) <= mid
    # a small image: 3 x 5 patches, padded to 3 x 6 by the aligner (one zero column)
    small = preprocess(Image.fromarray(vcase.golden["image_rgb"][:42, :70], "RGB"),
                       model.args.replace(vision_min_pixels=1))
    assert (small.grid.n_vit_h, small.grid.n_vit_w) == (3, 5)
    got = phases.encode_image(model, small).float().numpy()
    e = _rel(got, encode_image(model.w, model.args, small).float().numpy())
    print(f"small padded image: rel L2 max {e.max():.3g}")
    assert got.shape == (2, model.args.dim) and e.max() <= lo


def test_vision_entry_needs_a_tower(small_model):
    from dsv41.compiler.capture import capture

    with pytest.raises(ValueError, match="vision_n_layers is 0"):
        capture(small_model, "vision")
