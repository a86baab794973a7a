"""Tests for paft.workloads.data: the real shipped files, the IDX parser, the sampler."""

from __future__ import annotations

import gzip
import hashlib
import struct
from importlib import resources
from pathlib import Path

import pytest
import torch

from paft.workloads.data import (
    MNIST_IMAGES_FILE,
    MNIST_LABELS_FILE,
    MNIST_MEAN,
    MNIST_STD,
    SHAKESPEARE_FILE,
    ArrayDataset,
    CharVocab,
    DataFileError,
    Dataset,
    ShardedSampler,
    TokenDataset,
    _load_mnist_from,
    load_mnist,
    load_shakespeare,
    mnist_datasets,
    read_idx,
    shakespeare_datasets,
)

# ----------------------------------------------------------------- shakespeare


def test_shakespeare_vocab_and_split_sizes() -> None:
    tokens, vocab = load_shakespeare()
    assert len(vocab) == 65
    assert vocab.chars == "".join(sorted(set(vocab.chars)))
    assert tokens.dtype == torch.int64 and tokens.numel() == 1_115_394
    assert int(tokens.min()) == 0 and int(tokens.max()) == 64
    train, val, _ = shakespeare_datasets(block_size=64)
    n_train = int(0.9 * tokens.numel())
    assert torch.equal(train.tokens, tokens[:n_train])
    assert torch.equal(val.tokens, tokens[n_train:])
    assert train.tokens.numel() + val.tokens.numel() == tokens.numel()
    assert len(train) == n_train // 65 and len(val) == (tokens.numel() - n_train) // 65
    assert isinstance(train, Dataset) and isinstance(val, Dataset)


def test_shakespeare_round_trip_decode() -> None:
    tokens, vocab = load_shakespeare()
    text = (resources.files("paft") / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    assert vocab.decode(tokens[:200]) == text[:200]
    assert text.startswith("First Citizen:")
    assert torch.equal(vocab.encode(text[-500:]), tokens[-500:])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        vocab.encode("caf\u00e9")
    # '#' lies below the vocabulary's largest codepoint ('z') but is not in it: its table
    # slot is -1, which must be refused too (a mutant that checked only the range let
    # it through as token -1).
    assert "#" not in vocab.chars and ord("#") < ord(vocab.chars[-1])
    with pytest.raises(ValueError, match="'#' is not in the vocabulary"):
        vocab.encode("a#b")
    # '{' is the codepoint right after the largest one ('z'): past the table's end, not
    # clamped onto its last slot (a mutant that refused only codepoints beyond it read 'z').
    assert ord("{") == ord(vocab.chars[-1]) + 1
    with pytest.raises(ValueError, match="'{' is not in the vocabulary"):
        vocab.encode("a{")
    # Ids outside the vocabulary are refused by decode too: -1 is no character (it read
    # the last one, 'z'), nor is 65 (a model with --model vocab_size=100 can emit it).
    for bad in (-1, len(vocab)):
        with pytest.raises(ValueError, match=f"token id {bad} is not in the vocabulary"):
            vocab.decode(torch.tensor([0, bad]))


def test_token_windows_shift_by_one_and_do_not_overlap() -> None:
    train, _, _ = shakespeare_datasets(block_size=8)
    idx = torch.tensor([0, 1, 5])
    x, y = train.get(idx)
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, i in enumerate(idx.tolist()):
        window = train.tokens[i * 9 : (i + 1) * 9]
        assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])
    # Item 1 starts right after item 0's window ends: non-overlapping windows.
    assert torch.equal(x[1, 0], train.tokens[9])


def test_cached_loaders_return_the_same_objects() -> None:
    assert load_shakespeare()[0] is load_shakespeare()[0]
    assert load_mnist()[0] is load_mnist()[0]


def test_char_vocab_rejects_unsorted() -> None:
    with pytest.raises(ValueError):
        CharVocab("ba")
    # Sorted but repeated: two ids would name one character (decode(0) != decode(1)).
    with pytest.raises(ValueError, match="unique"):
        CharVocab("aab")


def test_shakespeare_block_size_bound_is_the_validation_split() -> None:
    tokens, _ = load_shakespeare()
    val_chars = tokens.numel() - int(0.9 * tokens.numel())
    _, val, _ = shakespeare_datasets(block_size=val_chars - 1)
    assert len(val) == 1  # the largest block_size still leaves one validation window
    with pytest.raises(ValueError, match=f"must be below {val_chars}, the characters of the validation split"):
        shakespeare_datasets(block_size=val_chars)


