"""The ``layouts`` family: keras-hub backbones without a ``get_layout_map``
get one (``hub/layouts.py``), checked on one process against each model's
real variables; a backbone without a row gets the planner's layout (BERT,
ViT, T5), or where ``hub/layouts.NO_ROW`` knows why it has none, an error
saying what to write and why (upstream has no ``get_layout_map`` there:
AttributeError);
deactivation takes it away. The sharded runs are
``tests/multiprocess/test_layouts.py``."""

from __future__ import annotations

import pytest

from support import ROOT, last_json

pytest.importorskip("keras_hub")

PROGRAM = """
import json, re, sys
sys.path.insert(0, sys.argv[1])
import keras, keras_hub
import keras_dtensor_fix as kdf
from cases_layouts import CAUSAL_LMS, _classes, build_backbone
from keras_dtensor_fix.hub import layouts

devices = keras.distribution.list_devices()[:1]
mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices)
out = {"models": {}, "rows": len(layouts.ROWS)}
for kind in CAUSAL_LMS:
    backbone_cls, _ = _classes(kind)
    layout_map = backbone_cls.get_layout_map(mesh)
    backbone = build_backbone(kind)
    sharded, bad = 0, []
    for v in backbone.weights:
        keys = [k for k in layout_map._layout_map if re.fullmatch(k, v.path)]
        if len(keys) > 1 or (keys and
                len(layout_map._layout_map[keys[0]].axes) != len(v.shape)):
            bad.append(v.path)
        sharded += bool(keys)
    out["models"][kind] = {"sharded": sharded, "bad": bad}
import logging
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("keras_dtensor_fix").addHandler(Keep())
logging.getLogger("keras_dtensor_fix").setLevel(logging.INFO)
planned = {}
for name in ("BertBackbone", "ViTBackbone", "T5Backbone"):
    lm = getattr(keras_hub.models, name).get_layout_map(mesh)
    planned[name] = [len(lm), type(lm).__name__]
out["planned"], out["logged"] = planned, seen
try:
    keras_hub.models.MistralBackbone.get_layout_map(mesh, "tensor")
except ValueError as exc:
    out["bad_axis"] = str(exc)
bert = keras_hub.models.BertBackbone
layouts.NO_ROW[(bert.__module__, bert.__qualname__)] = "a reason"
try:
    bert.get_layout_map(mesh)
except NotImplementedError as exc:
    out["no_row"] = str(exc)
out["no_rows"], out["no_row_names"] = {}, [n for _, n in layouts.NO_ROW]
for (module, name), why in layouts.NO_ROW.items():
    try:
        getattr(keras_hub.models, name).get_layout_map(mesh)
    except NotImplementedError as exc:
        out["no_rows"][name] = (str(exc), why)
out["own"] = keras_hub.models.GemmaBackbone.get_layout_map.__qualname__
kdf.deactivate()
out["after"] = hasattr(keras_hub.models.MistralBackbone, "get_layout_map")
out["gemma_after"] = hasattr(keras_hub.models.GemmaBackbone, "get_layout_map")
print(json.dumps(out))
"""


def test_every_row_fits_its_model(run_py) -> None:
    multiprocess = ROOT / "tests" / "multiprocess"
    out = last_json(run_py(PROGRAM, argv=[str(multiprocess)]))
    assert len(out["models"]) == out["rows"] == 20
    for kind, found in out["models"].items():
        # each path matches one rule at most, with one axis per weight axis
        assert found["bad"] == [], kind
        # Q/K/V, the attention output, the MLP and the embedding at least
        assert found["sharded"] >= 7, (kind, found)
    # no row, no reason: the planner's layout, one INFO line each
    for name, (rules, kind) in out["planned"].items():
        assert rules >= 4 and kind == "PlannedLayoutMap", name
    assert len(out["logged"]) == 3
    assert "BertBackbone has no layout of its own; planned" in out["logged"][0]
    # no row (hub/layouts.NO_ROW): what to write, and why it has none
    assert "LayoutMap" in out["no_row"] and "BertBackbone: a reason" in out["no_row"]
    assert sorted(out["no_rows"]) == sorted(out["no_row_names"])
    for name, (error, why) in out["no_rows"].items():
        assert f"{name}: {why}" in error and "LayoutMap" in error, name
    assert (
        "'tensor'" in out["bad_axis"] and "model_parallel_dim_name" in (out["bad_axis"])
    )
    assert out["own"] == "GemmaBackbone.get_layout_map"  # keras-hub's own stays
    assert out["after"] is False and out["gemma_after"] is True
