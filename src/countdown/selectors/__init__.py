"""SP-Prac: picking rows at run time without the exact indicator, one file per selector kind.

``base.py`` says what every kind provides and holds the registry; ``kinds.py`` imports each kind
(one line a kind: that import registers it); ``prepare.py`` builds artifacts for any kind,
``cuts.py`` estimates and refits per-layer cuts, ``capture.py`` fits kinds layer by layer with
resumable checkpoints, ``quality.py`` measures masks against the oracle. This file imports nothing,
so that the patching code can import ``prac.base`` without pulling in every kind.
"""
