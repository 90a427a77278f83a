"""The model side: finding Gated-MLPs, fingerprints, tensor parallelism, saving and loading folders."""
