"""A tensor-parallel parameter's shards (parallel/tensor_parallel.py splits
them): its split attrs, one shard cut from the whole array and the whole
joined from its shards. NumPy only, so that the schemes' checkpoint stream
(parallel/schemes/base.py) joins shards without importing the split pass,
which imports the schemes."""
import numpy as np

#: attr of a row-split fc's forward op on the tensor shards other than 0:
#: the bias it does not add (shard 0 adds it; tensor_parallel.split_graph),
#: which it would read there: stage 3 gathers that bias's bucket before the
#: op on every shard (parallel/sharding._gather_units), so the ranks post
#: the same collectives in the same ``seq`` order
SHARD0_BIAS_ATTR = "bias_added_by_shard0"


def split_of(blob):
    """A param blob's ``tensor_split`` attrs, or None when it is whole."""
    return blob.attrs.get("tensor_split")


def take_shard(split, whole):
    """This rank's slice of the whole array ``whole`` of a split param."""
    axis, parts, index = split["axis"], split["parts"], split["index"]
    blocks = _blocks(split, whole)
    n = blocks.shape[axis + 1] // parts
    sl = [slice(None)] * blocks.ndim
    sl[axis + 1] = slice(index * n, (index + 1) * n)
    part = blocks[tuple(sl)]
    shape = list(whole.shape)
    shape[axis] //= parts
    return np.ascontiguousarray(part).reshape(shape)


def join_shards(split, shards):
    """The whole array from the shards of every index (in order)."""
    axis = split["axis"]
    joined = np.concatenate([_blocks(split, s) for s in shards], axis=axis + 1)
    shape = list(shards[0].shape)
    shape[axis] *= len(shards)
    return joined.reshape(shape)


def _blocks(split, array):
    """``array`` with its split axis viewed as (blocks, rows of a block)."""
    axis, k = split["axis"], int(split.get("blocks", 1))
    shape = array.shape
    return array.reshape(shape[:axis] + (k, shape[axis] // k) + shape[axis + 1:])
