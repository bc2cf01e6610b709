"""Caffe-style layers: each is a function that emits a small bi-graph.

``build_net(net, phase, data_blobs)`` turns the job's ``net:`` list into
the forward graph of one replica. A layer whose ``top`` equals its ``bottom``
(Caffe's in-place, e.g. ReLU) writes a new single-assignment blob
(``conv1@relu1``) and later layers reading ``conv1`` see that newest version.

Learnable blobs are ``<layer>/weight`` and ``<layer>/bias`` (kind ``param``),
carrying their filler and lr/decay multipliers in ``attrs``.

Every layer type declares its keys (``Key``: name, kind, default, meaning,
and for a numeric key its ``Range``) when it registers with ``@layer(...,
keys=[...])``; ``check_layer`` rejects a key no declaration names (exit 2
with a "did you mean") and a value outside its kind or range, at config
load time and again when the net is built. ``NetBuilder.get(key)`` takes the declared
kind and default, so a declaration is the one place a key is defined.
docs/config.md is generated from these declarations: after changing keys run
``python -m purine_mpi.tools.docgen --write``.
"""
from .registry import (AT_LEAST_ONE, COMMON_KEYS, FINITE, FRACTION, KIND_DOC,  # noqa: F401
                       LAYER_SPECS, LAYERS, NON_NEGATIVE, PARAM_KEYS, POSITIVE, RATIO, REQUIRED,
                       Key, LayerSpec, Range, Required, Slot, check_layer, layer, layer_key,
                       layer_spec)
from .build import NetBuilder, build_net  # noqa: F401
from . import standard  # noqa: E402,F401  registers the standard layers
from . import transformer  # noqa: E402,F401  and the transformer layers
