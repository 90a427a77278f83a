"""Sparsification methods: how each scores rows and picks them (the registry), TEAL on the inputs."""
