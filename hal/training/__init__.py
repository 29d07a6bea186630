"""Training an EAGLE head by self-distillation (``spec-hal train-head``): the prompt set and
feature extraction (`data`) and the training loop (`train`)."""
