"""The example configs of docs/config.md (``tools/docgen_sections``): a full job,
a residual block, and a layer type of one's own. tests/test_docs.py checks
that each validates and builds.
"""


EXAMPLE = """\
name: digits_small             # output in runs/digits_small/<N>
seed: 1
data:
  train: {path: data/digits.h5, split: train, batch_size: 32}
  test:  {path: data/digits.h5, split: test, batch_size: 60}
net:
  - {type: conv, name: conv1, bottom: data, num_output: 16, kernel: 3, pad: 1}
  - {type: relu, name: relu1, bottom: conv1, top: conv1}        # in place
  - {type: pool, name: pool1, bottom: conv1, pool: max, kernel: 2, stride: 2}
  - {type: fc, name: fc1, bottom: pool1, num_output: 10,
     weight_filler: {type: gaussian, std: 0.01}, param: [{lr_mult: 1}, {lr_mult: 2}]}
  - {type: softmax_loss, name: loss, bottom: [fc1, label]}
  - {type: accuracy, name: accuracy, bottom: [fc1, label], phase: test}
solver: {type: sgd, base_lr: 0.05, momentum: 0.9, weight_decay: 5.0e-4,
         lr_policy: step, gamma: 0.1, stepsize: 600, max_iter: 900,
         test_interval: 300, display: 100}
checkpoint: {interval: 300, keep: 3}
"""


RESIDUAL_EXAMPLE = """\
net:
  - {type: conv, name: a, bottom: data, num_output: 8, kernel: 3, pad: 1}
  - {type: batch_norm, name: a_bn, bottom: a, top: a}
  - {type: relu, name: a_relu, bottom: a, top: a}
  - {type: conv, name: b, bottom: a, num_output: 8, kernel: 3, pad: 1}
  - {type: eltwise, name: sum, bottom: [a, b], operation: sum}   # the residual sum
  - {type: dropout, name: drop, bottom: sum, top: sum, ratio: 0.3}
solver: {type: adamw, base_lr: 0.001, weight_decay: 0.01, lr_policy: cosine,
         warmup_iters: 100, max_iter: 5000}
"""


CUSTOM_LAYER_EXAMPLE = '''\
from purine_mpi.layers import POSITIVE, Key, layer

@layer("scaled_relu", keys=(Key("scale", "number", 1.0, "factor after the ReLU", POSITIVE),))
def scaled_relu(b):
    """ReLU followed by a constant factor."""
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    mid = f"{b.cfg['name']}.relu"
    b.op("Relu", [x], [mid], {"negative_slope": 0.0}, tag="relu")
    b.op("Scale", [mid], [y], {"scale": float(b.get("scale"))})
'''
