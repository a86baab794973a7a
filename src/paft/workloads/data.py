"""Offline datasets for the paft workloads, and the sampler that shards them across ranks.

Everything here reads files shipped inside the package (``paft/data/``); nothing is
ever downloaded. Two corpora:

* Tiny Shakespeare, character level: the vocabulary is the sorted set of characters
  in the file (65 of them), the first 90% of the text (by position) is the train split
  and the last 10% the val split. Item ``i`` of a split is the ``i``-th
  non-overlapping window of ``block_size + 1`` characters; its inputs are
  ``window[:-1]`` and its targets ``window[1:]``.
* MNIST's 10k test set (IDX format): the first 8000 images train, the last 2000 are
  held out for validation. Images are float32, normalized with the usual MNIST
  mean/std, shape ``(N, 1, 28, 28)``; labels are int64.

Datasets are in-memory tensors and batches are gathered with one vectorized index
(``Dataset.get(indices)``), which is both faster and easier to make deterministic
than a ``DataLoader`` with workers. Parsed files are cached per process
(``functools.cache``), so building a workload twice costs nothing; the cached
tensors are shared and must be treated as read-only.

:class:`ShardedSampler` is a seeded, infinite, resumable ``DistributedSampler``
analogue that yields index batches; with ``desync=True`` it reproduces the
"desynchronized shuffling" bug where ranks shuffle independently.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import struct
import sys
import zlib
from collections.abc import Iterator
from importlib import resources
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:  # importlib.abc.Traversable is deprecated; resources.abc is 3.11+
    from typing import TypeAlias

    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

    PathLike: TypeAlias = str | os.PathLike[str] | Traversable

__all__ = [
    "Dataset",
    "ArrayDataset",
    "TokenDataset",
    "CharVocab",
    "ShardedSampler",
    "load_shakespeare",
    "shakespeare_datasets",
    "read_idx",
    "load_mnist",
    "mnist_datasets",
    "MNIST_MEAN",
    "MNIST_STD",
    "SHAKESPEARE_FILE",
    "MNIST_IMAGES_FILE",
    "MNIST_LABELS_FILE",
    "MNIST_TRAIN_SIZE",
    "DataFileError",
]

SHAKESPEARE_FILE = "tinyshakespeare.txt"
MNIST_IMAGES_FILE = "mnist-t10k-images-idx3-ubyte.gz"
MNIST_LABELS_FILE = "mnist-t10k-labels-idx1-ubyte.gz"
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
MNIST_TRAIN_SIZE = 8000  # of the 10k test-set images; the remaining 2000 are val

# IDX magic numbers: 0x0000 then the dtype code (0x08 = uint8) then the number of dims.
_IDX_IMAGES_MAGIC = 0x00000803
_IDX_LABELS_MAGIC = 0x00000801


class DataFileError(ValueError):
    """A data file shipped inside the package is missing or damaged: a broken
    installation, which no option fixes (the message says to reinstall paft)."""


def _data_file(name: str) -> Traversable:
    return resources.files("paft") / "data" / name


def _damaged(name: str, problem: str) -> DataFileError:
    return DataFileError(f"paft's data file {_data_file(name)} {problem}; the installation is damaged: "
                         "reinstall paft")


def _read_bytes(src: PathLike) -> bytes:
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            return f.read()
    return src.read_bytes()


# --------------------------------------------------------------------------- protocol


@runtime_checkable
class Dataset(Protocol):
    """What the trainer needs from a dataset: a length and batched, indexed access."""

    def __len__(self) -> int: ...

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the ``(inputs, targets)`` batch for the given item indices."""
        ...


class ArrayDataset:
    """Items are rows of two aligned tensors (e.g. images and labels)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"inputs and targets disagree on the item count: "
                f"{inputs.shape[0]} != {targets.shape[0]}"
            )
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]


class TokenDataset:
    """Language-model items: non-overlapping ``block_size + 1`` windows of a token stream.

    Item ``i`` covers ``tokens[i*(block_size+1) : (i+1)*(block_size+1)]``; the batch
    for it is ``(window[:-1], window[1:])``, so targets are inputs shifted by one.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if tokens.numel() < block_size + 1:
            raise ValueError(
                f"block_size {block_size} needs at least {block_size + 1} tokens, "
                f"got {tokens.numel()}"
            )
        self.tokens = tokens
        self.block_size = block_size
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return self.tokens.numel() // (self.block_size + 1)

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = indices.long() * (self.block_size + 1)
        windows = self.tokens[starts.unsqueeze(1) + self._offsets]  # (B, block_size+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# --------------------------------------------------------------------- shakespeare


