"""Streaming training data: webdataset tar shards, parquet shards and hub datasets (DESIGN 4, "Streams").

FLAIR and F-CAST pretrain on 3M-30M image-text pairs that live in shards, which a map-style dataset (a fingerprinted
cache, a length) does not fit. A recipe's ``data.train`` streams when it is

- ``{name: webdataset, urls: "shards/{00000..00099}.tar"}``: webdataset tar shards (``KEY.jpg`` / ``KEY.png`` ...
  beside ``KEY.txt`` or ``KEY.json``);
- ``{name: parquet, urls: "shards/train-{0000..0031}.parquet"}`` (or ``path`` + ``streaming: true``): parquet shards
  with an image column (bytes, ``{"bytes", "path"}`` structs or paths) and a caption column;
- ``{name: hub, path: org/dataset, split: train}``: a hub dataset (or a local dataset folder) whose data files are
  parquet or tar shards; ``options`` may give ``config``, ``revision`` and ``data_files``.

Urls may be local paths, ``s3://``, ``gs://``, ``https://`` (fsspec; ``pip install -e ".[remote]"``) or
``pipe:COMMAND`` (:mod:`~finetune.data.streams.urls`).

The modules, bottom up: :mod:`~finetune.data.streams.urls` (patterns, opening a shard), :mod:`.tar` (tar samples,
shards that end early), :mod:`.index` (sample counts per shard), :mod:`.plan` (each reader's share of an epoch, the
position, the re-split on another layout), :mod:`.columns` (raw sample -> example), :mod:`.source` (a stream opened,
read by position; recipe-time checks), :mod:`.reader` (:class:`ExampleStream`: one reader), :mod:`.loader`
(:class:`StreamLoader`: a process's batches, its position).

Who reads what: every epoch is split by samples over all readers (processes x data-loader workers), so that every
sample is read exactly once per epoch however uneven the shards, and a run resumed on another number of processes
or workers continues the epoch where it stood (:mod:`~finetune.data.streams.plan`).
"""

from finetune.data.sources import register_source
from finetune.data.spec import STREAM_SOURCES, SourceSpec
from finetune.data.images import DataError
from finetune.data.streams.columns import (STREAM_EXAMPLE_FIELDS, SUPERPIXELS_ENTRY, SUPERPIXELS_FIELD,
                                           WEBDATASET_IMAGE_KEYS, check_fields)
from finetune.data.streams.index import ShardIndex, build_index
from finetune.data.streams.loader import EPOCHS_KEY, STREAM_KEY, StreamCollate, StreamLoader
from finetune.data.streams.reader import ExampleStream
from finetune.data.streams.source import (ShardSet, check_stream_columns, check_stream_shards, open_stream,
                                          shard_layout)
from finetune.data.streams.urls import expand_urls

__all__ = [
    "EPOCHS_KEY",
    "STREAM_EXAMPLE_FIELDS",
    "STREAM_KEY",
    "STREAM_SOURCES",
    "SUPERPIXELS_ENTRY",
    "SUPERPIXELS_FIELD",
    "WEBDATASET_IMAGE_KEYS",
    "ExampleStream",
    "ShardIndex",
    "ShardSet",
    "StreamCollate",
    "StreamLoader",
    "build_index",
    "check_fields",
    "check_stream_columns",
    "check_stream_shards",
    "expand_urls",
    "open_stream",
    "shard_layout",
]


def _stream_only(spec: SourceSpec):
    raise DataError(
        f"data source {spec.name!r} is read as a stream and can only be data.train (with train.max_steps); "
        "evaluation sets are map-style sources")


register_source("webdataset", description="webdataset tar shards (urls with {00000..00099} ranges), streamed; "
                "data.train only")(_stream_only)
register_source("hub", description="a hub dataset id (or local dataset folder) streamed with datasets; "
                "data.train only")(_stream_only)
