"""Caffe-style layers: each is a function that emits a small bi-graph.

``build_net(net, phase, data_blobs)`` turns the job's ``net:`` list into
the forward graph of one replica. A layer whose ``top`` equals its ``bottom``
(Caffe's in-place, e.g. ReLU) writes a new single-assignment blob
(``conv1@relu1``) and later layers reading ``conv1`` see that newest version.

Learnable blobs are ``<layer>/weight`` and ``<layer>/bias`` (kind ``param``),
carrying their filler and lr/decay multipliers in ``attrs``.

Every layer type declares its keys (``Key``: name, kind, default, meaning)
when it registers with ``@layer(..., keys=[...])``; ``check_layer`` rejects a
key no declaration names (exit 2 with a "did you mean"), at config load time
and again when the net is built. ``NetBuilder.get(key)`` takes the declared
kind and default, so a declaration is the one place a key is defined.
docs/config.md is generated from these declarations: after changing keys run
``python -m purine_mpi.tools.docgen --write``.
"""
from .registry import (COMMON_KEYS, KIND_DOC, LAYER_SPECS, LAYERS, PARAM_KEYS,  # noqa: F401
                       REQUIRED, Key, LayerSpec, Required, check_layer, layer, layer_spec)
from .build import NetBuilder, build_net  # noqa: F401
from . import standard  # noqa: E402,F401  registers the standard layers
from . import transformer  # noqa: E402,F401  and the transformer layers
