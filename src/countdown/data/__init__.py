"""Offline models and text: the model catalogue and loaders (``models.py``), the checked model cache
(``model_cache.py``), held-out evaluation and calibration text (``texts.py``, ``code_text.py``)."""
