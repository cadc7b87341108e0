"""The built-in trainer's defaults that the operator also needs: it sizes a pod's /dev/shm from the
loader and the snapshots the trainer will hold (builders/shm.py), and cannot import the trainer.
The trainer's config (ddpjob_trainer.config) and its `numWorkers: auto` rule (tuning.py) take them
from here. spec.trainer's schema in the CRD gives no `default:` (the trainer owns its config)."""
from __future__ import annotations

DATASET = "digits"
MODEL = "convnet"
BATCH_SIZE = 64
PREFETCH_FACTOR = 2                   # batches each DataLoader worker keeps ready
IMAGE_SIZE = 224                      # imagefolder's resize
SYNTHETIC_SHAPE = (3, 32, 32)
NUM_CLASSES = 10                      # synthetic's (digits has 10 too)
OPTIMIZER = "sgd"
MOMENTUM = 0.9
SNAPSHOT_EVERY_STEPS = 10
# numWorkers: auto gives in-memory data sets no worker (it would only add IPC), others at most this.
IN_MEMORY_DATASETS = ("digits", "synthetic")
MAX_AUTO_WORKERS = 8
