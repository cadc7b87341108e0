"""Data sets, the resumable training sampler and the exact (unpadded) evaluation shards."""
from __future__ import annotations

import math
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset, get_worker_info

from .config import TrainerConfig
from .errors import ConfigError

DIGITS_VAL_FRACTION = 0.2
SPLIT_SEED = 0  # the train/val split must never depend on the run's seed


@dataclass(frozen=True)
class DataBundle:
    """Train and validation sets plus what a model needs to know about them."""

    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...]
    num_classes: int
    random_train_transform: bool = False  # augmentation draws random numbers per sample


def _split(n: int, val_fraction: float) -> tuple[list[int], list[int]]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_val = round(n * val_fraction)
    return perm[n_val:], perm[:n_val]


def _digits_arrays():
    """(images 1797x8x8, labels) of scikit-learn's bundled digits, as `load_digits` returns them.

    Read from the CSV scikit-learn ships, without importing scikit-learn: `sklearn.datasets` pulls
    in scipy, 2.7 s on the 2-core CI machine, as long as torch's own import, on every start of a
    worker, so on every in-place restart's path (docs/restarts.md). The file's layout (64 pixel
    columns, then the label) is what `load_digits` reads; tests/unit hold the two equal. Where the
    file is not where it was, `load_digits` itself.
    """
    import gzip
    from importlib.util import find_spec

    import numpy as np

    spec = find_spec("sklearn")  # finds the package without running it
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits
        d = load_digits()
        return d.images, d.target
    with gzip.open(csv, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def digits() -> DataBundle:
    """scikit-learn's bundled 8x8 digits (1797 images, no download): 1438 train / 359 val."""
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.long)
    train_idx, val_idx = _split(len(y), DIGITS_VAL_FRACTION)
    full = TensorDataset(x, y)
    return DataBundle(Subset(full, train_idx), Subset(full, val_idx), (1, 8, 8), 10)


def synthetic(cfg: TrainerConfig) -> DataBundle:
    """Generated tensors; the label is argmax of a fixed projection, so the task is learnable."""
    s = cfg.synthetic
    g = torch.Generator().manual_seed(s.seed)
    n = s.train_size + s.val_size
    x = torch.randn((n, *s.shape), generator=g)
    w = torch.randn((math.prod(s.shape), s.num_classes), generator=g)
    y = (x.flatten(1) @ w).argmax(1)
    return DataBundle(TensorDataset(x[: s.train_size], y[: s.train_size]),
                      TensorDataset(x[s.train_size:], y[s.train_size:]), tuple(s.shape), s.num_classes)


def _image_folder(path: str, key: str, transform):
    from torchvision.datasets import ImageFolder

    if not os.path.isdir(path):
        raise ConfigError(f"spec.trainer.{key}: {path} does not exist or is not a directory")
    try:
        return ImageFolder(path, transform=transform)
    except (FileNotFoundError, RuntimeError) as exc:
        raise ConfigError(f"spec.trainer.{key}: {path} holds no class folders with images ({exc})") from None


def imagefolder(cfg: TrainerConfig) -> DataBundle:
    """Class-per-folder images on a volume; without valPath a fixed 10% of dataPath is held out."""
    from torchvision import transforms as T

    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    size = cfg.image_size
    train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    val_tf = T.Compose([T.Resize(int(size * 1.14)), T.CenterCrop(size), T.ToTensor(), norm])
    train = _image_folder(cfg.data_path, "dataPath", train_tf)
    if cfg.val_path:
        val = _image_folder(cfg.val_path, "valPath", val_tf)
    else:
        train_idx, val_idx = _split(len(train), 0.1)
        val = Subset(_image_folder(cfg.data_path, "dataPath", val_tf), val_idx)
        train = Subset(train, train_idx)
    return DataBundle(train, val, (3, size, size), len(_classes(train)), random_train_transform=True)


def _classes(ds) -> list[str]:
    return ds.dataset.classes if isinstance(ds, Subset) else ds.classes  # type: ignore[attr-defined]


def build_data(cfg: TrainerConfig) -> DataBundle:
    """The data set named by cfg.dataset."""
    if cfg.dataset == "digits":
        return digits()
    if cfg.dataset == "synthetic":
        return synthetic(cfg)
    return imagefolder(cfg)


