"""The subset of ``caffe.proto`` that the converter reads (text format) and
the field numbers it decodes from ``.caffemodel`` files (wire format).

A field kind is ``"string"``, ``"int"``, ``"float"``, ``"bool"``, a tuple of
enum names in enum-number order (the text format may give an enum by its
number), or the name of a message type. Fields that Caffe has and the converter does not support are
left out on purpose: the parser then names them as unsupported.
"""

PHASES = ("TRAIN", "TEST")
ENGINES = ("DEFAULT", "CAFFE", "CUDNN")

_FILLER = {"type": "string", "value": "float", "min": "float", "max": "float",
           "mean": "float", "std": "float", "variance_norm": ("FAN_IN", "FAN_OUT", "AVERAGE")}
_WINDOW = {"pad": "int", "pad_h": "int", "pad_w": "int", "kernel_size": "int",
           "kernel_h": "int", "kernel_w": "int", "stride": "int", "stride_h": "int",
           "stride_w": "int", "engine": ENGINES}

_LAYER_PARAMS = {
    "convolution_param": "ConvolutionParameter", "pooling_param": "PoolingParameter",
    "inner_product_param": "InnerProductParameter", "relu_param": "ReLUParameter",
    "sigmoid_param": "EngineParameter", "tanh_param": "EngineParameter",
    "lrn_param": "LRNParameter", "dropout_param": "DropoutParameter",
    "concat_param": "ConcatParameter", "slice_param": "SliceParameter",
    "eltwise_param": "EltwiseParameter", "softmax_param": "SoftmaxParameter",
    "accuracy_param": "AccuracyParameter", "batch_norm_param": "BatchNormParameter",
    "scale_param": "ScaleParameter", "flatten_param": "FlattenParameter",
    "reshape_param": "ReshapeParameter", "data_param": "DataParameter",
    "hdf5_data_param": "HDF5DataParameter", "image_data_param": "ImageDataParameter",
    "transform_param": "TransformationParameter", "loss_param": "LossParameter",
}
_LAYER_COMMON = dict({"name": "string", "bottom": "string", "top": "string",
                      "include": "NetStateRule", "exclude": "NetStateRule",
                      "loss_weight": "float"}, **_LAYER_PARAMS)

#: old ``layers {}`` type enum (V1LayerParameter.LayerType), in enum-number
#: order (0..39), with the new type name of each
V1_ENUM = (
    ("NONE", "None"), ("ACCURACY", "Accuracy"), ("BNLL", "BNLL"), ("CONCAT", "Concat"),
    ("CONVOLUTION", "Convolution"), ("DATA", "Data"), ("DROPOUT", "Dropout"),
    ("EUCLIDEAN_LOSS", "EuclideanLoss"), ("FLATTEN", "Flatten"), ("HDF5_DATA", "HDF5Data"),
    ("HDF5_OUTPUT", "HDF5Output"), ("IM2COL", "Im2col"), ("IMAGE_DATA", "ImageData"),
    ("INFOGAIN_LOSS", "InfogainLoss"), ("INNER_PRODUCT", "InnerProduct"), ("LRN", "LRN"),
    ("MULTINOMIAL_LOGISTIC_LOSS", "MultinomialLogisticLoss"), ("POOLING", "Pooling"),
    ("RELU", "ReLU"), ("SIGMOID", "Sigmoid"), ("SOFTMAX", "Softmax"),
    ("SOFTMAX_LOSS", "SoftmaxWithLoss"), ("SPLIT", "Split"), ("TANH", "TanH"),
    ("WINDOW_DATA", "WindowData"), ("ELTWISE", "Eltwise"), ("POWER", "Power"),
    ("SIGMOID_CROSS_ENTROPY_LOSS", "SigmoidCrossEntropyLoss"), ("HINGE_LOSS", "HingeLoss"),
    ("MEMORY_DATA", "MemoryData"), ("ARGMAX", "ArgMax"), ("THRESHOLD", "Threshold"),
    ("DUMMY_DATA", "DummyData"), ("SLICE", "Slice"), ("MVN", "MVN"), ("ABSVAL", "AbsVal"),
    ("SILENCE", "Silence"), ("CONTRASTIVE_LOSS", "ContrastiveLoss"), ("EXP", "Exp"),
    ("DECONVOLUTION", "Deconvolution"),
)
V1_TYPES = dict(V1_ENUM)
#: V1 enum number -> new type name (.caffemodel files store the number)
V1_BY_NUMBER = {number: new for number, (_, new) in enumerate(V1_ENUM)}