@pytest.mark.parametrize("content, problem", [
    (None, r"cannot be read \(No such file or directory\)"),
    (b"First Citizen:\n\xff\xfe", "is not UTF-8 text"),  # was blamed on --model
    (b"", "is empty"),  # was "block_size 64 must be below 0"
])
def test_a_damaged_shakespeare_file_says_so(data_dir: Path, content: bytes | None, problem: str) -> None:
    if content is not None:
        (data_dir / SHAKESPEARE_FILE).write_bytes(content)
    with pytest.raises(DataFileError, match=f"{SHAKESPEARE_FILE} {problem}.*reinstall paft"):
        shakespeare_datasets()


# ----------------------------------------------------------------------- MNIST


def test_mnist_shapes_and_labels() -> None:
    x, y = load_mnist()
    assert x.shape == (10000, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (10000,) and y.dtype == torch.int64
    assert set(y.tolist()) == set(range(10))
    # Normalized with MNIST mean/std: background pixels map to -mean/std.
    assert abs(float(x.min()) - (-0.1307 / 0.3081)) < 1e-5
    assert abs(float(x.mean())) < 0.1 and 0.8 < float(x.std()) < 1.2
    train, val = mnist_datasets()
    assert len(train) == 8000 and len(val) == 2000
    assert torch.equal(val.inputs, x[8000:]) and torch.equal(train.targets, y[:8000])
    assert set(val.targets.tolist()) == set(range(10))
    xb, yb = val.get(torch.tensor([0, 1999]))
    assert xb.shape == (2, 1, 28, 28) and torch.equal(yb, y[[8000, 9999]])


def _idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return struct.pack(f">I{len(dims)}I", magic, *dims) + payload


def test_read_idx_valid_plain_and_gzip(tmp_path: Path) -> None:
    data = _idx_bytes(0x801, (3,), bytes([1, 2, 3]))
    (tmp_path / "l.idx").write_bytes(data)
    (tmp_path / "l.idx.gz").write_bytes(gzip.compress(data))
    for p in ("l.idx", "l.idx.gz"):
        assert torch.equal(read_idx(tmp_path / p, 0x801), torch.tensor([1, 2, 3], dtype=torch.uint8))


@pytest.mark.parametrize(
    "content, message",
    [
        (_idx_bytes(0x801, (10,), bytes(10)), "bad IDX magic"),  # labels file as images
        (_idx_bytes(0x803, (2, 28, 28), bytes(100)), "size mismatch"),  # truncated payload
        (_idx_bytes(0x803, (1, 28, 28), bytes(785)), "size mismatch"),  # a trailing byte
        (_idx_bytes(0x804, (1, 1, 1, 1), bytes(1)), "bad IDX magic"),  # above the expected too
        (struct.pack(">I", 0x803) + b"\x00\x00", "truncated IDX header"),
        (b"\x00", "too short"),
        (b"\x00\x00\x08", "too short"),  # 3 bytes: struct's error, not the file's name, before
    ],
)
def test_read_idx_rejects_corrupt_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad-images.gz"
    path.write_bytes(gzip.compress(content))
    with pytest.raises(ValueError, match=message) as err:
        read_idx(path, 0x803)
    assert "bad-images.gz" in str(err.value)


@pytest.mark.parametrize(
    "images, labels, message",
    [
        ((2, 28, 28), bytes([3, 10]), "label 10 outside 0..9"),
        ((2, 28, 28), bytes([3, 4, 5]), "3 labels for 2 images"),
        ((2, 28, 27), bytes([3, 4]), "expected 28x28 images"),
        ((0, 28, 28), b"", "no labels"),  # labels.max() of none raised RuntimeError
    ],
)
def test_load_mnist_refuses_files_that_disagree(
    tmp_path: Path, images: tuple[int, int, int], labels: bytes, message: str
) -> None:
    (tmp_path / "i").write_bytes(_idx_bytes(0x803, images, bytes(images[0] * images[1] * images[2])))
    (tmp_path / "l").write_bytes(_idx_bytes(0x801, (len(labels),), labels))
    with pytest.raises(ValueError, match=message):
        _load_mnist_from(tmp_path / "i", tmp_path / "l")


def test_damaged_mnist_files_say_so(data_dir: Path) -> None:
    real = resources.files("paft") / "data"
    (data_dir / MNIST_IMAGES_FILE).write_bytes((real / MNIST_IMAGES_FILE).read_bytes())
    with pytest.raises(DataFileError, match=f"{MNIST_LABELS_FILE} cannot be read.*reinstall paft"):
        mnist_datasets()
    (data_dir / MNIST_LABELS_FILE).write_bytes((real / MNIST_LABELS_FILE).read_bytes()[:100])
    with pytest.raises(DataFileError, match=f"{MNIST_LABELS_FILE}: corrupt gzip stream.*reinstall paft"):
        mnist_datasets()
    # Consistent files too small to split: the validation split would be empty (its
    # loss a division by zero), so they are refused.
    (data_dir / MNIST_IMAGES_FILE).write_bytes(_idx_bytes(0x803, (8000, 28, 28), bytes(8000 * 28 * 28)))
    (data_dir / MNIST_LABELS_FILE).write_bytes(_idx_bytes(0x801, (8000,), bytes(8000)))
    with pytest.raises(DataFileError, match="holds 8000 images; paft needs more than 8000"):
        mnist_datasets()


def test_load_mnist_scales_then_normalizes_each_pixel(tmp_path: Path) -> None:
    (tmp_path / "i").write_bytes(_idx_bytes(0x803, (1, 28, 28), bytes([0, 255, 128] + [0] * 781)))
    (tmp_path / "l").write_bytes(_idx_bytes(0x801, (1,), bytes([7])))
    x, y = _load_mnist_from(tmp_path / "i", tmp_path / "l")
    expected = (torch.tensor([0.0, 255.0, 128.0]) / 255 - MNIST_MEAN) / MNIST_STD  # float32, as there
    assert x.shape == (1, 1, 28, 28) and torch.equal(x[0, 0, 0, :3], expected)
    assert y.dtype == torch.int64 and y.tolist() == [7]


@pytest.mark.parametrize("damage", ["truncated", "body"])
def test_read_idx_rejects_corrupt_gzip(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "broken.gz"
    packed = gzip.compress(_idx_bytes(0x803, (1, 28, 28), bytes(range(256)) * 3 + bytes(16)))
    # A damaged body raised zlib.error, not the ValueError naming the file.
    flipped = packed[:12] + bytes(b ^ 0xFF for b in packed[12:40]) + packed[40:]
    packed = packed[:-20] if damage == "truncated" else flipped
    path.write_bytes(packed)
    with pytest.raises(ValueError, match="broken.gz"):
        read_idx(path, 0x803)


def test_array_dataset_checks_lengths() -> None:
    with pytest.raises(ValueError, match="item count"):
        ArrayDataset(torch.zeros(3, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="block_size"):
        TokenDataset(torch.arange(10), 0)
    with pytest.raises(ValueError, match="needs at least 5 tokens, got 4"):  # not one window: empty
        TokenDataset(torch.arange(4), 4)
    assert len(TokenDataset(torch.arange(5), 4)) == 1
    with pytest.raises(ValueError, match=r"1-D, got shape \(2, 5\)"):
        TokenDataset(torch.zeros(2, 5, dtype=torch.long), 4)


# --------------------------------------------------------------------- sampler


def _epoch(sampler: ShardedSampler) -> torch.Tensor:
    return torch.cat([sampler.next_batch() for _ in range(sampler.batches_per_epoch)])


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_shards_are_disjoint_and_cover_the_epoch(shuffle: bool) -> None:
    n, ws, bs = 103, 4, 5
    samplers = [ShardedSampler(n, r, ws, bs, seed=7, shuffle=shuffle) for r in range(ws)]
    assert all(s.batches_per_epoch == 5 for s in samplers)
    for _epoch_no in range(3):
        shards = [_epoch(s) for s in samplers]
        assert all(sh.numel() == 25 for sh in shards)
        union = torch.cat(shards)
        assert union.unique().numel() == 100  # disjoint; only the 3-item tail dropped
        # Together the ranks cover exactly the first 100 items of the epoch permutation.
        if not shuffle:
            assert torch.equal(union.sort().values, torch.arange(100))
    # Epochs differ when shuffling, repeat when not.
    s = ShardedSampler(n, 0, ws, bs, seed=7, shuffle=shuffle)
    e0, e1 = _epoch(s), _epoch(s)
    assert torch.equal(e0, e1) != shuffle


def test_sampler_matches_the_shared_permutation() -> None:
    s = ShardedSampler(50, 1, 2, 4, seed=3)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_epoch(s), perm[:48][1::2])
    second = int.from_bytes(hashlib.blake2b(b"3/1", digest_size=4).digest(), "little")
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(second))
    assert torch.equal(_epoch(s), perm[:48][1::2])
    # Seed 4's first epoch is not seed 3's second (the epoch is not added to the seed).
    assert not torch.equal(_epoch(ShardedSampler(50, 1, 2, 4, seed=4)), perm[:48][1::2])


def test_sampler_is_deterministic_and_infinite() -> None:
    a = ShardedSampler(40, 1, 2, 3, seed=11)
    b = ShardedSampler(40, 1, 2, 3, seed=11)
    c = ShardedSampler(40, 1, 2, 3, seed=12)
    xs = [next(it) for it in [iter(a)] for _ in range(20)]  # crosses 3 epoch boundaries
    ys = [b.next_batch() for _ in range(20)]
    zs = [c.next_batch() for _ in range(20)]
    assert all(torch.equal(x, y) for x, y in zip(xs, ys))
    assert not all(torch.equal(x, z) for x, z in zip(xs, zs))
    assert all(x.dtype == torch.int64 and x.numel() == 3 for x in xs)
    assert a.state_dict() == {"epoch": 3, "position": 2}


def test_sampler_state_dict_resume() -> None:
    ref = ShardedSampler(60, 2, 3, 4, seed=5)
    for _ in range(7):  # mid second epoch (5 batches per epoch)
        ref.next_batch()
    state = ref.state_dict()
    assert state == {"epoch": 1, "position": 2}
    expected = [ref.next_batch() for _ in range(12)]
    resumed = ShardedSampler(60, 2, 3, 4, seed=5)
    resumed.load_state_dict(state)
    assert all(torch.equal(e, r) for e, r in zip(expected, (resumed.next_batch() for _ in range(12))))
    # A state saved exactly at an epoch boundary resumes too.
    boundary = ShardedSampler(60, 2, 3, 4, seed=5)
    boundary.load_state_dict({"epoch": 0, "position": 5})
    fresh = ShardedSampler(60, 2, 3, 4, seed=5)
    fresh.load_state_dict({"epoch": 1, "position": 0})
    assert torch.equal(boundary.next_batch(), fresh.next_batch())
    with pytest.raises(ValueError, match="position"):
        resumed.load_state_dict({"epoch": 0, "position": 6})
    with pytest.raises(ValueError, match="position must be in"):  # a negative slice start
        resumed.load_state_dict({"epoch": 0, "position": -1})
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        resumed.load_state_dict({"epoch": -1, "position": 0})


def test_sampler_desync_gives_uncoordinated_orders() -> None:
    n, ws, bs = 64, 2, 8
    synced = [_epoch(ShardedSampler(n, r, ws, bs, seed=0)) for r in range(ws)]
    desynced = [_epoch(ShardedSampler(n, r, ws, bs, seed=0, desync=True)) for r in range(ws)]
    assert torch.cat(synced).unique().numel() == n
    # Each desynced rank uses its own permutation (seeded from seed, rank and epoch).
    for r in range(ws):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(1000003 * r))
        assert torch.equal(desynced[r], perm[r::ws])
    assert not torch.equal(desynced[0], desynced[1])
    assert torch.cat(desynced).unique().numel() < n  # shards now overlap
    # Rank 0's desynced order coincides with the synced one (same seed); others do not.
    assert torch.equal(desynced[0], synced[0]) and not torch.equal(desynced[1], synced[1])


