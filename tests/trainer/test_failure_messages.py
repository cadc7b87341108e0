"""A failing rank's exception reaches the node's termination message (and from there the job's
status.failures) when the rank runs under real torchrun: the built-in trainer records it itself,
a user's script does so by decorating its entrypoint with torch.distributed.elastic's @record, and
torchrun copies the first failed worker's record to the file the launcher named."""
from __future__ import annotations

import sys
import textwrap

USER_SCRIPT = textwrap.dedent("""
    import os
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if os.environ["RANK"] == "1":
            raise FileNotFoundError("no such dataset: /data/imagenet")

    main()
""")


def test_a_user_script_with_record_under_torchrun_names_its_error(termination_log, monkeypatch, tmp_path):
    from ddpjob_trainer.launch.node import main

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    assert main(["--", *cmd]) == 1
    text = termination_log.read_text()
    assert text.startswith("training exited with code 1\nTraceback (most recent call last):"), text
    assert text.endswith("FileNotFoundError: no such dataset: /data/imagenet"), text
