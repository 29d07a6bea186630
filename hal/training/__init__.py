"""Training an EAGLE head or a DSpark block drafter by self-distillation (``spec-hal train-head``,
`command`): the prompt set and feature extraction (`data`, `block_data`) and the training loops
(`train`, `block_train`)."""