def test_sampler_desync_lasts_past_the_first_epoch() -> None:
    # Epochs after the first hash (rank's seed, epoch): mutants that hashed the shared
    # seed there, or desynced epoch 0 only, put every rank back on one permutation.
    n, ws, bs = 64, 2, 8
    samplers = [ShardedSampler(n, r, ws, bs, seed=5, desync=True) for r in range(ws)]
    first = [_epoch(s) for s in samplers]
    second = [_epoch(s) for s in samplers]
    for r in range(ws):
        own = int.from_bytes(hashlib.blake2b(f"{5 + 1000003 * r}/1".encode(), digest_size=4).digest(), "little")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(own))
        assert torch.equal(second[r], perm[r::ws]) and not torch.equal(second[r], first[r])
    assert torch.cat(second).unique().numel() < n  # still overlapping shards


def test_sampler_batches_are_copies_a_rewind_sees_unchanged() -> None:
    # A caller that edits its batch in place, then loads a saved state of the same epoch
    # (a recompute), must get the original indices back: the batch is not a view of the
    # cached epoch order (a mutant that returned the view survived before).
    s = ShardedSampler(40, 1, 2, 4, seed=9)
    state = s.state_dict()
    batch = s.next_batch()
    original = batch.clone()
    batch.fill_(0)
    s.load_state_dict(state)
    assert torch.equal(s.next_batch(), original)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_items=10, rank=2, world_size=2, batch_size=1), "rank"),
        (dict(num_items=10, rank=-1, world_size=2, batch_size=1), "rank"),
        (dict(num_items=10, rank=0, world_size=0, batch_size=1), "world_size"),
        (dict(num_items=10, rank=0, world_size=2, batch_size=0), "batch_size"),
        (dict(num_items=10, rank=0, world_size=4, batch_size=3), "num_items"),
    ],
)
def test_sampler_validation(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ShardedSampler(seed=0, **kwargs)
