"""The DDPJob API, the bottom layer: the resource's spec, CRD schema and validation, labels, phases and conditions, the operator's settings, and what a pod says about itself."""
