"""The command line's argument parser (``build_parser``), split out of
purine_mpi/cli.py, which runs the commands.

Every option that names several things takes one value per use or a comma
list (``--init-skip fc2 --init-skip fc3``, ``--init-skip fc2,fc3``), so an
option never swallows the positional after it; a usage error shows the usage
of the command at fault, not the top-level one; under a launcher only rank 0
prints usage, help and usage errors (every rank exits with the same status).
"""
import argparse
import difflib
import os
import re
import sys

from . import __version__
from .comm.launcher import launched_rank


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors name the command at fault and
    whose output comes from one rank only."""

    def parse_args(self, args=None, namespace=None):
        # an unknown option is found by the top-level parser after its
        # subcommand's parser has run: reported with the subcommand's usage
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(self, "commands", {}).get(getattr(args, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extras)}")
        return args

    def error(self, message):
        """argparse's usage error, with "did you mean" for a mistyped choice
        (a command ``trian``, a ``--format dotx``), as a config key gets."""
        bad = re.search(r"invalid choice: (['\"]?)(.*?)\1 \(choose from (.*)\)$", message)
        if bad:
            choices = [c.strip(" '\"") for c in bad.group(3).split(",")]
            close = difflib.get_close_matches(bad.group(2), choices, n=1, cutoff=0.6)
            if close:
                message += f" (did you mean '{close[0]}'?)"
        super().error(message)

    def _print_message(self, message, file=None):
        if launched_rank() == 0:  # under mpiexec -n N: one usage, one help, not N
            super()._print_message(message, file)


class AppendList(argparse.Action):
    """A repeatable option of one value each, or a comma list: ``--init-skip
    fc2 --init-skip fc3`` and ``--init-skip fc2,fc3`` give ['fc2', 'fc3']."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = [v.strip() for v in values.split(",")]
        if not all(items):
            parser.error(f"argument {option_string}: an empty name in {values!r}")
        setattr(namespace, self.dest, list(getattr(namespace, self.dest) or []) + items)


