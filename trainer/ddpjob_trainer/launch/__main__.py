"""`python -m ddpjob_trainer.launch`: the pod's entry point (contract.LAUNCHER)."""
import sys

from .node import main

sys.exit(main())
