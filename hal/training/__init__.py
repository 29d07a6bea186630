"""Training an EAGLE head or a DSpark block drafter by self-distillation (``spec-hal train-head``,
`command`): the prompt set and feature extraction (`data`, `block_data`), the training loops
(`train`, `block_train`) and the block drafter's confidence head refitted on held-back sequences
(`confidence`)."""