def path_arg(value):
    """The ``type`` of an option that names a file or folder: an empty value
    (an unset shell variable, ``--resume "$CKPT"``) is a usage error, where
    it read as the option not given: a fresh run for ``--resume ''``, fresh
    weights for ``--init ''``, the default folder for ``--out ''``."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"an empty path {value!r} (an unset shell variable?); "
                                         "give the path, or leave the option out")
    return value


def _common_config_args(p, optional=False):
    if optional:
        p.add_argument("config", nargs="?", default=None,
                       help="job YAML (docs/config.md); default: the config the --weights "
                            "checkpoint holds")
    else:
        p.add_argument("config", help="job YAML (docs/config.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path, the value read as YAML, e.g. "
                        "solver.base_lr=0.05 or net.0.num_output=8 (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="random seed (overrides the config's "
                                                          "seed)")


def _memory_args(p, host_help):
    p.add_argument("--host-memory", metavar="SIZE", default=None,
                   help=host_help + "; e.g. 24GiB, 512MiB, 16GB")
    p.add_argument("--device-memory", metavar="SIZE", default=None,
                   help="the memory each rank may use on its GPU (default: the GPU's total, "
                        "where there is one); e.g. 80GiB")
    p.add_argument("--node-memory", metavar="SIZE", default=None,
                   help="the memory the ranks of a node may hold together on the host: their "
                        "needs summed are checked against it (default: the node's "
                        "MemAvailable, unless --host-memory gives each rank's); e.g. 256GiB")


#: the console script setup.cfg installs (``[options.entry_points]``)
CONSOLE_SCRIPT = "purine-mpi"


def program_name(argv0=None):
    """The name usage and help call the program by: the console script's
    own name when it runs (``purine-mpi --help``), else ``python -m
    purine_mpi``."""
    argv0 = sys.argv[0] if argv0 is None and sys.argv else argv0 or ""
    name = os.path.basename(argv0)
    return name if name == CONSOLE_SCRIPT else "python -m purine_mpi"


def build_parser():
    parser = Parser(
        prog=program_name(),
        description="purine_mpi: bi-graph deep learning on MPI clusters. Run any command under "
                    "mpiexec -n N (or srun) for N ranks. The job YAML is described in "
                    "docs/config.md, the files a run writes and the exit statuses in "
                    "docs/formats.md.",
        epilog="exit status: 0 success (or stopped by SIGUSR1 with a checkpoint), 1 runtime "
               "failure, 2 user error, 3 diverged or non-finite weights, 70 MPI could not "
               "start, 143 stopped by SIGTERM with a checkpoint, 129 by SIGHUP, 131 by "
               "SIGQUIT, 140 by SIGUSR2, 130 by Ctrl-C (each with a checkpoint), 141 stdout "
               "closed, 138 stopped by SIGUSR1 while MPI was starting (nothing written) "
               "(docs/formats.md)")
    parser.add_argument("--version", action="version", version=f"purine_mpi {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser,
                                help="run 'COMMAND --help' for its options")
    sub.required = True

    p = sub.add_parser("train", help="train a network from a job YAML")
    _common_config_args(p)
    p.add_argument("--out", type=path_arg, help="output folder (default: a new numbered folder "
                                 "runs/<name>/<N> for each run)")
    p.add_argument("--force", action="store_true",
                   help="start afresh in an --out that holds another run's files (they are "
                        "deleted)")
    p.add_argument("--iters", type=int, help="override solver.max_iter")
    p.add_argument("--resume", type=path_arg, metavar="CKPT.h5|auto",
                   help="continue from a checkpoint (auto: latest.h5 of --out, or of the "
                        "newest runs/<name>/<N>; a fresh run if there is none)")
    p.add_argument("--init", type=path_arg,
                   metavar="WEIGHTS.h5|MODEL.caffemodel|MODEL.safetensors",
                   help="initialise parameters from a file; every parameter of the net must "
                        "be in it, except those of the --init-skip layers; a Caffe .caffemodel "
                        "loads by layer name and reports which blobs matched; a .safetensors "
                        "file holds a GPT-2 in Hugging Face's layout (docs/transformers.md)")
    p.add_argument("--init-skip", action=AppendList, default=[], metavar="LAYER[,LAYER]",
                   help="with --init: a layer that keeps its fresh initialisation (fine-tuning "
                        "a changed layer); repeat it or give a comma list for several")
    p.add_argument("--profile", action="store_true",
                   help="write a Chrome trace per rank (OUT/trace.rank<R>.json, streamed as "
                        "the run goes; open it in Perfetto; async parameter servers write none)")
    p.add_argument("--profile-iters", metavar="A:B",
                   help="trace only iterations A to B-1 (implies --profile), e.g. 100:110")
    p.add_argument("--dispatcher", choices=["event", "serial"], default=None,
                   help="event-driven (default) or the serial reference dispatcher (runs every "
                        "op one at a time in a fixed order; bit-identical results)")
    _memory_args(p, "the memory this rank may use on the host, checked at start-up before "
                    "anything big is allocated (default: none per rank: the ranks on a node "
                    "are checked together against its MemAvailable or --node-memory; "
                    "python -m purine_mpi plan shows the figures)")
    p.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="skip the start-up check that the rank's planned bytes fit its memory")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to OUT/tb (rank 0; needs pip "
                        "install 'purine_mpi[tensorboard]')")

    p = sub.add_parser("test", help="evaluate saved weights on the config's test data")
    _common_config_args(p)
    p.add_argument("--weights", type=path_arg,
                   required=True, metavar="CKPT.h5|MODEL.caffemodel|RUN",
                   help="checkpoint to evaluate, a Caffe .caffemodel (loaded by layer name), "
                        "or a run folder (its latest.h5; runs/<name>: its newest numbered run's)")
    p.add_argument("--out", type=path_arg,
                   help="the run folder (default runs/<name>); nothing is written "
                                 "there: the result is printed as one JSON object")

    p = sub.add_parser("generate", help="print a prompt and a continuation drawn from a "
                                        "language model trained on a text source",
                       description="Print the prompt, then the tokens drawn after it as they "
                                   "are drawn (nanoGPT's sample.py). Only the weights are read: "
                                   "CONFIG may be left out (the checkpoint holds its config), "
                                   "and the training data file is not needed.")
    _common_config_args(p, optional=True)
    p.add_argument("--weights", type=path_arg, required=True, metavar="CKPT.h5|RUN",
                   help="a checkpoint train wrote, or a run folder (its latest.h5; "
                        "runs/<name>: its newest numbered run's)")
    p.add_argument("--prompt", required=True, metavar="TEXT",
                   help="the text to continue (its UTF-8 bytes are the first tokens, or its ids "
                        "in the vocabulary the checkpoint keeps)")
    p.add_argument("--no-prompt", action="store_true",
                   help="print the continuation alone, without the prompt before it")
    p.add_argument("--tokens", type=int, required=True, metavar="N",
                   help="how many tokens to draw (bytes, or the checkpoint's vocabulary's ids)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="divide the scores by T before the softmax (0: always the most "
                        "likely token; default 1)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="draw among the K most likely tokens only (default: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="then draw among the fewest most likely tokens whose probabilities "
                        "sum to P or more only (nucleus sampling, 0 < P <= 1; default: all)")

    p = sub.add_parser("graph", help="print a rank's slice of the composed graph")
    _common_config_args(p)
    p.add_argument("--np", type=int, default=None,
                   help="number of ranks to compose for (the text format then ends with "
                        "the data-parallel bucket plan and the deferred tail)")
    p.add_argument("--rank", type=int, default=0, help="which rank's slice to print (default 0)")
    p.add_argument("--format", choices=["text", "yaml", "dot"], default="text",
                   help="text: one line per op (default); yaml: the graph: list of "
                        "docs/config.md, loadable as a config (with --np N > 1: rank R's "
                        "slice, which is not a config of the N-rank run; a note on stderr "
                        "says so); dot: Graphviz")
    p.add_argument("--phase", choices=["train", "test"], default="train",
                   help="the training graph with backward and solver ops (default), or the "
                        "test graph")
    p.add_argument("--memory", action="store_true",
                   help="text format: end with the host memory plan (memory_plan): each "
                        "planned blob's offset in the arena, size and lifetime, then the blobs "
                        "that keep their own memory and why")

    p = sub.add_parser("plan", help="every byte each rank will hold (weights, gradients, "
                                    "optimizer state, activations at their peak, buffers) and "
                                    "whether it fits, without running an iteration")
    _common_config_args(p)
    p.add_argument("--np", type=int, default=1, metavar="N",
                   help="number of ranks to plan for (default 1, at most 1048576); the "
                        "ranks alike are printed once, with their count")
    _memory_args(p, "the memory each rank may use on the host, each rank checked against it "
                    "(default: none per rank: the ranks of a node, K at a time in rank "
                    "order, are checked together against this host's MemAvailable now or "
                    "--node-memory)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object instead of the table (keys: docs/formats.md)")
    p.add_argument("--ranks-per-node", default=None, metavar="K",
                   help="the ranks that share a node, placed in blocks (node i: ranks "
                        "i*K .. i*K+K-1): their host needs summed are checked against the "
                        "node's memory (default: the launcher's count of the ranks on this "
                        "node, e.g. SLURM_NTASKS_PER_NODE, else N); with --choose and a "
                        "--network file that measured ranks sharing a host, also the K of "
                        "predict --ranks-per-node's correction of each setting's time "
                        "(default there: the file's calibration's ranks per host, as predict)")
    p.add_argument("--resume", action="store_true",
                   help="count a --resume of this job's checkpoint: train reads it whole on "
                        "every rank before the first iteration (the start-up load)")
    p.add_argument("--init", type=path_arg,
                   metavar="W.h5|MODEL.caffemodel|MODEL.safetensors", default=None,
                   help="count train's --init of this file: what loading it holds on every "
                        "rank before the first iteration (the start-up load: an HDF5 file's "
                        "/params; a .caffemodel read whole and its blobs; a .safetensors "
                        "file's arrays and the copies GPT-2's layout makes)")
    c = p.add_argument_group("choosing a setting (plan --np N --choose; docs/scaling.md)")
    c.add_argument("--choose", action="store_true",
                   help="rank the settings of N ranks (data parallel, sharded, pipeline "
                        "stages and micro-batches, tensor parallel, tensor within pipeline "
                        "stages; recompute) by predicted time per iteration, from two "
                        "short measured runs of the job on one rank; print the table and "
                        "the best as --set options. A data or sharded "
                        "setting's micro-batch counts are walked up to the first that fits "
                        "and one more, the check: a time per sample that falls again further "
                        "up, past a rise, is seen by --choose-all only (a deliberate "
                        "trade-off: the model's time per sample grew with the count in every "
                        "case measured, and every count costs several times as long; "
                        "docs/scaling.md)")
    c.add_argument("--choose-all", action="store_true",
                   help="--choose with every micro-batch count of every setting evaluated "
                        "(--choose leaves out the counts above the first that fits and "
                        "the one after it, where that one is predicted no faster, listed "
                        "under --json's not_tried; a fall past a rise further up is found "
                        "here only): several times slower, to confirm --choose's best")
    c.add_argument("--calibration", type=path_arg, metavar="FILE.json",
                   help="--choose: the op times measured once, read from FILE.json when it "
                        "holds this job's, else measured and written there (default: "
                        "runs/<name>/calibration.json)")
    c.add_argument("--network", type=path_arg, metavar="LINK.json",
                   help="--choose: the link model, a predict --calibrate file (default: "
                        "100 Gbit/s InfiniBand, docs/scaling.md)")
    c.add_argument("--bandwidth", metavar="RATE",
                   help="--choose: link bandwidth, e.g. 10gbit (replaces --network's)")
    c.add_argument("--latency", metavar="TIME",
                   help="--choose: link latency, e.g. 5us (replaces --network's)")
    c.add_argument("--out", type=path_arg, metavar="BEST.yaml",
                   help="--choose: write the job with the best setting there (it trains as "
                        "it is; its first lines give the setting as --set options)")

    p = sub.add_parser("inspect", help="list a checkpoint's datasets with statistics")
    p.add_argument("checkpoint", metavar="CKPT.h5",
                   help="a checkpoint or any HDF5 file (layout: docs/formats.md)")
    p.add_argument("--diff", type=path_arg, metavar="OTHER.h5",
                   help="compare with another file: max abs and relative L2 difference per "
                        "dataset")
    p.add_argument("--json", action="store_true",
                   help="one JSON object instead of a table (docs/formats.md)")

    p = sub.add_parser("data", help="prepare a data set as HDF5")
    p.add_argument("dataset", choices=["digits", "cifar10", "lmdb-to-h5", "text"],
                   help="digits: scikit-learn's 8x8 digits (no download); cifar10: the "
                        "CIFAR-10 python batches given by --from, or fetched by --download; "
                        "lmdb-to-h5: a Caffe LMDB (--from, the train split; --test-from, the "
                        "test split) as our HDF5 layout; text: UTF-8 text (--from a file or a "
                        "folder) as byte-level tokens, or with --tokenizer/--bpe-vocab "
                        "subword tokens (groups train and val)")
    p.add_argument("--out", type=path_arg, required=True, metavar="PATH.h5",
                   help="the HDF5 data file to write (groups train and test; text: train and "
                        "val)")
    p.add_argument("--force", action="store_true",
                   help="replace an --out file that holds something else than a data file "
                        "(predictions, HDF5 of another kind, a file that is not HDF5; never a "
                        "checkpoint): refused otherwise")
    p.add_argument("--from", type=path_arg, dest="source", metavar="PATH",
                   help="cifar10: cifar-10-python.tar.gz, its folder, or the folder of the "
                        "python-pickle batches (with --download: where the archive is fetched "
                        "and unpacked); lmdb-to-h5: the train split's LMDB folder; text: a "
                        "UTF-8 file or a folder of them (read in sorted order)")
    p.add_argument("--glob", metavar="PATTERN",
                   help="text: the files of the --from folder to read, e.g. '*.py' (a pattern "
                        "without '/' matches file names at any depth; default: every file)")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="text: the last F of the token stream is the validation split "
                        "(default 0.1)")
    p.add_argument("--tokenizer", type=path_arg, metavar="TOKENIZER.json",
                   help="text: encode with this Hugging Face tokenizer file (e.g. GPT-2's "
                        "tokenizer.json) instead of bytes; the file keeps its JSON (needs "
                        "pip install 'purine_mpi[text]')")
    p.add_argument("--bpe-vocab", type=int, metavar="N",
                   help="text: train a byte-level BPE of N tokens (>= 256) on the text and "
                        "encode with it; the file keeps it (needs pip install "
                        "'purine_mpi[text]')")
    p.add_argument("--test-from", type=path_arg, dest="test_source", metavar="DIR",
                   help="lmdb-to-h5: the test split's LMDB folder")
    p.add_argument("--download", action="store_true",
                   help="cifar10: fetch the official archive (cifar-10-python.tar.gz), verify "
                        "its MD5 and unpack it (into --from DIR, default beside --out) first; "
                        "an archive already there with the right MD5 is reused")

    p = sub.add_parser(
        "predict", help="per-sample outputs of a data split to HDF5 (predict CONFIG --weights W "
                        "--out P.h5), or the time per iteration on N ranks from a run's traces "
                        "(predict TRACE_DIR --np N)",
        description="Two forms. predict CONFIG --weights W.h5 --out PREDS.h5: write per-sample "
                    "outputs of a data split (as Caffe's extract_features). predict TRACE_DIR "
                    "--np N[,N...]: predict the iteration time, its compute and communication, "
                    "and the scaling efficiency on N ranks from the trace.rank<R>.json files "
                    "of a run (train --profile-iters A:B) and a link model; mpiexec -n 2 ... "
                    "predict --calibrate LINK.json measures the link for --link.")
    p.add_argument("config", nargs="?", metavar="CONFIG|TRACE_DIR",
                   help="job YAML (docs/config.md) for the outputs; a run folder with "
                        "trace.rank<R>.json and config.yaml for --np")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="outputs: override a config key by dotted path (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="outputs: random seed")
    p.add_argument("--weights", type=path_arg, metavar="W.h5",
                   help="outputs: checkpoint or weights file (HDF5 /params, or a .caffemodel), "
                        "or a run folder (its latest.h5; runs/<name>: its newest numbered run's)")
    p.add_argument("--out", type=path_arg, metavar="PREDS.h5",
                   help="outputs: the HDF5 file to write: /outputs/<blob>, /label, /index "
                        "(docs/formats.md)")
    p.add_argument("--force", action="store_true",
                   help="outputs: replace an --out file that holds something else than "
                        "predictions (a data file, HDF5 of another kind, a file that is not "
                        "HDF5; never a checkpoint): refused otherwise")
    p.add_argument("--blob", dest="blobs", action="append", default=[], metavar="NAME",
                   help="outputs: a blob to write per sample (repeatable; default: the net's "
                        "last output, the scores its loss reads)")
    p.add_argument("--split", choices=["test", "train"], default="test",
                   help="outputs: which data of the config to run over, in file order "
                        "(default: test)")
    from .tools.scaling.command import add_arguments
    add_arguments(p)

    p = sub.add_parser("bench", help="time training iterations (JSON with --json)")
    _common_config_args(p)
    p.add_argument("--iters", type=int, default=20,
                   help="timed iterations, after the warm-up (default 20)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed iterations first (default 3)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (keys: docs/formats.md)")
    p.add_argument("--real-data", action="store_true",
                   help="use the config's data instead of synthetic data of the same shapes")
    p.add_argument("--dispatcher", choices=["event", "serial"], default=None,
                   help="event-driven (default) or the serial reference dispatcher")

    p = sub.add_parser("plot", help="draw loss, accuracy, lr and images/s of runs into an "
                                    "image (needs pip install 'purine_mpi[plot]')")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="a run folder, its metrics.jsonl, or runs/<name> (its newest "
                        "numbered run); several are overlaid")
    p.add_argument("--out", type=path_arg, default="curves.png", metavar="IMAGE",
                   help="the image to write; the format follows the extension (.png, .pdf, "
                        ".svg; default curves.png)")
    p.add_argument("--loss-scale", choices=["auto", "log", "linear"], default="auto",
                   help="the loss axis: auto (default) is log when every loss is positive and "
                        "they span more than a factor of 10, else linear")

    p = sub.add_parser("convert", help="convert another framework's model into a job YAML")
    p.add_argument("format", choices=["caffe"], help="the source format")
    p.add_argument("net", metavar="NET.prototxt", help="Caffe net definition (text format)")
    p.add_argument("--solver", type=path_arg, metavar="SOLVER.prototxt",
                   help="Caffe solver (text format): becomes the solver and checkpoint sections")
    p.add_argument("--data", type=path_arg, metavar="DATA.h5",
                   help="our HDF5 data file (groups train/test) that the net's data layers read")
    p.add_argument("--out", type=path_arg,
                   required=True, metavar="JOB.yaml", help="the job YAML to write")

    p = sub.add_parser("export", help="export a trained net's inference graph (onnx) or a "
                                      "GPT's weights as a Hugging Face GPT-2 (hf)")
    p.add_argument("format", choices=["onnx", "hf"],
                   help="onnx: an ONNX model; hf: a folder of model.safetensors and "
                        "config.json that transformers' GPT2LMHeadModel loads")
    p.add_argument("config", help="job YAML (docs/config.md); its test phase is exported")
    p.add_argument("--weights", type=path_arg, required=True, metavar="CKPT.h5",
                   help="checkpoint or weights file (/params layout) with every parameter, "
                        "or a run folder (its latest.h5), or runs/<name> (its newest "
                        "numbered run's)")
    p.add_argument("--out", type=path_arg, required=True, metavar="MODEL.onnx|DIR",
                   help="the ONNX file to write (onnx), or the model folder (hf)")
    p.add_argument("--batch", type=int, default=None,
                   help="onnx: fixed batch size of the model input (default: a symbolic "
                        "batch dim)")
    p.add_argument("--raw-input", action=argparse.BooleanOptionalAction, default=True,
                   help="the model takes samples as the data file holds them and applies the "
                        "test spec's transform (centre crop, mean, scale) as ONNX ops "
                        "(default); --no-raw-input: it takes the transformed batch")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path, e.g. net.0.num_output=8")
    p.set_defaults(seed=None)

    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true",
                       help="print the full Python traceback of a runtime failure (by default "
                            "each failing rank prints one line)")
    parser.commands = dict(sub.choices)
    return parser


