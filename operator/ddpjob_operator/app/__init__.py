"""The operator process: kopf handlers, the Reconciler that wires the layers below together, the operator's own metrics, and its entry point."""
