"""The `ddpjob` command line and the local runner (`ddpjob run FILE --local`).

A package of its own so that the operator package neither runs training processes nor imports
the trainer's launcher: the runner drives the operator's pure pieces (the pod's env and command,
`lifecycle.decide`) with processes on this machine instead of pods.
"""