class CharVocab:
    """Character-level tokenizer: token id = rank of the character in sorted order."""

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars) or list(chars) != sorted(chars):
            raise ValueError("chars must be sorted and unique")
        self.chars = chars
        codes = np.array([ord(c) for c in chars], dtype=np.int64)
        # Lookup table codepoint -> id; -1 marks characters outside the vocabulary.
        self._lut = np.full(int(codes.max()) + 1 if len(codes) else 1, -1, dtype=np.int64)
        self._lut[codes] = np.arange(len(chars))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Vectorized: decode to codepoints once, then one table lookup."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = self._lut[np.minimum(codes, len(self._lut) - 1)]
        bad = (codes >= len(self._lut)) | (ids < 0)
        if bad.any():
            ch = chr(int(codes[np.argmax(bad)]))
            raise ValueError(f"character {ch!r} is not in the vocabulary")
        return torch.from_numpy(ids)

    def decode(self, ids: torch.Tensor) -> str:
        values = ids.tolist()
        # Checked, as encode checks its characters: a negative id indexed the string from
        # its end (-1 read 'z'), and one of a model wider than the data (--model
        # vocab_size=100) failed as a bare IndexError.
        bad = [i for i in values if not 0 <= i < len(self.chars)]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in the vocabulary (ids 0 to {len(self.chars) - 1})")
        return "".join(self.chars[i] for i in values)


