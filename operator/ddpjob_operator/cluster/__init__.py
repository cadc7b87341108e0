"""The I/O: the Kubernetes client and its fair slots, the informer caches, the scrape of the trainers' metrics and the monitor that drives it."""
