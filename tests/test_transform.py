"""The data transform (scale, mean, mirror, crop_size) against NumPy
reference code, its determinism across ranks and resumes, and its config
errors."""
import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import ConfigError, UserError
from purine_mpi.graph.core import Op
from purine_mpi.job.config import resolve_config
from purine_mpi.data.transform import apply_transform, output_shape
from purine_mpi.ops.data import DataReader

N, C, H, W = 24, 3, 7, 6


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    """Random 0..255 images in a float32 file; label i is sample i."""
    path = str(tmp_path_factory.mktemp("transform") / "images.h5")
    images = np.random.default_rng(5).integers(0, 256, (N, C, H, W), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("train/data", data=images.astype(np.float32))
        f.create_dataset("train/label", data=np.arange(N, dtype=np.int64))
    return images, path


def reference(sample, mean, scale, crop, top, left, flip):
    """Caffe's DataTransformer for one C x H x W sample, written out loop by loop."""
    out = np.empty((C, crop, crop), np.float64)
    for c in range(C):
        for h in range(crop):
            for w in range(crop):
                src_w = left + (crop - 1 - w if flip else w)
                out[c, h, w] = (float(sample[c, top + h, src_w]) - mean[c]) * scale
    return out.astype(np.float32)


def read(spec, batch, iters, rank=0, world=1, seed=11, train=True, start=0):
    attrs = {"source": spec, "batch_size": batch, "rank": rank, "world_size": world,
             "seed": seed, "train": train}
    kernel = DataReader(Op("data", "DataReader", [], ["data", "label"], attrs))
    kernel.reset_position(start)
    shapes = DataReader.infer(attrs, [])
    out = []
    for _ in range(iters):
        outs = [np.empty(s, d) for s, d in shapes]
        kernel.run([], outs)
        out.append(outs)
    return out


def spec_of(path, **transform):
    return dict({"source": "hdf5", "path": path, "split": "train", "shuffle": True}, **transform)


MEAN, SCALE, CROP = [100.0, 120.5, 90.0], 0.0125, 5


def test_test_phase_is_center_crop_without_mirror(image_file):
    images, path = image_file
    spec = spec_of(path, mean=MEAN, scale=SCALE, crop_size=CROP, mirror=True)
    (data, labels), = read(spec, N, 1, train=False)
    top, left = (H - CROP) // 2, (W - CROP) // 2
    for i, label in enumerate(labels):
        expect = reference(images[label], MEAN, SCALE, CROP, top, left, False)
        np.testing.assert_allclose(data[i], expect, rtol=1e-6, atol=1e-6)


def test_train_phase_is_some_crop_and_flip_of_each_sample(image_file):
    """Each output is the reference transform at one of the possible offsets
    and flips; over the batch every offset and both flips occur."""
    images, path = image_file
    spec = spec_of(path, mean=MEAN, scale=SCALE, crop_size=CROP, mirror=True)
    batches = read(spec, N, 4)
    seen = set()
    for data, labels in batches:
        for i, label in enumerate(labels):
            matches = [(top, left, flip) for top in range(H - CROP + 1)
                       for left in range(W - CROP + 1) for flip in (False, True)
                       if np.allclose(data[i], reference(images[label], MEAN, SCALE, CROP,
                                                         top, left, flip), atol=1e-6)]
            assert matches, f"sample {label} is no crop/flip of its image"
            seen.update(matches)
    assert {flip for _, _, flip in seen} == {False, True}
    assert {top for top, _, _ in seen} == set(range(H - CROP + 1))
    assert {left for _, left, _ in seen} == set(range(W - CROP + 1))


@pytest.mark.parametrize("train", [True, False])
def test_uint8_and_float_inputs_agree(image_file, train):
    images, _ = image_file
    spec = dict(mean=MEAN, scale=SCALE, crop_size=CROP, mirror=True)
    positions = np.arange(100, 100 + N)
    a = apply_transform(images, spec, positions, 3, train)
    b = apply_transform(images.astype(np.float32), spec, positions, 3, train)
    assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b)


def test_scalar_mean_and_scale_only(image_file):
    images, path = image_file
    (data, labels), = read(spec_of(path, mean=128, scale=0.5), N, 1)
    assert data.shape == (N, C, H, W)
    np.testing.assert_array_equal(data, (images[labels].astype(np.float32) - 128) * 0.5)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_together_transform_like_one_rank(image_file, world):
    _, path = image_file
    spec = spec_of(path, crop_size=CROP, mirror=True, scale=SCALE)
    batch, iters = 2, 5
    single = read(spec, world * batch, iters)
    per_rank = [read(spec, batch, iters, r, world) for r in range(world)]
    for t in range(iters):
        for k in (0, 1):
            joined = np.concatenate([per_rank[r][t][k] for r in range(world)])
            np.testing.assert_array_equal(joined, single[t][k])


def test_resume_draws_what_the_run_would_have_drawn(image_file):
    _, path = image_file
    spec = spec_of(path, crop_size=CROP, mirror=True)
    straight = read(spec, 5, 9)  # crosses epochs of 24 samples
    resumed = read(spec, 5, 4, start=5)
    for a, b in zip(straight[5:], resumed):
        np.testing.assert_array_equal(a[0], b[0])
    other_seed = read(spec, 5, 9, seed=12)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(straight, other_seed))


def test_source_arrays_stay_untouched(image_file):
    images, _ = image_file
    batch = images[:4].copy()
    out = apply_transform(batch, {"mirror": True, "mean": 1.0}, np.arange(4), 0, True)
    assert np.array_equal(batch, images[:4]) and out.dtype == np.float32


def test_shape_checks_name_the_key():
    assert output_shape({"crop_size": 4}, (3, 8, 9)) == (3, 4, 4)
    with pytest.raises(UserError, match="crop_size 9 is larger"):
        output_shape({"crop_size": 9}, (3, 8, 9))
    with pytest.raises(UserError, match="'mean' has 2 values but the samples have 3"):
        output_shape({"mean": [1.0, 2.0]}, (3, 8, 9))


@pytest.mark.parametrize("key,value,expected", [
    ("scale", "abc", "a positive number"), ("scale", 0, "a positive number"),
    ("mean", [1, "x"], "a number or a list of numbers"), ("mean", [], "a number or a list"),
    ("mirror", "yes", "true or false"), ("crop_size", 0, "a positive integer"),
    ("crop_size", 2.5, "a positive integer"),
])
def test_config_errors_name_the_key(key, value, expected):
    raw = {"data": {"train": {"source": "synthetic", "shape": [1, 4, 4], "classes": 2,
                              "batch_size": 2, key: value}},
           "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc", "num_output": 2}]}
    with pytest.raises(ConfigError) as info:
        resolve_config(raw)
    assert f"key 'data.train.{key}'" in str(info.value) and expected in str(info.value)


def test_config_keeps_valid_transform_keys():
    raw = {"data": {"train": {"source": "synthetic", "shape": [3, 4, 4], "classes": 2,
                              "batch_size": 2, "scale": 0.5, "mean": [1, 2, 3],
                              "mirror": True, "crop_size": 3}},
           "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc", "num_output": 2}]}
    spec = resolve_config(raw)["data"]["train"]
    assert (spec["scale"], spec["mean"], spec["mirror"], spec["crop_size"]) == (
        0.5, [1.0, 2.0, 3.0], True, 3)
