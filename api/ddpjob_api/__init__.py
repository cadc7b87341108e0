"""The DDPJob API both the operator and the trainer stand on: the CRD, the typed spec, the contract, phases and reasons, names."""