TEXT_SCHEMA = {
    "NetParameter": {"name": "string", "layer": "LayerParameter",
                     "layers": "V1LayerParameter", "force_backward": "bool"},
    "LayerParameter": dict(_LAYER_COMMON, type="string", param="ParamSpec", phase=PHASES),
    "V1LayerParameter": dict(_LAYER_COMMON, type=tuple(name for name, _ in V1_ENUM),
                             blobs_lr="float",
                             weight_decay="float"),
    "NetStateRule": {"phase": PHASES},
    "ParamSpec": {"lr_mult": "float", "decay_mult": "float"},
    "FillerParameter": _FILLER,
    "EngineParameter": {"engine": ENGINES},
    "ConvolutionParameter": dict(_WINDOW, num_output="int", bias_term="bool", group="int",
                                 dilation="int", weight_filler="FillerParameter",
                                 bias_filler="FillerParameter"),
    "PoolingParameter": dict(_WINDOW, pool=("MAX", "AVE", "STOCHASTIC"),
                             global_pooling="bool", round_mode=("CEIL", "FLOOR")),
    "InnerProductParameter": {"num_output": "int", "bias_term": "bool", "axis": "int",
                              "transpose": "bool", "weight_filler": "FillerParameter",
                              "bias_filler": "FillerParameter"},
    "ReLUParameter": {"negative_slope": "float", "engine": ENGINES},
    "LRNParameter": {"local_size": "int", "alpha": "float", "beta": "float", "k": "float",
                     "norm_region": ("ACROSS_CHANNELS", "WITHIN_CHANNEL"), "engine": ENGINES},
    "DropoutParameter": {"dropout_ratio": "float"},
    "ConcatParameter": {"axis": "int", "concat_dim": "int"},
    "SliceParameter": {"axis": "int", "slice_dim": "int", "slice_point": "int"},
    "EltwiseParameter": {"operation": ("PROD", "SUM", "MAX"), "coeff": "float",
                         "stable_prod_grad": "bool"},
    "SoftmaxParameter": {"axis": "int", "engine": ENGINES},
    "AccuracyParameter": {"top_k": "int", "axis": "int", "ignore_label": "int"},
    "BatchNormParameter": {"use_global_stats": "bool", "moving_average_fraction": "float",
                           "eps": "float"},
    "ScaleParameter": {"axis": "int", "num_axes": "int", "filler": "FillerParameter",
                       "bias_term": "bool", "bias_filler": "FillerParameter"},
    "FlattenParameter": {"axis": "int", "end_axis": "int"},
    "ReshapeParameter": {"shape": "BlobShape", "axis": "int", "num_axes": "int"},
    "BlobShape": {"dim": "int"},
    "DataParameter": {"source": "string", "batch_size": "int", "backend": ("LEVELDB", "LMDB"),
                      "scale": "float", "crop_size": "int", "mirror": "bool",
                      "rand_skip": "int", "prefetch": "int"},
    "HDF5DataParameter": {"source": "string", "batch_size": "int", "shuffle": "bool"},
    "ImageDataParameter": {"source": "string", "batch_size": "int", "shuffle": "bool",
                           "is_color": "bool", "root_folder": "string", "scale": "float",
                           "crop_size": "int", "mirror": "bool", "rand_skip": "int"},
    "TransformationParameter": {"scale": "float", "mirror": "bool", "crop_size": "int",
                                "mean_value": "float", "mean_file": "string"},
    "LossParameter": {"ignore_label": "int", "normalization": (
        "FULL", "VALID", "BATCH_SIZE", "NONE"), "normalize": "bool"},
    "SolverParameter": {
        "net": "string", "train_net": "string", "test_net": "string", "test_iter": "int",
        "test_interval": "int", "test_initialization": "bool", "base_lr": "float",
        "display": "int", "average_loss": "int", "max_iter": "int", "iter_size": "int",
        "lr_policy": "string", "gamma": "float", "power": "float", "momentum": "float",
        "weight_decay": "float", "regularization_type": "string", "stepsize": "int",
        "stepvalue": "int", "snapshot": "int", "snapshot_prefix": "string",
        "snapshot_diff": "bool", "snapshot_format": ("HDF5", "BINARYPROTO"),
        "solver_mode": ("CPU", "GPU"), "device_id": "int", "random_seed": "int",
        "type": "string", "solver_type": ("SGD", "NESTEROV", "ADAGRAD", "RMSPROP",
                                          "ADADELTA", "ADAM"),
        "debug_info": "bool", "snapshot_after_train": "bool", "momentum2": "float",
        "delta": "float", "rms_decay": "float", "clip_gradients": "float"},
}

#: the repeated fields of ``TEXT_SCHEMA``'s messages (caffe.proto's
#: ``repeated``); any other field holds one value, and a second is refused
REPEATED = {
    "NetParameter": {"layer", "layers"},
    "LayerParameter": {"bottom", "top", "param", "include", "exclude", "loss_weight"},
    "V1LayerParameter": {"bottom", "top", "include", "exclude", "loss_weight", "blobs_lr",
                         "weight_decay"},
    "ConvolutionParameter": {"pad", "kernel_size", "stride", "dilation"},
    "SliceParameter": {"slice_point"},
    "EltwiseParameter": {"coeff"},
    "TransformationParameter": {"mean_value"},
    "BlobShape": {"dim"},
    "SolverParameter": {"test_net", "test_iter", "stepvalue"},
}

# ------------------------------------------------------------ wire format
#: field numbers in caffe.proto for what a .caffemodel's weights need
NET_LAYER, NET_LAYERS_V1 = 100, 2
LAYER_NAME, LAYER_TYPE, LAYER_BOTTOM, LAYER_TOP, LAYER_BLOBS = 1, 2, 3, 4, 7
V1_BOTTOM, V1_TOP, V1_NAME, V1_TYPE, V1_BLOBS = 2, 3, 4, 5, 6
# (BlobProto's and Datum's field numbers are in data/protowire.py)