@functools.cache
def load_shakespeare() -> tuple[torch.Tensor, CharVocab]:
    """The whole Tiny Shakespeare text as an int64 token tensor, and its vocabulary."""
    try:
        text = _data_file(SHAKESPEARE_FILE).read_bytes().decode("utf-8")
    except OSError as err:
        raise _damaged(SHAKESPEARE_FILE, f"cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise _damaged(SHAKESPEARE_FILE, f"is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text:
        raise _damaged(SHAKESPEARE_FILE, "is empty")
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = CharVocab("".join(chr(c) for c in np.unique(codes).tolist()))
    return vocab.encode(text), vocab


def shakespeare_datasets(block_size: int = 64) -> tuple[TokenDataset, TokenDataset, CharVocab]:
    """``(train, val, vocab)``: the first 90% of the characters train, the last 10% val."""
    tokens, vocab = load_shakespeare()
    n_train = int(0.9 * tokens.numel())
    val = tokens.numel() - n_train
    if block_size >= val:  # the smaller split bounds it: say which (1.1 M characters in all)
        raise ValueError(f"block_size {block_size} must be below {val}, the characters of the validation "
                         "split (the last 10% of Tiny Shakespeare)")
    return (
        TokenDataset(tokens[:n_train], block_size),
        TokenDataset(tokens[n_train:], block_size),
        vocab,
    )


# --------------------------------------------------------------------------- MNIST


def read_idx(src: PathLike, expected_magic: int) -> torch.Tensor:
    """Parse an IDX file (optionally gzipped) of uint8 values into a uint8 tensor.

    Validates the magic number, the header length and that the payload size matches
    the dimensions in the header; any problem raises ``ValueError`` naming the file.
    """
    name = os.fspath(src) if isinstance(src, (str, os.PathLike)) else str(src)
    raw = _read_bytes(src)
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # a damaged body: zlib's error, not OSError
            raise ValueError(f"{name}: corrupt gzip stream ({e})") from e
    if len(raw) < 4:
        raise ValueError(f"{name}: too short for an IDX header ({len(raw)} bytes)")
    (magic,) = struct.unpack(">I", raw[:4])
    if magic != expected_magic:
        raise ValueError(
            f"{name}: bad IDX magic number 0x{magic:08x}, expected 0x{expected_magic:08x}"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{name}: truncated IDX header ({len(raw)} < {header} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + int(np.prod(dims, dtype=np.int64))
    if len(raw) != expected:
        raise ValueError(
            f"{name}: IDX size mismatch: header says dims {dims} -> {expected} bytes, "
            f"file has {len(raw)}"
        )
    arr = np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)
    return torch.from_numpy(arr.copy())


def _load_mnist_from(images_src: PathLike, labels_src: PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    images = read_idx(images_src, _IDX_IMAGES_MAGIC)
    labels = read_idx(labels_src, _IDX_LABELS_MAGIC)
    if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28):
        raise ValueError(f"{images_src}: expected 28x28 images, got dims {tuple(images.shape)}")
    if labels.dim() != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(
            f"{labels_src}: {labels.shape[0]} labels for {images.shape[0]} images in {images_src}"
        )
    if labels.numel() == 0:
        raise ValueError(f"{labels_src}: no labels (an empty IDX file)")
    if int(labels.max()) > 9:
        raise ValueError(f"{labels_src}: label {int(labels.max())} outside 0..9")
    x = (images.to(torch.float32).div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)).unsqueeze(1)
    return x, labels.to(torch.int64)


@functools.cache
def load_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """All 10k images ``(10000, 1, 28, 28)`` float32 (normalized) and int64 labels."""
    try:
        x, y = _load_mnist_from(_data_file(MNIST_IMAGES_FILE), _data_file(MNIST_LABELS_FILE))
    except OSError as err:
        name = os.path.basename(err.filename) if err.filename else MNIST_IMAGES_FILE
        raise _damaged(name, f"cannot be read ({err.strerror or err})") from None
    except ValueError as err:  # read_idx's message names the file
        raise DataFileError(f"{err}; paft's data files are damaged: reinstall paft") from None
    if len(x) <= MNIST_TRAIN_SIZE:  # the split needs a validation image
        raise _damaged(MNIST_IMAGES_FILE, f"holds {len(x)} images; paft needs more than {MNIST_TRAIN_SIZE} "
                       f"({MNIST_TRAIN_SIZE} to train on, the rest to validate on)")
    return x, y


def mnist_datasets() -> tuple[ArrayDataset, ArrayDataset]:
    """``(train, val)``: the first 8000 images train, the last 2000 are held out."""
    x, y = load_mnist()
    n = MNIST_TRAIN_SIZE
    return ArrayDataset(x[:n], y[:n]), ArrayDataset(x[n:], y[n:])


# ------------------------------------------------------------------------- sampler


class ShardedSampler:
    """Seeded, infinite, resumable sharding of ``range(num_items)`` into per-rank batches.

    Each epoch ``e`` all ranks draw the same permutation from a generator seeded with
    ``seed`` in epoch 0 and a 32-bit hash of ``(seed, e)`` after it (or ``arange`` when
    ``shuffle=False``), drop the tail so it splits into
    ``world_size * batch_size * batches_per_epoch`` items, and rank ``r`` takes the
    strided shard ``perm[r::world_size]``: shards are disjoint and every rank gets the
    same number of full batches. ``batch_size`` is per rank.

    ``desync=True`` reproduces desynchronized shuffling: each rank permutes with its own
    seed ``seed + 1000003 * rank`` (hashed with the epoch, as above) and then takes its strided shard, so ranks'
    data overlap and are no longer coordinated. (Without ``shuffle`` it changes nothing.)

    Iteration never ends: after the last batch of an epoch the next epoch starts.
    ``__iter__`` and :meth:`next_batch` advance the same state, which
    :meth:`state_dict` captures as ``{"epoch", "position"}`` (batches already taken in
    that epoch); loading it resumes with exactly the same following batches.
    """

    def __init__(
        self,
        num_items: int,
        rank: int,
        world_size: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        desync: bool = False,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_items < world_size * batch_size:
            raise ValueError(
                f"num_items {num_items} is smaller than one global batch "
                f"(world_size {world_size} x batch_size {batch_size})"
            )
        self.num_items = num_items
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.desync = desync
        self.batches_per_epoch = num_items // (world_size * batch_size)
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's item order for ``epoch`` (length ``batches_per_epoch * batch_size``)."""
        if self.shuffle:
            seed = self.seed + (1000003 * self.rank if self.desync else 0)
            if epoch:  # a hash, not seed + epoch, which would make seed s + 1's first epoch seed s's second
                seed = int.from_bytes(hashlib.blake2b(f"{seed}/{epoch}".encode(), digest_size=4).digest(), "little")
            g = torch.Generator().manual_seed(seed)
            perm = torch.randperm(self.num_items, generator=g)
        else:
            perm = torch.arange(self.num_items)
        used = self.batches_per_epoch * self.batch_size * self.world_size
        return perm[:used][self.rank :: self.world_size].clone()

    def next_batch(self) -> torch.Tensor:
        """The next LongTensor of ``batch_size`` item indices for this rank."""
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        if self._order_epoch != self.epoch:
            self._order = self._epoch_order(self.epoch)
            self._order_epoch = self.epoch
        start = self.position * self.batch_size
        self.position += 1
        # A copy, so a caller that edits its batch in place cannot alter what a rewind of
        # this epoch (load_state_dict, then a recompute) reads again.
        return self._order[start : start + self.batch_size].clone()

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= position <= self.batches_per_epoch:
            raise ValueError(
                f"position must be in [0, {self.batches_per_epoch}], got {position}"
            )
        self.epoch, self.position = epoch, position
