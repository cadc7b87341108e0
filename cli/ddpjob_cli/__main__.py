"""`python -m ddpjob_cli` is the `ddpjob` command."""
from .main import main

main()
