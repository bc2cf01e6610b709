"""Models in and out: Caffe prototxt / solver / .caffemodel import, ONNX export,
GPT-2 in Hugging Face's layout (safetensors) both ways.

    prototxt.py       protobuf text format: tokenizer + recursive-descent parser
    caffe_schema.py   the caffe.proto subset read (text) and field numbers (wire)
    caffe_convert.py  Caffe net + solver -> our job config (structure checks, data layers)
    caffe_layers.py   one handler per Caffe layer type
    caffe_solver.py   SolverParameter -> solver and checkpoint sections
    caffemodel.py     .caffemodel (protobuf wire format) -> our parameters
    onnx_export.py    the test-phase graph -> an ONNX model
    hf_gpt2.py        a GPT <-> GPT-2's model.safetensors + config.json (--init, export hf)
"""
