"""Model parallelism and pipelining: place parts of one training graph on
different ranks, then let ``graph.partition`` cut it into per-rank slices
joined by Send/Recv ops.

    place_layers(graph, {"conv1": 0, "fc1": 1, "loss": 1})   # layer -> rank
    local = compose_partitioned(graph, world)                 # this rank's slice

A graph given in the seed's low-level format (``graph:`` in the config) can
carry its own locations ({ip, device} or {rank}); ``compose_partitioned``
then only partitions. Ops are grouped into layers by name (``<layer>.fwd``,
``<layer>.bwd.*``, ``<layer>/weight.update``); an op that belongs to no
listed layer runs with the producer of its first input (rank 0 for a
source). Blobs without a producer (weights, momenta, the iteration counter)
live with their first reader, so each weight stays with its layer and its
update runs there too.
"""
import dataclasses

from ..base.errors import UserError
from ..graph.core import Location
from .partition import partition


def layer_of(name, layers):
    """The layer an op or blob name belongs to (longest listed prefix that
    ends at '.', '/' or '@'), or None."""
    best = None
    for layer in layers:
        if name == layer or (name.startswith(layer) and name[len(layer)] in "./@"):
            if best is None or len(layer) > len(best):
                best = layer
    return best


def place_layers(graph, layer_ranks, default=0, device=-1):
    """Set every op's and every source blob's location from ``layer_ranks``
    ({layer name: rank}), in place. Returns {op name: rank}."""
    unknown = [layer for layer in layer_ranks
               if not any(layer_of(op, [layer]) for op in graph.ops)]
    if unknown:
        raise UserError(f"placement names layer(s) {', '.join(unknown)} that the graph does "
                        "not have")
    prod = graph.producers()
    placed = {}
    for op in graph.topo_order():
        layer = layer_of(op.name, layer_ranks)
        if layer is not None:
            rank = int(layer_ranks[layer])
        else:
            rank = default
            for b in op.inputs:
                if prod.get(b):
                    rank = placed[prod[b][0].name]
                    break
        placed[op.name] = rank
        op.location = dataclasses.replace(op.location, rank=rank, ip=None, device=device)
    cons = graph.consumers()
    for op in graph.topo_order():
        for b in op.outputs:
            blob = graph.blobs[b]
            blob.location = Location(placed[op.name], device)
    for name, blob in graph.blobs.items():
        if prod.get(name):
            continue
        readers = cons.get(name, ())
        rank = placed[readers[0].name] if readers else default
        blob.location = Location(rank, device)
    # an alias's storage root lives where the alias is written
    for name, blob in graph.blobs.items():
        if blob.alias_of is not None and prod.get(name):
            root = graph.storage_root(name)
            if not prod.get(root):
                graph.blobs[root].location = blob.location
    return placed


def compose_partitioned(graph, world=None, size=None, rank=None):
    """This rank's slice of a graph whose ops carry locations on several
    ranks. Every rank's slice has an ``iter`` blob (the trainer writes it
    each iteration, whether or not the learning-rate op runs here)."""
    if world is None and (size is None or rank is None):
        from ..comm.world import get_world
        world = get_world()
    rank = world.rank if rank is None else rank
    local = partition(graph, rank, hosts=world, size=size)
    if "iter" in graph.blobs and "iter" not in local.blobs:
        b = graph.blobs["iter"]
        local.add_blob("iter", b.shape, b.dtype, Location(rank), kind=b.kind)
    local.infer_shapes().validate()
    return local
