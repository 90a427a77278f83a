"""SP-Prac artifacts: the store (saved, checked tensors) and how they are prepared."""

from .store import ArtifactError, ArtifactMismatchError, Artifacts, load_artifacts

__all__ = ["ArtifactError", "ArtifactMismatchError", "Artifacts", "load_artifacts"]
