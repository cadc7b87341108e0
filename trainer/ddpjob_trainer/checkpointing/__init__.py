"""Checkpoints: the Checkpointer the training loop drives, the raw-file storage layer under torch.distributed.checkpoint, and its parallel file I/O."""
