"""The engine's runtime pieces: building what a rank trains (model.py), its optimizer and
schedule (optim.py), the pipeline glue (pipe.py), ``initialize`` (initialize.py), the
training loop of the entry point (trainer.py) and greedy sampling (generate.py)."""