def epoch_order(n: int, *, seed: int, epoch: int) -> list[int]:
    """The epoch's order of the n training samples: a pure function of (seed, epoch), the same at
    every world size (DistributedSampler's permutation, so an unresized run is unchanged)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def rank_share(order: list[int], *, start: int, rank: int, world_size: int) -> list[int]:
    """This rank's part of the samples the epoch has left (`order[start:]`, `start` a global offset).

    Strided, padded to a multiple of the world size with the epoch's first samples (as
    DistributedSampler pads): after every rank took k samples, the group has taken exactly
    order[start:start + k * world_size], so the position stays one global offset whatever the
    world size was when a checkpoint recorded it, and the rest re-splits over any new one. At
    start 0 this is DistributedSampler's split.
    """
    rest = order[start:]
    pad = -len(rest) % world_size
    if pad:
        rest = rest + (order * math.ceil(pad / len(order)))[:pad]
    return rest[rank::world_size]


def advance(samples_done: int, *, taken: int, world_size: int, n: int) -> int:
    """The epoch's global offset once every rank took `taken` more samples (the padding at an epoch's
    end takes no new sample: the offset stops at n)."""
    return min(n, samples_done + taken * world_size)


def steps_left(n: int, *, epoch: int, samples_done: int, epochs: int, world_size: int, batch_size: int,
               grad_accum_steps: int) -> int:
    """Optimizer steps from a position (epoch, its global offset) to the end of `epochs`, at this
    world size: each rank's share in micro-batches, grad_accum_steps of them per step."""
    def steps(remaining: int) -> int:
        micro = math.ceil(math.ceil(remaining / world_size) / batch_size)
        return math.ceil(micro / grad_accum_steps)
    if epoch >= epochs:
        return 0
    return steps(n - samples_done) + (epochs - epoch - 1) * steps(n)


class ResumableSampler(Sampler):
    """The training sampler: this rank's share of the rest of an epoch (`rank_share`).

    The order is a pure function of (seed, epoch), so skipping what a checkpoint says was consumed
    yields exactly the samples an uninterrupted run would still have seen, at the world size of
    that run or at another one (a resized elastic job).
    """

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int, tag_epoch: bool = False) -> None:
        self.n = len(dataset)  # type: ignore[arg-type]  # torch's Dataset is not Sized; ours are
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.tag_epoch = tag_epoch  # yield (epoch, index) keys for PerSampleSeeded
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start: int = 0) -> None:  # torch's sampler API
        """Select the epoch's order and where in it (a global sample offset) to begin."""
        self.epoch, self.start = epoch, start
        self.share = rank_share(epoch_order(self.n, seed=self.seed, epoch=epoch), start=start, rank=self.rank,
                                world_size=self.num_replicas)

    def __iter__(self) -> Iterator[Any]:
        if self.tag_epoch:
            return iter([(self.epoch, i) for i in self.share])
        return iter(self.share)

    def __len__(self) -> int:
        return len(self.share)


def eval_shard(n: int, *, rank: int, world_size: int) -> list[int]:
    """This rank's validation indices: strided, unpadded, so each sample is counted exactly once."""
    return list(range(rank, n, world_size))


class PerSampleSeeded(Dataset):
    """Random augmentation as a pure function of (seed, epoch, sample index).

    Indexed by the (epoch, index) keys of ResumableSampler(tag_epoch=True). Each sample's
    transform draws from RNGs seeded for that sample alone, so what it produces does not depend
    on which worker loads it, how many workers there are, whether they persist across epochs, or
    whether the run was resumed: resume stays bit-exact with DataLoader workers.
    """

    def __init__(self, dataset: Dataset, *, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # torch's Dataset is not Sized; ours are

    def sample_seed(self, epoch: int, index: int) -> int:
        """The seed of one sample's augmentation."""
        return ((self.seed * 1_000_003 + epoch) * 2_147_483_647 + index) % (2**63)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        s = self.sample_seed(epoch, index)
        if get_worker_info() is not None:  # a worker's RNGs serve only its samples
            torch.manual_seed(s)
            random.seed(s)
            return self.dataset[index]
        # In the training process the global RNGs also drive dropout: leave them untouched.
        py_state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s)
            random.seed(s)
            try:
                return self.dataset[index]
            finally:
                random.setstate(py_state)


def ignore_sigterm(_worker_id: int) -> None:
    """A loader worker's init: the launcher's SIGTERM reaches every process of the pod, and a
    worker killed by it fails the rank's next batch, before the rank can save on the stop
    (preempt.py). The worker still ends with its rank (torch's workers watch their parent)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def loader_kwargs(*, workers: int, prefetch_factor: int, pin_memory: bool) -> dict[str, Any]:
    """DataLoader options shared by the training and evaluation loaders."""
    extra: dict[str, Any] = {"prefetch_factor": prefetch_factor, "persistent_workers": True,
                             "worker_init_fn": ignore_sigterm} if workers else {}
    return {"num_workers": workers, "pin_memory": pin_memory, **extra}


def eval_loader(val: Dataset, *, rank: int, world_size: int, batch_size: int, **kwargs) -> DataLoader:
    """This rank's exact evaluation shard; built once, its workers (if any) kept between epochs."""
    shard = Subset(val, eval_shard(len(val), rank=rank, world_size=world_size))  # type: ignore[arg-type]  # Dataset is not Sized
    # Its own generator: without one, each new iterator draws its workers' base seed from the
    # global RNG, shifting the dropout stream by one draw per evaluation whenever the workers
    # are (re)started, and a resumed run restarts them: resume would not be bit-exact.
    return DataLoader(shard, batch_size=batch_size, shuffle=False, generator=torch.Generator(),
                      **loader_kwargs(**kwargs))
