"""Pure builders of the cluster objects of a DDPJob (pods, Service, env, PodGroup, Kueue labels): plain data in, manifests out. Import only api."""
