"""The library training loop (``Trainer``) behind the thin CLI ``launch/train.py``."""
